// Package reaper owns every wait(2) in envd.
//
// envd runs as PID 1, so orphaned processes are re-parented to it and must be
// reaped. A Wait4(-1) loop would race with exec.Cmd.Wait (whichever wins gets
// the exit status, the other gets ECHILD), so envd never calls Cmd.Wait:
// children are started through Reaper.Start, which registers the pid while
// holding the same lock the reap loop takes, and the reap loop hands each exit
// status to whoever registered that pid. Exit statuses of unregistered pids
// (orphans) are simply discarded.
package reaper

import (
	"errors"
	"os"
	"os/exec"
	"os/signal"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ErrProcessGone is returned by Signal when the pid is no longer a live,
// registered child.
var ErrProcessGone = errors.New("process already exited")

// Reaper reaps all children of the current process.
type Reaper struct {
	mu      sync.Mutex
	waiters map[int]chan syscall.WaitStatus
	kick    chan struct{}
	stop    chan struct{}
	once    sync.Once
}

// New starts a reaper. It listens for SIGCHLD and also polls once a second,
// so a coalesced or lost signal never leaves a zombie behind for long.
func New() *Reaper {
	r := &Reaper{
		waiters: map[int]chan syscall.WaitStatus{},
		kick:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
	}
	// Outside PID 1 (tests, a wrapper init) become the subreaper, so
	// orphaned grandchildren are re-parented to envd and reaped here too.
	_ = unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
	sig := make(chan os.Signal, 16)
	signal.Notify(sig, syscall.SIGCHLD)
	go func() {
		t := time.NewTicker(time.Second)
		defer t.Stop()
		defer signal.Stop(sig)
		for {
			select {
			case <-r.stop:
				return
			case <-sig:
			case <-r.kick:
			case <-t.C:
			}
			r.reap()
		}
	}()
	return r
}

// Close stops the reap loop.
func (r *Reaper) Close() {
	r.once.Do(func() { close(r.stop) })
}

func (r *Reaper) reap() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return
		}
		if ws.Stopped() || ws.Continued() {
			continue
		}
		if ch, ok := r.waiters[pid]; ok {
			delete(r.waiters, pid)
			ch <- ws // buffered, never blocks
		}
	}
}

// Start starts cmd (which must not use io.Writer/io.Reader std streams that
// need Cmd.Wait to copy, nor a Context) and returns its pid and a channel
// that receives its wait status exactly once. Never call cmd.Wait.
func (r *Reaper) Start(cmd *exec.Cmd) (int, <-chan syscall.WaitStatus, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := cmd.Start(); err != nil {
		return 0, nil, err
	}
	pid := cmd.Process.Pid
	ch := make(chan syscall.WaitStatus, 1)
	r.waiters[pid] = ch
	// The os.Process handle is not needed: waiting and signalling go
	// through the reaper. Releasing it closes any pidfd Go opened.
	_ = cmd.Process.Release()
	select {
	case r.kick <- struct{}{}:
	default:
	}
	return pid, ch, nil
}

// Signal sends sig to pid, or to its process group when group is true. The
// check and the kill happen under the reap lock, so the pid cannot have been
// reaped and reused in between.
func (r *Reaper) Signal(pid int, sig syscall.Signal, group bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.waiters[pid]; !ok {
		return ErrProcessGone
	}
	if group {
		if err := syscall.Kill(-pid, sig); err == nil {
			return nil
		}
	}
	return syscall.Kill(pid, sig)
}

// Running returns the number of registered children not yet reaped.
func (r *Reaper) Running() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.waiters)
}

// Pids returns the registered children not yet reaped.
func (r *Reaper) Pids() []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]int, 0, len(r.waiters))
	for pid := range r.waiters {
		out = append(out, pid)
	}
	return out
}
