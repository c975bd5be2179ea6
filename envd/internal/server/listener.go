package server

import (
	"errors"
	"net"
	"os"
	"sync"
	"time"
)

// AcceptPoll bounds how long Accept waits on the poller before it asks the
// kernel directly; see RearmListener.
const AcceptPoll = time.Second

// RearmListener is a TCP listener that survives gVisor checkpoint/restore.
//
// Go's poller registers every socket with epoll edge-triggered. After
// `runsc restore` of a checkpoint taken while TCP connections existed
// (runsc --net-disconnect-ok resets them on save), the listening socket's
// existing epoll registration never fires again (runsc 0.0~20240729;
// level-triggered pollers and registrations made after the restore are
// fine). The kernel queues new connections but envd never accepts them:
// clients connect and then wait forever.
//
// Rearm registers the same socket afresh (a dup of its fd gets a new epoll
// entry; the old fd is closed, the socket and its queued connections stay);
// signalling envd (SIGUSR1, see main.go) calls it. The host did so right
// after every restore until the pinned runsc (2026-09) was shown not to need
// it (it marks every epoll interest ready at restore, gVisor PR 14147;
// docs/runtime.md); it still does with FORKYARD_ENVD_REARM=1. As a fallback Accept never waits on the poller for more than
// AcceptPoll: it then calls accept(2) itself, and when that finds a
// connection the poller did not report it rearms. So a missed rearm costs at
// most one AcceptPoll of latency, never a hang.
type RearmListener struct {
	poll time.Duration

	mu     sync.Mutex
	ln     *net.TCPListener
	closed bool
	gen    int // incremented by every rearm
}

// NewRearmListener wraps ln; poll <= 0 means AcceptPoll.
func NewRearmListener(ln *net.TCPListener, poll time.Duration) *RearmListener {
	if poll <= 0 {
		poll = AcceptPoll
	}
	return &RearmListener{ln: ln, poll: poll}
}

func (l *RearmListener) current() (*net.TCPListener, int, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ln, l.gen, l.closed
}

// Accept waits for the next connection.
func (l *RearmListener) Accept() (net.Conn, error) {
	timedOut := false
	for {
		ln, gen, closed := l.current()
		if closed {
			return nil, net.ErrClosed
		}
		_ = ln.SetDeadline(time.Now().Add(l.poll))
		c, err := ln.Accept()
		if err == nil {
			if timedOut {
				// accept(2) found a connection the poller never reported.
				_ = l.rearmIf(gen)
			}
			return c, nil
		}
		var ne net.Error
		switch {
		case errors.As(err, &ne) && ne.Timeout():
			timedOut = true
		case errors.Is(err, net.ErrClosed):
			timedOut = false // rearmed (or closed) under us; look again
		default:
			return nil, err
		}
	}
}

// Rearm re-registers the listening socket with the poller and wakes a
// blocked Accept. Safe to call at any time, from any goroutine.
func (l *RearmListener) Rearm() error {
	_, gen, _ := l.current()
	return l.rearmIf(gen)
}

func (l *RearmListener) rearmIf(gen int) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.gen != gen {
		return nil
	}
	f, err := l.ln.File() // dup(2): same socket, new fd
	if err != nil {
		return err
	}
	defer f.Close()
	nl, err := net.FileListener(f) // dups again, registers with the poller
	if err != nil {
		return err
	}
	tl, ok := nl.(*net.TCPListener)
	if !ok {
		nl.Close()
		return os.ErrInvalid
	}
	old := l.ln
	l.ln, l.gen = tl, l.gen+1
	return old.Close() // closes only the old fd; wakes its Accept
}

// Close stops the listener; a blocked Accept returns net.ErrClosed.
func (l *RearmListener) Close() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return net.ErrClosed
	}
	l.closed = true
	return l.ln.Close()
}

// Addr is the listening address.
func (l *RearmListener) Addr() net.Addr {
	ln, _, _ := l.current()
	return ln.Addr()
}
