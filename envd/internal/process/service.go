// Package process implements the process.Process Connect service: starting
// commands (pipes or PTY), streaming their output, stdin, signals and
// listing.
package process

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"sort"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"

	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/reaper"
	"forkyard/envd/internal/rpcutil"
	rpc "forkyard/envd/internal/spec/process"
	"forkyard/envd/internal/spec/process/processconnect"
	"forkyard/envd/internal/state"
)

// Service implements processconnect.ProcessHandler.
type Service struct {
	st     *state.State
	reaper *reaper.Reaper

	mu    sync.RWMutex
	procs map[uint32]*Proc

	// OnStart, when set (before serving), is called after each process starts
	// (envd's port forwarder scans at once: a server may be coming up).
	OnStart func()
}

var _ processconnect.ProcessHandler = (*Service)(nil)

// New returns a Service that starts processes through r.
func New(st *state.State, r *reaper.Reaper) *Service {
	return &Service{st: st, reaper: r, procs: map[uint32]*Proc{}}
}

// Handler returns the HTTP path prefix and handler for the service.
func (s *Service) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	return processconnect.NewProcessHandler(s, opts...)
}

func (s *Service) buildEnv(u *identity.User, req map[string]string) []string {
	path := os.Getenv("PATH")
	if path == "" {
		path = DefaultPath
	}
	vals := map[string]string{}
	var order []string
	set := func(k, v string) {
		if _, ok := vals[k]; !ok {
			order = append(order, k)
		}
		vals[k] = v
	}
	set("PATH", path)
	set("HOME", u.Home)
	set("USER", u.Name)
	set("LOGNAME", u.Name)
	global := s.st.Env()
	keys := make([]string, 0, len(global))
	for k := range global {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		set(k, global[k])
	}
	rk := make([]string, 0, len(req))
	for k := range req {
		rk = append(rk, k)
	}
	sort.Strings(rk)
	for _, k := range rk {
		set(k, req[k])
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+vals[k])
	}
	return out
}

func (s *Service) resolveCwd(cfg *rpc.ProcessConfig, u *identity.User) (string, error) {
	explicit := cfg.Cwd != nil && cfg.GetCwd() != ""
	dir, err := s.st.ResolvePath(cfg.GetCwd(), u)
	if err != nil {
		return "", connect.NewError(connect.CodeInvalidArgument, err)
	}
	st, err := os.Stat(dir)
	if err == nil && st.IsDir() {
		return dir, nil
	}
	if !explicit && s.st.DefaultWorkdir() == "" {
		// The user's home is missing: start in / rather than fail.
		return "/", nil
	}
	if err == nil {
		return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd '%s' is not a directory", dir))
	}
	return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cwd '%s' does not exist", dir))
}

func (s *Service) register(p *Proc) {
	s.mu.Lock()
	s.procs[p.pid] = p
	s.mu.Unlock()
	if s.OnStart != nil {
		s.OnStart()
	}
}

func (s *Service) unregister(p *Proc) {
	s.mu.Lock()
	if s.procs[p.pid] == p {
		delete(s.procs, p.pid)
	}
	s.mu.Unlock()
}

func (s *Service) find(sel *rpc.ProcessSelector) (*Proc, error) {
	if sel == nil || sel.GetSelector() == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("process selector (pid or tag) is required"))
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	// A process that has exited is gone for every call, also while its last output
	// is still being drained (it stays registered until then): signal, input,
	// connect and close-stdin all answer NotFound from its exit on, as E2B's envd.
	switch v := sel.GetSelector().(type) {
	case *rpc.ProcessSelector_Pid:
		if p, ok := s.procs[v.Pid]; ok && !p.exitedFlag.Load() {
			return p, nil
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", v.Pid))
	case *rpc.ProcessSelector_Tag:
		for _, p := range s.procs {
			if p.tag != nil && *p.tag == v.Tag && !p.exitedFlag.Load() {
				return p, nil
			}
		}
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with tag %s not found", v.Tag))
	}
	return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("invalid process selector"))
}

// List returns the running processes.
func (s *Service) List(_ context.Context, _ *connect.Request[rpc.ListRequest]) (*connect.Response[rpc.ListResponse], error) {
	s.mu.RLock()
	out := make([]*rpc.ProcessInfo, 0, len(s.procs))
	for _, p := range s.procs {
		out = append(out, p.Info())
	}
	s.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Pid < out[j].Pid })
	return connect.NewResponse(&rpc.ListResponse{Processes: out}), nil
}

