package portfwd

import (
	"bufio"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Lines as gVisor's netstack writes them (a sandbox's /proc/net/tcp6 with envd
// on "::" and a connection to it from the host, seen 2026-12-01) and as Linux
// writes /proc/net/tcp (127.0.0.1:8000 listening, a connection established).
const (
	tcp6Text = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   8: 0000000000000000FFFF00001500FEA9:C33F 0000000000000000FFFF00000100DE0A:9E04 01 00000000:00000000 00:00000000 00000000     0        0        9 1 0000000000000000 0 0 0 0 -1
   3: 00000000000000000000000000000000:C33F 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0        4 1 0000000000000000 0 0 0 0 -1
   4: 00000000000000000000000001000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0        5 1 0000000000000000 0 0 0 0 -1
`
	tcpText = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 123 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F40 0100007F:D2F0 01 00000000:00000000 00:00000000 00000000  1000        0 124 1 0000000000000000 20 4 30 10 -1
   2: garbage
`
)

func TestParseListeners(t *testing.T) {
	ls, err := parseListeners(strings.NewReader(tcp6Text))
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != 2 || !ls[0].IP.Equal(net.IPv6unspecified) || ls[0].Port != 49983 ||
		!ls[1].IP.Equal(net.IPv6loopback) || ls[1].Port != 8001 {
		t.Fatalf("tcp6: %+v", ls)
	}
	ls, err = parseListeners(strings.NewReader(tcpText))
	if err != nil {
		t.Fatal(err)
	}
	if len(ls) != 1 || !ls[0].IP.Equal(net.IPv4(127, 0, 0, 1)) || ls[0].Port != 8000 {
		t.Fatalf("tcp: %+v", ls)
	}
}

// echoServer listens on addr and answers each line with "ECHO line".
func echoServer(t *testing.T, network, addr string) net.Listener {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Skipf("cannot listen on %s: %v", addr, err)
	}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, _ := bufio.NewReader(c).ReadString('\n')
				io.WriteString(c, "ECHO "+line)
			}()
		}
	}()
	t.Cleanup(func() { ln.Close() })
	return ln
}

func ask(t *testing.T, addr string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(c, "hi\n")
	b, err := io.ReadAll(c)
	return string(b), err
}

// The host's own /proc/net is read; 127.0.0.2 stands in for the sandbox's
// address (the whole 127/8 is loopback on Linux).
func newTestForwarder() *Forwarder {
	f := New()
	f.BindAddrs = func() []net.IP { return []net.IP{net.IPv4(127, 0, 0, 2)} }
	return f
}

func TestForwardsLoopbackServersUntilTheyStop(t *testing.T) {
	f := newTestForwarder()
	t.Cleanup(f.closeAll)
	v4 := echoServer(t, "tcp4", "127.0.0.1:0")
	port := v4.Addr().(*net.TCPAddr).Port
	if _, err := ask(t, net.JoinHostPort("127.0.0.2", itoa(port))); err == nil {
		t.Fatal("127.0.0.2 answered before any forward")
	}
	if err := f.Scan(); err != nil {
		t.Fatal(err)
	}
	if got := f.Ports()[uint16(port)]; got != v4.Addr().String() {
		t.Fatalf("forwards %v, want port %d -> %s", f.Ports(), port, v4.Addr())
	}
	if got, err := ask(t, net.JoinHostPort("127.0.0.2", itoa(port))); err != nil || got != "ECHO hi\n" {
		t.Fatalf("through the forward: %q %v", got, err)
	}
	// A second scan keeps it (its own listener is not mistaken for another server).
	if err := f.Scan(); err != nil || f.Ports()[uint16(port)] == "" {
		t.Fatalf("second scan dropped the forward: %v %v", f.Ports(), err)
	}
	v4.Close()
	if err := f.Scan(); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.Ports()[uint16(port)]; ok {
		t.Fatal("forward kept after its server stopped")
	}
	if _, err := ask(t, net.JoinHostPort("127.0.0.2", itoa(port))); err == nil {
		t.Fatal("forward still listening after its server stopped")
	}
}

func TestForwardsIPv6LoopbackServers(t *testing.T) {
	f := newTestForwarder()
	t.Cleanup(f.closeAll)
	v6 := echoServer(t, "tcp6", "[::1]:0")
	port := v6.Addr().(*net.TCPAddr).Port
	if err := f.Scan(); err != nil {
		t.Fatal(err)
	}
	if got := f.Ports()[uint16(port)]; got != net.JoinHostPort("::1", itoa(port)) {
		t.Fatalf("forwards %v", f.Ports())
	}
	if got, err := ask(t, net.JoinHostPort("127.0.0.2", itoa(port))); err != nil || got != "ECHO hi\n" {
		t.Fatalf("through the forward: %q %v", got, err)
	}
}

func TestLeavesWildcardServersAlone(t *testing.T) {
	f := newTestForwarder()
	t.Cleanup(f.closeAll)
	any := echoServer(t, "tcp4", "0.0.0.0:0")
	port := any.Addr().(*net.TCPAddr).Port
	if err := f.Scan(); err != nil {
		t.Fatal(err)
	}
	if _, ok := f.Ports()[uint16(port)]; ok {
		t.Fatalf("a wildcard server was forwarded: %v", f.Ports())
	}
}

func TestKickScansAtOnceAndFast(t *testing.T) {
	f := newTestForwarder()
	if p := f.period(); p != IdlePeriod {
		t.Fatalf("idle period %v", p)
	}
	f.Kick()
	if p := f.period(); p != FastPeriod {
		t.Fatalf("period after a kick %v", p)
	}
	f.kicked = time.Now().Add(-FastWindow)
	f.Busy = func() bool { return true }
	if p := f.period(); p != BusyPeriod {
		t.Fatalf("busy period %v", p)
	}
}

func itoa(i int) string { return strconv.Itoa(i) }
