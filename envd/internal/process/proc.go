package process

import (
	"errors"
	"fmt"
	"io"
	"log"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/creack/pty"

	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/reaper"
	rpc "forkyard/envd/internal/spec/process"
)

const (
	stdChunkSize = 32 << 10
	ptyChunkSize = 16 << 10
	// subscriberBuffer is how many events a slow stream may lag behind
	// before it back-pressures the process's output.
	subscriberBuffer = 64
	// drainGrace is how long output is still read after the process exited
	// when the pipe has no EOF yet (a background grandchild holds it open).
	drainGrace = 50 * time.Millisecond
)

// DefaultPath is the PATH given to commands when envd itself has none.
const DefaultPath = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

// subscriber is one stream (Start or Connect) receiving a process's events.
type subscriber struct {
	ch   chan *rpc.ProcessEvent
	done <-chan struct{}
}

// Proc is one process started by envd.
type Proc struct {
	pid    uint32
	tag    *string
	config *rpc.ProcessConfig
	reaper *reaper.Reaper

	tty *os.File // PTY master, nil for pipe processes

	stdinMu sync.Mutex
	stdin   *os.File // write end of stdin; nil when disabled or closed

	mu   sync.Mutex
	subs map[*subscriber]struct{}
	end  *rpc.ProcessEvent

	exitedFlag atomic.Bool
	ended      chan struct{}
}

// spawnSpec is everything needed to start a process.
type spawnSpec struct {
	config  *rpc.ProcessConfig
	tag     *string
	user    *identity.User
	dir     string
	env     []string
	ptySize *rpc.PTY_Size // nil: pipes
	stdin   bool
	first   *subscriber // subscribed before any output is read
	onStart func(*Proc) // called once the pid is known, before any event
	onEnd   func(*Proc) // called after the end event was delivered
}

// lookPath finds file in the PATH taken from env (not envd's own PATH).
func lookPath(file string, env []string, dir string) (string, error) {
	if file == "" {
		return "", errors.New("empty command")
	}
	if strings.Contains(file, "/") {
		p := file
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if err := executable(p); err != nil {
			return "", err
		}
		return p, nil
	}
	pathEnv := ""
	for _, kv := range env {
		if strings.HasPrefix(kv, "PATH=") {
			pathEnv = kv[len("PATH="):]
		}
	}
	for _, d := range filepath.SplitList(pathEnv) {
		if d == "" {
			d = "."
		}
		if !filepath.IsAbs(d) {
			d = filepath.Join(dir, d)
		}
		p := filepath.Join(d, file)
		if executable(p) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("executable file %q not found in $PATH", file)
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() {
		return fmt.Errorf("%s is a directory", p)
	}
	if st.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("%s: permission denied", p)
	}
	return nil
}

// errNotRoot: a user switch is needed but envd lacks the privilege.
var errNotRoot = errors.New("envd is not running as root and cannot switch user")

// credential returns the SysProcAttr credential for running as u, or nil
// when no switch is needed.
func credential(u *identity.User) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		if uint32(os.Getuid()) == u.UID {
			return nil, nil
		}
		return nil, fmt.Errorf("%w to %q", errNotRoot, u.Name)
	}
	groups := append([]uint32{u.GID}, u.Groups...)
	return &syscall.Credential{Uid: u.UID, Gid: u.GID, Groups: groups}, nil
}

