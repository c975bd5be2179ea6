// Package portfwd makes TCP servers that listen only on the sandbox's loopback
// (127.0.0.1, localhost, ::1) reachable from outside the sandbox, as E2B's envd
// does: the host's proxy connects to the sandbox's own address, where nothing
// listens for such a server, so envd listens there in its place and relays each
// connection to the loopback listener.
//
// Listeners are found in /proc/net/tcp and /proc/net/tcp6 (Linux's format,
// which gVisor's netstack reproduces; proc(5) "/proc/net/tcp").
package portfwd

import (
	"bufio"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// tcpListen is the "st" column value of a listening socket (include/net/tcp_states.h
// TCP_LISTEN = 10).
const tcpListen = "0A"

// Listener is one listening TCP socket: its local address and port.
type Listener struct {
	IP   net.IP
	Port uint16
}

// ReadListeners returns the listening sockets of procNet/tcp and procNet/tcp6
// (procNet is normally "/proc/net"). A missing file (no IPv6) counts as empty;
// a line that does not parse is skipped.
func ReadListeners(procNet string) ([]Listener, error) {
	var out []Listener
	for _, name := range []string{"tcp", "tcp6"} {
		f, err := os.Open(filepath.Join(procNet, name))
		if err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return nil, err
		}
		ls, err := parseListeners(f)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out = append(out, ls...)
	}
	return out, nil
}

// parseListeners reads one /proc/net/tcp{,6} table: a header line, then per
// socket "sl local_address rem_address st ...", with local_address as
// ADDR:PORT in hex (ADDR: 4-byte words in host byte order, little-endian here).
func parseListeners(r io.Reader) ([]Listener, error) {
	var out []Listener
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	first := true
	for sc.Scan() {
		if first {
			first = false
			continue
		}
		f := strings.Fields(sc.Text())
		if len(f) < 4 || f[3] != tcpListen {
			continue
		}
		ip, port, ok := parseAddr(f[1])
		if ok {
			out = append(out, Listener{IP: ip, Port: port})
		}
	}
	return out, sc.Err()
}

func parseAddr(s string) (net.IP, uint16, bool) {
	addr, portHex, found := strings.Cut(s, ":")
	if !found {
		return nil, 0, false
	}
	port, err := strconv.ParseUint(portHex, 16, 16)
	if err != nil {
		return nil, 0, false
	}
	raw, err := hex.DecodeString(addr)
	if err != nil || (len(raw) != 4 && len(raw) != 16) {
		return nil, 0, false
	}
	ip := make(net.IP, len(raw))
	for w := 0; w < len(raw); w += 4 { // each 32-bit word is little-endian
		ip[w], ip[w+1], ip[w+2], ip[w+3] = raw[w+3], raw[w+2], raw[w+1], raw[w]
	}
	return ip, uint16(port), true
}
