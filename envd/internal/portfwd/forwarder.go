package portfwd

import (
	"context"
	"errors"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Scan periods (see Forwarder.Run). One scan (open and read /proc/net/tcp and
// tcp6) cost ~0.7 ms of the sandbox's CPU under gVisor, measured on the host's
// cgroup (2,000 scans: 1.4-1.5 s); an idle sandbox used ~8 ms/s then. E2B's
// envd scans every second always.
const (
	// FastPeriod applies for FastWindow after a process was started: a server
	// started by a command is reachable within ~0.1 s of binding.
	FastPeriod = 100 * time.Millisecond
	FastWindow = 3 * time.Second
	// BusyPeriod applies while envd runs a process of its own or forwards a port.
	BusyPeriod = time.Second
	// IdlePeriod bounds the delay for a server bound later by a process that
	// outlived its command (nohup ... &), for 0.14 ms/s of CPU.
	IdlePeriod = 5 * time.Second
	// MaxConns bounds the relayed connections open at once (all ports); more
	// are closed as soon as accepted.
	MaxConns    = 4096
	dialTimeout = 5 * time.Second
)

// Forwarder keeps one listener per port that has a loopback-only server, on
// each of the sandbox's own addresses (BindAddrs), relaying every accepted
// connection to that server (E2B envd: socat from 169.254.0.21:PORT to
// 127.0.0.1:PORT; here in-process, as a process start costs ~14 ms under
// gVisor). A port that something already serves on a wildcard or on the
// sandbox's own address is left alone; a forward ends once its loopback server
// is gone (its open connections carry on). Safe for concurrent use.
type Forwarder struct {
	// ProcNet is where the tcp and tcp6 tables are read ("/proc/net").
	ProcNet string
	// BindAddrs returns the addresses to listen on in the loopback servers'
	// place; nil: the IPv4 addresses of every up, non-loopback interface.
	BindAddrs func() []net.IP
	// Busy reports whether envd runs a process of its own (scan every
	// BusyPeriod then); nil: never.
	Busy func() bool
	// Logf logs forwards started, stopped and failed; nil: silent.
	Logf func(format string, args ...any)

	mu     sync.Mutex
	fwds   map[uint16]*forward
	failed map[uint16]string // port -> last bind error, logged once
	kicked time.Time
	wake   chan struct{}
	conns  atomic.Int64
}

type forward struct {
	port   uint16
	target string // "127.0.0.1:PORT" or "[::1]:PORT"
	lns    []net.Listener
	addrs  map[string]bool // the IPs listened on
}

// New returns a Forwarder reading /proc/net.
func New() *Forwarder {
	return &Forwarder{ProcNet: "/proc/net"}
}

// Kick says a process was just started: scan at FastPeriod for FastWindow.
func (f *Forwarder) Kick() {
	f.mu.Lock()
	f.kicked = time.Now()
	w := f.wakeChan()
	f.mu.Unlock()
	select {
	case w <- struct{}{}:
	default:
	}
}

func (f *Forwarder) wakeChan() chan struct{} {
	if f.wake == nil {
		f.wake = make(chan struct{}, 1)
	}
	return f.wake
}

// Run scans until ctx ends: every FastPeriod within FastWindow of a Kick,
// every BusyPeriod while Busy or while a port is forwarded, else every
// IdlePeriod. Forwards are closed when it returns.
func (f *Forwarder) Run(ctx context.Context) {
	defer f.closeAll()
	for {
		if err := f.Scan(); err != nil {
			f.logf("port forwarding: scan failed: %v", err)
		}
		timer := time.NewTimer(f.period())
		f.mu.Lock()
		w := f.wakeChan()
		f.mu.Unlock()
		select {
		case <-ctx.Done():
			timer.Stop()
			return
		case <-w:
			timer.Stop()
		case <-timer.C:
		}
	}
}

func (f *Forwarder) period() time.Duration {
	f.mu.Lock()
	fast, forwarding := time.Since(f.kicked) < FastWindow, len(f.fwds) > 0
	f.mu.Unlock()
	switch {
	case fast:
		return FastPeriod
	case forwarding || (f.Busy != nil && f.Busy()):
		return BusyPeriod
	default:
		return IdlePeriod
	}
}

// Ports returns the forwarded ports and their targets (for tests and logs).
func (f *Forwarder) Ports() map[uint16]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[uint16]string, len(f.fwds))
	for p, fw := range f.fwds {
		out[p] = fw.target
	}
	return out
}