// spawn starts the process described by s. The returned Proc is running and
// registered with the reaper; its events go to s.first and later
// subscribers.
func spawn(r *reaper.Reaper, s spawnSpec) (*Proc, error) {
	path, err := lookPath(s.config.GetCmd(), s.env, s.dir)
	if err != nil {
		return nil, &startError{err}
	}
	cred, err := credential(s.user)
	if err != nil {
		return nil, err
	}

	cmd := &exec.Cmd{
		Path:        path,
		Args:        append([]string{s.config.GetCmd()}, s.config.GetArgs()...),
		Env:         s.env,
		Dir:         s.dir,
		SysProcAttr: &syscall.SysProcAttr{Credential: cred},
	}

	p := &Proc{
		config: s.config,
		tag:    s.tag,
		reaper: r,
		subs:   map[*subscriber]struct{}{},
		ended:  make(chan struct{}),
	}
	if s.first != nil {
		p.subs[s.first] = struct{}{}
	}

	// childEnds are closed in the parent once the child has them.
	var childEnds []*os.File
	closeAll := func(fs ...*os.File) {
		for _, f := range fs {
			if f != nil {
				_ = f.Close()
			}
		}
	}
	type source struct {
		f     *os.File
		kind  int // 0 stdout, 1 stderr, 2 pty
		chunk int
	}
	var sources []source

	if s.ptySize != nil {
		master, slave, err := pty.Open()
		if err != nil {
			return nil, fmt.Errorf("opening pty: %w", err)
		}
		if err := pty.Setsize(master, &pty.Winsize{Rows: uint16(s.ptySize.GetRows()), Cols: uint16(s.ptySize.GetCols())}); err != nil {
			closeAll(master, slave)
			return nil, fmt.Errorf("sizing pty: %w", err)
		}
		cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
		cmd.SysProcAttr.Setsid = true
		cmd.SysProcAttr.Setctty = true
		cmd.SysProcAttr.Ctty = 0
		childEnds = append(childEnds, slave)
		p.tty = master
		sources = append(sources, source{master, 2, ptyChunkSize})
	} else {
		outR, outW, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		errR, errW, err := os.Pipe()
		if err != nil {
			closeAll(outR, outW)
			return nil, err
		}
		cmd.Stdout, cmd.Stderr = outW, errW
		childEnds = append(childEnds, outW, errW)
		sources = append(sources, source{outR, 0, stdChunkSize}, source{errR, 1, stdChunkSize})
		if s.stdin {
			inR, inW, err := os.Pipe()
			if err != nil {
				closeAll(outR, outW, errR, errW)
				return nil, err
			}
			cmd.Stdin = inR
			childEnds = append(childEnds, inR)
			p.stdin = inW
		}
		// Own process group, so a kill reaches the whole command
		// (e.g. `bash -c "a | b"`), not just the shell.
		cmd.SysProcAttr.Setpgid = true
	}

	pid, waitCh, err := r.Start(cmd)
	closeAll(childEnds...)
	if err != nil {
		for _, src := range sources {
			closeAll(src.f)
		}
		closeAll(p.stdin)
		return nil, &startError{err}
	}
	p.pid = uint32(pid)
	if s.onStart != nil {
		s.onStart(p)
	}

	var readers sync.WaitGroup
	for _, src := range sources {
		readers.Add(1)
		go func() {
			defer readers.Done()
			p.readOutput(src.f, src.kind, src.chunk)
		}()
	}

	go func() {
		ws := <-waitCh
		p.exitedFlag.Store(true)
		// Wake readers blocked on a pipe a background grandchild keeps
		// open; they keep draining while data still arrives.
		for _, src := range sources {
			_ = src.f.SetReadDeadline(time.Now().Add(drainGrace))
		}
		readers.Wait()
		for _, src := range sources {
			_ = src.f.Close()
		}
		p.stdinMu.Lock()
		closeAll(p.stdin)
		p.stdin = nil
		p.stdinMu.Unlock()
		end := endEvent(ws)
		p.finish(end)
		log.Printf("process %d ended: %s", p.pid, end.GetEnd().GetStatus())
		if s.onEnd != nil {
			s.onEnd(p)
		}
	}()
	log.Printf("process %d started: %s", p.pid, commandLine(p.config))
	return p, nil
}

// startError marks failures to exec the command (bad path, not executable).
type startError struct{ err error }

// Error implements error.
func (e *startError) Error() string { return "error starting process: " + e.err.Error() }

// Unwrap returns the underlying error.
func (e *startError) Unwrap() error { return e.err }

// endEvent renders a wait status the way Go's os.ProcessState does, which
// is what E2B's envd reports.
func endEvent(ws syscall.WaitStatus) *rpc.ProcessEvent {
	var (
		code   int32
		status string
	)
	switch {
	case ws.Exited():
		code = int32(ws.ExitStatus())
		status = fmt.Sprintf("exit status %d", ws.ExitStatus())
	case ws.Signaled():
		code = -1
		status = "signal: " + ws.Signal().String()
		if ws.CoreDump() {
			status += " (core dumped)"
		}
	default:
		code = -1
		status = fmt.Sprintf("unknown status %#x", uint32(ws))
	}
	end := &rpc.ProcessEvent_EndEvent{ExitCode: code, Exited: ws.Exited(), Status: status}
	if !(ws.Exited() && ws.ExitStatus() == 0) {
		msg := status
		end.Error = &msg
	}
	return &rpc.ProcessEvent{Event: &rpc.ProcessEvent_End{End: end}}
}

