package server

import (
	"errors"
	"net"
	"os"
	"sync"
	"syscall"
)

// BlockingListener is a TCP listener whose socket is never registered with
// Go's netpoller: Accept calls accept(2) on a blocking socket (the Go runtime
// parks only the calling thread).
//
// Why: after `runsc restore` of a checkpoint taken while TCP connections
// existed, an edge-triggered epoll registration of the listening socket made
// before the checkpoint never fires again (runsc 0.0~20240729), so a
// netpoller-based Accept waits forever (see RearmListener). A blocking
// accept(2) waits on the socket itself and is restarted by the restored
// kernel, so connections are accepted at once after a restore without any
// signal from the host. Accepted connections are handed to the netpoller as
// usual (registered after the restore, they are fine).
type BlockingListener struct {
	fd   int
	addr *net.TCPAddr

	mu     sync.Mutex
	closed bool
}

// ListenBlocking listens on ip:port (IPv4) with a blocking socket.
func ListenBlocking(ip net.IP, port int) (*BlockingListener, error) {
	ip4 := ip.To4()
	if ip4 == nil {
		return nil, errors.New("ListenBlocking: IPv4 address required")
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, os.NewSyscallError("socket", err)
	}
	if err := syscall.SetsockoptInt(fd, syscall.SOL_SOCKET, syscall.SO_REUSEADDR, 1); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("setsockopt", err)
	}
	sa := &syscall.SockaddrInet4{Port: port}
	copy(sa.Addr[:], ip4)
	if err := syscall.Bind(fd, sa); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("bind", err)
	}
	if err := syscall.Listen(fd, syscall.SOMAXCONN); err != nil {
		syscall.Close(fd)
		return nil, os.NewSyscallError("listen", err)
	}
	addr := &net.TCPAddr{IP: ip4, Port: port}
	if port == 0 {
		if got, err := syscall.Getsockname(fd); err == nil {
			if in4, ok := got.(*syscall.SockaddrInet4); ok {
				addr.Port = in4.Port
			}
		}
	}
	return &BlockingListener{fd: fd, addr: addr}, nil
}

// Accept waits for the next connection.
func (l *BlockingListener) Accept() (net.Conn, error) {
	for {
		nfd, _, err := syscall.Accept4(l.fd, syscall.SOCK_CLOEXEC)
		if err != nil {
			if l.isClosed() {
				return nil, net.ErrClosed
			}
			if errors.Is(err, syscall.EINTR) || errors.Is(err, syscall.ECONNABORTED) || errors.Is(err, syscall.EAGAIN) {
				continue
			}
			return nil, os.NewSyscallError("accept4", err)
		}
		f := os.NewFile(uintptr(nfd), "tcp-conn")
		c, err := net.FileConn(f) // dup: non-blocking, registered with the netpoller now
		f.Close()
		if err != nil {
			continue // the peer went away meanwhile
		}
		return c, nil
	}
}

func (l *BlockingListener) isClosed() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closed
}

// Close stops the listener; a blocked Accept returns net.ErrClosed.
func (l *BlockingListener) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return net.ErrClosed
	}
	l.closed = true
	_ = syscall.Shutdown(l.fd, syscall.SHUT_RDWR) // wakes a blocked accept(2)
	return syscall.Close(l.fd)
}

// Addr is the listening address.
func (l *BlockingListener) Addr() net.Addr { return l.addr }

// Rearm is a no-op (kept so the host's restore signal is harmless).
func (l *BlockingListener) Rearm() error { return nil }