type eventSender func(*rpc.ProcessEvent) error

// pump sends events from sub until the end event, the client going away or
// a send error.
func pump(ctx context.Context, sub *subscriber, keepalive time.Duration, send eventSender) error {
	ka := rpcutil.NewKeepalive(keepalive)
	defer ka.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ka.C:
			if err := send(&rpc.ProcessEvent{Event: &rpc.ProcessEvent_Keepalive{Keepalive: &rpc.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case ev := <-sub.ch:
			if err := send(ev); err != nil {
				return err
			}
			if _, ok := ev.GetEvent().(*rpc.ProcessEvent_End); ok {
				return nil
			}
			ka.Reset()
		}
	}
}

func startEvent(pid uint32) *rpc.ProcessEvent {
	return &rpc.ProcessEvent{Event: &rpc.ProcessEvent_Start{Start: &rpc.ProcessEvent_StartEvent{Pid: pid}}}
}

// Start starts a process and streams its events until it ends.
func (s *Service) Start(ctx context.Context, req *connect.Request[rpc.StartRequest], stream *connect.ServerStream[rpc.StartResponse]) error {
	msg := req.Msg
	cfg := msg.GetProcess()
	if cfg == nil || cfg.GetCmd() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("process.cmd is required"))
	}
	u, err := rpcutil.AuthUser(s.st, req.Header())
	if err != nil {
		return err
	}
	dir, err := s.resolveCwd(cfg, u)
	if err != nil {
		return err
	}

	sub := newSubscriber(ctx.Done())
	spec := spawnSpec{
		config: cfg,
		tag:    msg.Tag,
		user:   u,
		dir:    dir,
		env:    s.buildEnv(u, cfg.GetEnvs()),
		// Like E2B: stdin stays open unless explicitly disabled.
		stdin:   msg.Stdin == nil || msg.GetStdin(),
		first:   sub,
		onStart: s.register,
		onEnd:   s.unregister,
	}
	if msg.GetPty() != nil {
		size := msg.GetPty().GetSize()
		if size == nil {
			size = &rpc.PTY_Size{Cols: 80, Rows: 24}
		}
		spec.ptySize = size
	}
	p, err := spawn(s.reaper, spec)
	if err != nil {
		var se *startError
		switch {
		case errors.Is(err, os.ErrPermission):
			return connect.NewError(connect.CodePermissionDenied, err)
		case errors.As(err, &se):
			return connect.NewError(connect.CodeInvalidArgument, err)
		case errors.Is(err, errNotRoot):
			return connect.NewError(connect.CodePermissionDenied, err)
		default:
			return connect.NewError(connect.CodeInternal, err)
		}
	}
	defer p.unsubscribe(sub)

	// The command's lifetime is bounded by the request's Connect timeout
	// (the SDK's `timeout`), not by the client staying connected.
	if dl, ok := ctx.Deadline(); ok {
		t := time.AfterFunc(time.Until(dl), func() { _ = p.Signal(syscall.SIGKILL) })
		go func() {
			<-p.ended
			t.Stop()
		}()
	}

	send := func(ev *rpc.ProcessEvent) error { return stream.Send(&rpc.StartResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	return pump(ctx, sub, rpcutil.KeepaliveInterval(req.Header()), send)
}

// Connect streams the events of a running process.
func (s *Service) Connect(ctx context.Context, req *connect.Request[rpc.ConnectRequest], stream *connect.ServerStream[rpc.ConnectResponse]) error {
	p, err := s.find(req.Msg.GetProcess())
	if err != nil {
		return err
	}
	sub := newSubscriber(ctx.Done())
	end := p.subscribe(sub)
	defer p.unsubscribe(sub)
	send := func(ev *rpc.ProcessEvent) error { return stream.Send(&rpc.ConnectResponse{Event: ev}) }
	if err := send(startEvent(p.pid)); err != nil {
		return err
	}
	if end != nil {
		return send(end)
	}
	return pump(ctx, sub, rpcutil.KeepaliveInterval(req.Header()), send)
}

// Update resizes a process's PTY.
func (s *Service) Update(_ context.Context, req *connect.Request[rpc.UpdateRequest]) (*connect.Response[rpc.UpdateResponse], error) {
	p, err := s.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if size := req.Msg.GetPty().GetSize(); size != nil {
		if err := p.Resize(size); err != nil {
			if errors.Is(err, errNoPTY) {
				return nil, connect.NewError(connect.CodeFailedPrecondition, err)
			}
			return nil, connect.NewError(connect.CodeInternal, err)
		}
	}
	return connect.NewResponse(&rpc.UpdateResponse{}), nil
}

func inputBytes(in *rpc.ProcessInput) []byte {
	switch v := in.GetInput().(type) {
	case *rpc.ProcessInput_Stdin:
		return v.Stdin
	case *rpc.ProcessInput_Pty:
		return v.Pty
	}
	return nil
}

func inputError(err error) error {
	if errors.Is(err, errNoStdin) {
		return connect.NewError(connect.CodeFailedPrecondition, err)
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

func writeDeadline(ctx context.Context) time.Time {
	if dl, ok := ctx.Deadline(); ok {
		return dl
	}
	return time.Now().Add(time.Minute)
}

// SendInput writes one chunk to a process's stdin or PTY.
func (s *Service) SendInput(ctx context.Context, req *connect.Request[rpc.SendInputRequest]) (*connect.Response[rpc.SendInputResponse], error) {
	p, err := s.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if data := inputBytes(req.Msg.GetInput()); len(data) > 0 {
		if err := p.WriteInput(data, writeDeadline(ctx)); err != nil {
			return nil, inputError(err)
		}
	}
	return connect.NewResponse(&rpc.SendInputResponse{}), nil
}

// StreamInput writes a client stream of chunks to a process: a start event
// selecting the process, then data and keepalive events.
func (s *Service) StreamInput(ctx context.Context, stream *connect.ClientStream[rpc.StreamInputRequest]) (*connect.Response[rpc.StreamInputResponse], error) {
	var p *Proc
	for stream.Receive() {
		msg := stream.Msg()
		switch ev := msg.GetEvent().(type) {
		case *rpc.StreamInputRequest_Start:
			found, err := s.find(ev.Start.GetProcess())
			if err != nil {
				return nil, err
			}
			p = found
		case *rpc.StreamInputRequest_Data:
			if p == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("first event must be start"))
			}
			if data := inputBytes(ev.Data.GetInput()); len(data) > 0 {
				if err := p.WriteInput(data, writeDeadline(ctx)); err != nil {
					return nil, inputError(err)
				}
			}
		case *rpc.StreamInputRequest_Keepalive:
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&rpc.StreamInputResponse{}), nil
}

// SendSignal sends SIGTERM or SIGKILL to a process (its whole group).
func (s *Service) SendSignal(_ context.Context, req *connect.Request[rpc.SendSignalRequest]) (*connect.Response[rpc.SendSignalResponse], error) {
	p, err := s.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	var sig syscall.Signal
	switch req.Msg.GetSignal() {
	case rpc.Signal_SIGNAL_SIGKILL:
		sig = syscall.SIGKILL
	case rpc.Signal_SIGNAL_SIGTERM:
		sig = syscall.SIGTERM
	default:
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("unsupported signal %v", req.Msg.GetSignal()))
	}
	if err := p.Signal(sig); err != nil {
		if errors.Is(err, reaper.ErrProcessGone) || errors.Is(err, syscall.ESRCH) {
			return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process with pid %d not found", p.pid))
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&rpc.SendSignalResponse{}), nil
}

// CloseStdin closes a process's stdin.
func (s *Service) CloseStdin(_ context.Context, req *connect.Request[rpc.CloseStdinRequest]) (*connect.Response[rpc.CloseStdinResponse], error) {
	p, err := s.find(req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.CloseStdin(); err != nil {
		if errors.Is(err, errIsPTY) {
			return nil, connect.NewError(connect.CodeFailedPrecondition, err)
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return connect.NewResponse(&rpc.CloseStdinResponse{}), nil
}

// Shutdown signals every running process with sig.
func (s *Service) Shutdown(sig syscall.Signal) {
	s.mu.RLock()
	procs := make([]*Proc, 0, len(s.procs))
	for _, p := range s.procs {
		procs = append(procs, p)
	}
	s.mu.RUnlock()
	for _, p := range procs {
		_ = p.Signal(sig)
	}
}

// Running returns the number of processes not yet ended.
func (s *Service) Running() int {
	s.mu.RLock()
	defer s.mu.RUnlock()
	return len(s.procs)
}