func (p *Proc) readOutput(f *os.File, kind, chunk int) {
	for {
		if p.exitedFlag.Load() {
			_ = f.SetReadDeadline(time.Now().Add(drainGrace))
		}
		buf := make([]byte, chunk)
		n, err := f.Read(buf)
		if n > 0 {
			data := &rpc.ProcessEvent_DataEvent{}
			switch kind {
			case 0:
				data.Output = &rpc.ProcessEvent_DataEvent_Stdout{Stdout: buf[:n]}
			case 1:
				data.Output = &rpc.ProcessEvent_DataEvent_Stderr{Stderr: buf[:n]}
			default:
				data.Output = &rpc.ProcessEvent_DataEvent_Pty{Pty: buf[:n]}
			}
			p.broadcast(&rpc.ProcessEvent{Event: &rpc.ProcessEvent_Data{Data: data}})
		}
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) && !p.exitedFlag.Load() {
				continue
			}
			if !errors.Is(err, io.EOF) && !errors.Is(err, os.ErrDeadlineExceeded) &&
				!errors.Is(err, syscall.EIO) && !errors.Is(err, os.ErrClosed) {
				fmt.Fprintf(os.Stderr, "envd: reading output of pid %d: %v\n", p.pid, err)
			}
			return
		}
	}
}

func (p *Proc) snapshotSubs() []*subscriber {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		out = append(out, s)
	}
	return out
}

// broadcast delivers ev to every subscriber, waiting for slow ones (so
// output is not lost) unless their stream has gone away.
func (p *Proc) broadcast(ev *rpc.ProcessEvent) {
	for _, s := range p.snapshotSubs() {
		select {
		case s.ch <- ev:
		case <-s.done:
		}
	}
}

func (p *Proc) finish(end *rpc.ProcessEvent) {
	p.mu.Lock()
	p.end = end
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- end:
		case <-s.done:
		}
	}
	close(p.ended)
}

func newSubscriber(done <-chan struct{}) *subscriber {
	return &subscriber{ch: make(chan *rpc.ProcessEvent, subscriberBuffer), done: done}
}

// subscribe adds s. If the process already ended, the end event is returned
// and s is not added.
func (p *Proc) subscribe(s *subscriber) *rpc.ProcessEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.end != nil {
		return p.end
	}
	p.subs[s] = struct{}{}
	return nil
}

func (p *Proc) unsubscribe(s *subscriber) {
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
}

// Signal sends sig to the process group (pipes) or the PTY session leader's
// group.
func (p *Proc) Signal(sig syscall.Signal) error {
	return p.reaper.Signal(int(p.pid), sig, true)
}

// errNoStdin: the process was started without stdin or it was closed.
var errNoStdin = errors.New("stdin not enabled or closed")

// WriteInput writes to the PTY (PTY processes) or stdin.
func (p *Proc) WriteInput(data []byte, deadline time.Time) error {
	if p.tty != nil {
		if _, err := p.tty.Write(data); err != nil {
			return fmt.Errorf("writing to pty of process %d: %w", p.pid, err)
		}
		return nil
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return errNoStdin
	}
	_ = p.stdin.SetWriteDeadline(deadline)
	if _, err := p.stdin.Write(data); err != nil {
		return fmt.Errorf("writing to stdin of process %d: %w", p.pid, err)
	}
	return nil
}

// errIsPTY: the operation does not apply to a PTY process.
var errIsPTY = errors.New("process has a pty; send Ctrl+D (0x04) instead of closing stdin")

// CloseStdin closes stdin so the process reads EOF.
func (p *Proc) CloseStdin() error {
	if p.tty != nil {
		return errIsPTY
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	if p.stdin == nil {
		return nil
	}
	err := p.stdin.Close()
	p.stdin = nil
	return err
}

// errNoPTY: resize of a process without a PTY.
var errNoPTY = errors.New("process has no pty")

// Resize changes the PTY window size.
func (p *Proc) Resize(size *rpc.PTY_Size) error {
	if p.tty == nil {
		return errNoPTY
	}
	return pty.Setsize(p.tty, &pty.Winsize{Rows: uint16(size.GetRows()), Cols: uint16(size.GetCols())})
}

// Info returns the process's List entry.
func (p *Proc) Info() *rpc.ProcessInfo {
	return &rpc.ProcessInfo{Config: p.config, Pid: p.pid, Tag: p.tag}
}

// commandLine is cmd and args for the log, cut at 200 bytes.
func commandLine(c *rpc.ProcessConfig) string {
	line := strings.Join(append([]string{c.GetCmd()}, c.GetArgs()...), " ")
	if len(line) > 200 {
		line = line[:200] + "…"
	}
	return line
}
