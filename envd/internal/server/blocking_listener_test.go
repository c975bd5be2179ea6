package server

import (
	"errors"
	"net"
	"testing"
	"time"
)

func TestBlockingListenerAcceptsAndCloseUnblocks(t *testing.T) {
	l, err := ListenBlocking(net.ParseIP("127.0.0.1"), 0)
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if port == 0 {
		t.Fatal("no port assigned")
	}
	got := make(chan error, 1)
	go func() {
		c, err := l.Accept()
		if err == nil {
			_, err = c.Write([]byte("hi"))
			c.Close()
		}
		got <- err
	}()
	c, err := net.DialTimeout("tcp", l.Addr().String(), 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 2)
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Read(buf); err != nil || string(buf) != "hi" {
		t.Fatalf("read %q, %v", buf, err)
	}
	c.Close()
	if err := <-got; err != nil {
		t.Fatal(err)
	}

	blocked := make(chan error, 1)
	go func() { _, err := l.Accept(); blocked <- err }()
	time.Sleep(50 * time.Millisecond)
	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-blocked:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Accept after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Close did not unblock Accept")
	}
}