// Scan reads the listening sockets once and starts or stops forwards to match.
func (f *Forwarder) Scan() error {
	ls, err := ReadListeners(f.ProcNet)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.fwds == nil {
		f.fwds = map[uint16]*forward{}
		f.failed = map[uint16]string{}
	}
	targets := map[uint16]string{}
	covered := map[uint16]bool{}
	var bind []net.IP // looked up only when needed
	for _, l := range ls {
		ip := l.IP
		if v4 := ip.To4(); v4 != nil {
			ip = v4 // ::ffff:a.b.c.d in tcp6
		}
		if fw := f.fwds[l.Port]; fw != nil && fw.addrs[ip.String()] {
			continue // our own listener
		}
		switch {
		case ip.IsLoopback():
			t := net.JoinHostPort(ip.String(), strconv.Itoa(int(l.Port)))
			if _, have := targets[l.Port]; !have || ip.To4() != nil {
				targets[l.Port] = t // IPv4 preferred when both exist
			}
		default:
			// A wildcard (0.0.0.0, ::) or the sandbox's own address: the
			// port is reachable already (or taken by someone else).
			covered[l.Port] = true
		}
	}
	for port, fw := range f.fwds {
		if t, want := targets[port]; !want || covered[port] || t != fw.target {
			f.stopLocked(fw)
		}
	}
	for port := range f.failed {
		if _, want := targets[port]; !want {
			delete(f.failed, port)
		}
	}
	for port, target := range targets {
		if covered[port] || f.fwds[port] != nil {
			continue
		}
		if bind == nil {
			bind = f.bindAddrs()
		}
		f.startLocked(port, target, bind)
	}
	return nil
}

func (f *Forwarder) bindAddrs() []net.IP {
	if f.BindAddrs != nil {
		return f.BindAddrs()
	}
	var out []net.IP
	ifaces, err := net.Interfaces()
	if err != nil {
		return nil
	}
	for _, ifc := range ifaces {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil {
				out = append(out, n.IP.To4())
			}
		}
	}
	return out
}

func (f *Forwarder) startLocked(port uint16, target string, bind []net.IP) {
	fw := &forward{port: port, target: target, addrs: map[string]bool{}}
	var errs []error
	for _, ip := range bind {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip.String(), strconv.Itoa(int(port))))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		fw.lns = append(fw.lns, ln)
		fw.addrs[ip.String()] = true
		go f.serve(ln, target)
	}
	if len(fw.lns) == 0 {
		msg := "no address to listen on"
		if len(errs) > 0 {
			msg = errors.Join(errs...).Error()
		}
		if f.failed[port] != msg {
			f.failed[port] = msg
			f.logf("port forwarding: cannot forward port %d to %s: %s", port, target, msg)
		}
		return
	}
	delete(f.failed, port)
	f.fwds[port] = fw
	f.logf("port forwarding: %v -> %s", fw.lns[0].Addr(), target)
}

func (f *Forwarder) stopLocked(fw *forward) {
	for _, ln := range fw.lns {
		ln.Close()
	}
	delete(f.fwds, fw.port)
	f.logf("port forwarding: port %d no longer forwarded", fw.port)
}

func (f *Forwarder) closeAll() {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, fw := range f.fwds {
		f.stopLocked(fw)
	}
}

func (f *Forwarder) serve(ln net.Listener, target string) {
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond) // e.g. EMFILE: do not spin
			continue
		}
		if f.conns.Add(1) > MaxConns {
			f.conns.Add(-1)
			c.Close()
			continue
		}
		go func() {
			defer f.conns.Add(-1)
			relay(c, target)
		}()
	}
}

// relay copies both ways between the accepted connection and a new one to
// target, passing each side's end of stream on as a half-close; a refused
// target closes the client's connection.
func relay(client net.Conn, target string) {
	defer client.Close()
	up, err := net.DialTimeout("tcp", target, dialTimeout)
	if err != nil {
		return
	}
	defer up.Close()
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		} else {
			_ = dst.Close()
		}
		done <- struct{}{}
	}
	go pipe(up, client)
	go pipe(client, up)
	<-done
	<-done
}

func (f *Forwarder) logf(format string, args ...any) {
	if f.Logf != nil {
		f.Logf(format, args...)
	}
}
