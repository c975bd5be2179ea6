package reaper

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// zombiesOf lists zombie processes whose parent is ppid.
func zombiesOf(ppid int) []int { return childrenOf(ppid, "Z") }

// childrenOf lists processes whose parent is ppid, in state (any when "").
func childrenOf(ppid int, state string) []int {
	var out []int
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, f := range stats {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		fields := strings.Fields(s[i+1:])
		if len(fields) < 2 {
			continue
		}
		if p, _ := strconv.Atoi(fields[1]); p == ppid && (state == "" || fields[0] == state) {
			pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(f)))
			out = append(out, pid)
		}
	}
	return out
}

func TestStartWaitSignalAndOrphans(t *testing.T) {
	r := New()
	defer r.Close()

	pid, ch, err := r.Start(exec.Command("/bin/sh", "-c", "exit 7"))
	if err != nil {
		t.Fatal(err)
	}
	select {
	case ws := <-ch:
		if !ws.Exited() || ws.ExitStatus() != 7 {
			t.Fatalf("status %v", ws)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no exit status")
	}
	if err := r.Signal(pid, syscall.SIGTERM, false); err != ErrProcessGone {
		t.Fatalf("signal after exit: %v", err)
	}

	pid, ch, err = r.Start(exec.Command("sleep", "30"))
	if err != nil {
		t.Fatal(err)
	}
	if r.Running() < 1 {
		t.Fatal("not registered")
	}
	if err := r.Signal(pid, syscall.SIGKILL, false); err != nil {
		t.Fatal(err)
	}
	if ws := <-ch; !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("status %v", ws)
	}

	// The shell exits at once, orphaning its background children; as
	// subreaper we inherit and must reap them.
	// The orphans live 2 s, so a loaded host still sees them re-parented (with
	// 0.2 s they were sometimes gone, and reaped, before the check).
	_, ch, err = r.Start(exec.Command("/bin/sh", "-c", "sleep 2 & sleep 2 & exit 0"))
	if err != nil {
		t.Fatal(err)
	}
	<-ch
	if kids := childrenOf(os.Getpid(), ""); len(kids) < 2 {
		t.Fatalf("orphans were not re-parented to the subreaper: %v", kids)
	}
	deadline := time.Now().Add(10 * time.Second)
	for len(childrenOf(os.Getpid(), "")) > 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if kids := childrenOf(os.Getpid(), ""); len(kids) > 0 {
		t.Fatalf("orphans not reaped (zombies or still running): %v", kids)
	}
}
