package server

import (
	"errors"
	"net"
	"testing"
	"time"
)

func newRearm(t *testing.T, poll time.Duration) *RearmListener {
	t.Helper()
	tl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := NewRearmListener(tl.(*net.TCPListener), poll)
	t.Cleanup(func() { l.Close() })
	return l
}

// acceptAsync runs one Accept in the background.
func acceptAsync(l *RearmListener) chan error {
	ch := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			_, err = c.Write([]byte("x"))
			c.Close()
		}
		ch <- err
	}()
	return ch
}

func dialRead(t *testing.T, addr string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(3 * time.Second))
	b := make([]byte, 1)
	if _, err := c.Read(b); err != nil || b[0] != 'x' {
		t.Fatalf("read from accepted conn: %v %q", err, b)
	}
}

func wait(t *testing.T, ch chan error) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(3 * time.Second):
		t.Fatal("Accept did not return")
		return nil
	}
}

func TestRearmListenerAcceptAcrossPolls(t *testing.T) {
	l := newRearm(t, 20*time.Millisecond)
	ch := acceptAsync(l)
	time.Sleep(100 * time.Millisecond) // several poll timeouts pass inside Accept
	dialRead(t, l.Addr().String())
	if err := wait(t, ch); err != nil {
		t.Fatal(err)
	}
}

func TestRearmWhileAcceptBlockedKeepsSocketAndQueue(t *testing.T) {
	l := newRearm(t, time.Hour)
	addr := l.Addr().String()
	ch := acceptAsync(l)
	time.Sleep(20 * time.Millisecond)
	for i := 0; i < 3; i++ {
		if err := l.Rearm(); err != nil {
			t.Fatal(err)
		}
	}
	if got := l.Addr().String(); got != addr {
		t.Fatalf("address changed: %s -> %s", addr, got)
	}
	dialRead(t, addr)
	if err := wait(t, ch); err != nil {
		t.Fatal(err)
	}

	// A connection queued before a rearm is still accepted after it.
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	time.Sleep(20 * time.Millisecond)
	if err := l.Rearm(); err != nil {
		t.Fatal(err)
	}
	ch = acceptAsync(l)
	if err := wait(t, ch); err != nil {
		t.Fatal(err)
	}
}

func TestRearmListenerClose(t *testing.T) {
	l := newRearm(t, time.Hour)
	ch := acceptAsync(l)
	time.Sleep(20 * time.Millisecond)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	if err := wait(t, ch); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
	}
	if err := l.Rearm(); err != nil {
		t.Fatalf("Rearm after Close: %v", err)
	}
	if _, err := net.DialTimeout("tcp", l.Addr().String(), time.Second); err == nil {
		t.Fatal("socket still listening after Close")
	}
}
