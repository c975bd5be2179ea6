package server

import (
	"bytes"
	"context"
	"encoding/base64"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	rpc "forkyard/envd/internal/spec/process"
)

type result struct {
	pid    uint32
	stdout bytes.Buffer
	stderr bytes.Buffer
	pty    bytes.Buffer
	end    *rpc.ProcessEvent_EndEvent
	err    error
}

func collect(stream interface {
	Receive() bool
	Err() error
}, event func() *rpc.ProcessEvent) *result {
	r := &result{}
	for stream.Receive() {
		switch ev := event().GetEvent().(type) {
		case *rpc.ProcessEvent_Start:
			r.pid = ev.Start.GetPid()
		case *rpc.ProcessEvent_Data:
			r.stdout.Write(ev.Data.GetStdout())
			r.stderr.Write(ev.Data.GetStderr())
			r.pty.Write(ev.Data.GetPty())
		case *rpc.ProcessEvent_End:
			r.end = ev.End
		}
	}
	r.err = stream.Err()
	return r
}

func (e *env) run(ctx context.Context, req *rpc.StartRequest, user string) *result {
	e.t.Helper()
	creq := connect.NewRequest(req)
	if user != "" {
		creq.Header().Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(user+":")))
	}
	stream, err := e.proc.Start(ctx, creq)
	if err != nil {
		return &result{err: err}
	}
	defer stream.Close()
	return collect(stream, func() *rpc.ProcessEvent { return stream.Msg().GetEvent() })
}

func sh(script string) *rpc.StartRequest {
	return &rpc.StartRequest{Process: &rpc.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}
}

func TestStartOutputAndExitCode(t *testing.T) {
	for _, h2c := range []bool{false, true} {
		e := newEnv(t, h2c)
		r := e.run(context.Background(), sh("echo out; echo err >&2; exit 3"), "")
		if r.err != nil {
			t.Fatalf("h2c=%v: %v", h2c, r.err)
		}
		if r.pid == 0 || r.stdout.String() != "out\n" || r.stderr.String() != "err\n" {
			t.Fatalf("h2c=%v: pid %d stdout %q stderr %q", h2c, r.pid, r.stdout.String(), r.stderr.String())
		}
		if r.end == nil || r.end.GetExitCode() != 3 || !r.end.GetExited() || r.end.GetStatus() != "exit status 3" || r.end.GetError() != "exit status 3" {
			t.Fatalf("h2c=%v: end %+v", h2c, r.end)
		}
	}
}

func TestStartEnvAndCwd(t *testing.T) {
	e := newEnv(t, false)
	e.srv.State.SetEnv(map[string]string{"GLOBAL": "g", "OVER": "global"})
	req := sh(`printf '%s|%s|%s|%s|%s|' "$HOME" "$USER" "$GLOBAL" "$OVER" "$REQ"; pwd`)
	req.Process.Envs = map[string]string{"REQ": "r", "OVER": "request"}
	r := e.run(context.Background(), req, "")
	want := e.home + "|tester|g|request|r|" + e.home + "\n"
	if r.err != nil || r.stdout.String() != want || r.end.GetExitCode() != 0 || r.end.Error != nil {
		t.Fatalf("got %q err %v end %+v, want %q", r.stdout.String(), r.err, r.end, want)
	}

	cwd := "/"
	req = sh("pwd")
	req.Process.Cwd = &cwd
	if r := e.run(context.Background(), req, "tester"); r.stdout.String() != "/\n" {
		t.Fatalf("cwd: %q %v", r.stdout.String(), r.err)
	}

	bad := "/does/not/exist"
	req.Process.Cwd = &bad
	if r := e.run(context.Background(), req, ""); codeOf(r.err) != connect.CodeInvalidArgument {
		t.Fatalf("bad cwd: %v", r.err)
	}
	if r := e.run(context.Background(), sh("true"), "nobody-here"); codeOf(r.err) != connect.CodeUnauthenticated {
		t.Fatalf("unknown user: %v", r.err)
	}
	missing := &rpc.StartRequest{Process: &rpc.ProcessConfig{Cmd: "no-such-binary-xyz"}}
	if r := e.run(context.Background(), missing, ""); codeOf(r.err) != connect.CodeInvalidArgument {
		t.Fatalf("missing binary: %v", r.err)
	}
}

func TestStdinSendAndClose(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	stdin := true
	req := &rpc.StartRequest{Process: &rpc.ProcessConfig{Cmd: "cat"}, Stdin: &stdin}
	stream, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		t.Fatal(stream.Err())
	}
	pid := stream.Msg().GetEvent().GetStart().GetPid()
	sel := &rpc.ProcessSelector{Selector: &rpc.ProcessSelector_Pid{Pid: pid}}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&rpc.SendInputRequest{
		Process: sel, Input: &rpc.ProcessInput{Input: &rpc.ProcessInput_Stdin{Stdin: []byte("one ")}},
	})); err != nil {
		t.Fatal(err)
	}
	cs := e.proc.StreamInput(ctx)
	_ = cs.Send(&rpc.StreamInputRequest{Event: &rpc.StreamInputRequest_Start{Start: &rpc.StreamInputRequest_StartEvent{Process: sel}}})
	_ = cs.Send(&rpc.StreamInputRequest{Event: &rpc.StreamInputRequest_Data{Data: &rpc.StreamInputRequest_DataEvent{Input: &rpc.ProcessInput{Input: &rpc.ProcessInput_Stdin{Stdin: []byte("two")}}}}})
	if _, err := cs.CloseAndReceive(); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.CloseStdin(ctx, connect.NewRequest(&rpc.CloseStdinRequest{Process: sel})); err != nil {
		t.Fatal(err)
	}
	r := collect(stream, func() *rpc.ProcessEvent { return stream.Msg().GetEvent() })
	if r.stdout.String() != "one two" || r.end.GetExitCode() != 0 {
		t.Fatalf("stdout %q end %+v err %v", r.stdout.String(), r.end, r.err)
	}
}

func TestKillListAndNotFound(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	tag := "sleeper"
	req := sh("sleep 30")
	req.Tag = &tag
	stream, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		t.Fatal(stream.Err())
	}
	pid := stream.Msg().GetEvent().GetStart().GetPid()

	list, err := e.proc.List(ctx, connect.NewRequest(&rpc.ListRequest{}))
	if err != nil || len(list.Msg.GetProcesses()) != 1 || list.Msg.GetProcesses()[0].GetPid() != pid ||
		list.Msg.GetProcesses()[0].GetTag() != "sleeper" || list.Msg.GetProcesses()[0].GetConfig().GetCmd() != "/bin/sh" {
		t.Fatalf("list: %v %v", list, err)
	}

	// Connect by tag while it runs.
	conn, err := e.proc.Connect(ctx, connect.NewRequest(&rpc.ConnectRequest{Process: &rpc.ProcessSelector{Selector: &rpc.ProcessSelector_Tag{Tag: "sleeper"}}}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	if _, err := e.proc.SendSignal(ctx, connect.NewRequest(&rpc.SendSignalRequest{
		Process: &rpc.ProcessSelector{Selector: &rpc.ProcessSelector_Pid{Pid: pid}}, Signal: rpc.Signal_SIGNAL_SIGKILL,
	})); err != nil {
		t.Fatal(err)
	}
	r := collect(stream, func() *rpc.ProcessEvent { return stream.Msg().GetEvent() })
	if r.end.GetExitCode() != -1 || r.end.GetExited() || r.end.GetStatus() != "signal: killed" {
		t.Fatalf("end %+v err %v", r.end, r.err)
	}
	cr := collect(conn, func() *rpc.ProcessEvent { return conn.Msg().GetEvent() })
	if cr.pid != pid || cr.end.GetStatus() != "signal: killed" {
		t.Fatalf("connect saw pid %d end %+v err %v", cr.pid, cr.end, cr.err)
	}

	sel := &rpc.ProcessSelector{Selector: &rpc.ProcessSelector_Pid{Pid: pid}}
	deadline := time.Now().Add(2 * time.Second)
	for {
		_, err = e.proc.SendSignal(ctx, connect.NewRequest(&rpc.SendSignalRequest{Process: sel, Signal: rpc.Signal_SIGNAL_SIGKILL}))
		if codeOf(err) == connect.CodeNotFound || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("signal to ended process: %v", err)
	}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&rpc.SendInputRequest{Process: sel, Input: &rpc.ProcessInput{}})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("input to ended process: %v", err)
	}
	c2, err := e.proc.Connect(ctx, connect.NewRequest(&rpc.ConnectRequest{Process: sel}))
	if err == nil {
		c2.Receive()
		err = c2.Err()
		c2.Close()
	}
	if codeOf(err) != connect.CodeNotFound {
		t.Fatalf("connect to ended process: %v", err)
	}
}

func TestPTY(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	req := &rpc.StartRequest{
		Process: &rpc.ProcessConfig{Cmd: "/bin/sh", Envs: map[string]string{"TERM": "xterm"}},
		Pty:     &rpc.PTY{Size: &rpc.PTY_Size{Cols: 80, Rows: 24}},
	}
	stream, err := e.proc.Start(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() {
		t.Fatal(stream.Err())
	}
	sel := &rpc.ProcessSelector{Selector: &rpc.ProcessSelector_Pid{Pid: stream.Msg().GetEvent().GetStart().GetPid()}}
	if _, err := e.proc.Update(ctx, connect.NewRequest(&rpc.UpdateRequest{Process: sel, Pty: &rpc.PTY{Size: &rpc.PTY_Size{Cols: 100, Rows: 30}}})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.proc.SendInput(ctx, connect.NewRequest(&rpc.SendInputRequest{
		Process: sel, Input: &rpc.ProcessInput{Input: &rpc.ProcessInput_Pty{Pty: []byte("stty size; tty; exit 5\n")}},
	})); err != nil {
		t.Fatal(err)
	}
	r := collect(stream, func() *rpc.ProcessEvent { return stream.Msg().GetEvent() })
	out := r.pty.String()
	if !strings.Contains(out, "30 100") || !strings.Contains(out, "/dev/pts/") || r.end.GetExitCode() != 5 {
		t.Fatalf("pty output %q end %+v err %v", out, r.end, r.err)
	}
}

func TestCommandTimeoutKills(t *testing.T) {
	e := newEnv(t, false)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	r := e.run(ctx, sh("sleep 30"), "")
	if codeOf(r.err) != connect.CodeDeadlineExceeded || time.Since(start) > 5*time.Second {
		t.Fatalf("err %v after %v", r.err, time.Since(start))
	}
	deadline := time.Now().Add(3 * time.Second)
	for e.srv.Processes.Running() > 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := e.srv.Processes.Running(); n != 0 {
		t.Fatalf("%d processes still running after the timeout", n)
	}
}

func TestBackgroundGrandchildDoesNotHoldStream(t *testing.T) {
	e := newEnv(t, false)
	start := time.Now()
	r := e.run(context.Background(), sh("echo before; sleep 3 & echo after"), "")
	if r.err != nil || r.stdout.String() != "before\nafter\n" || time.Since(start) > 2*time.Second {
		t.Fatalf("stdout %q err %v took %v", r.stdout.String(), r.err, time.Since(start))
	}
}

func TestLargeOutputComplete(t *testing.T) {
	e := newEnv(t, false)
	r := e.run(context.Background(), sh("head -c 3000000 /dev/zero | tr '\\0' x; echo"), "")
	if r.err != nil || r.stdout.Len() != 3000001 {
		t.Fatalf("got %d bytes, err %v", r.stdout.Len(), r.err)
	}
}

// TestStreamingIsFlushed checks events reach the client as they happen over
// HTTP/1.1 (chunked) and h2c, not when the command ends.
func TestStreamingIsFlushed(t *testing.T) {
	for _, h2c := range []bool{false, true} {
		e := newEnv(t, h2c)
		stream, err := e.proc.Start(context.Background(), connect.NewRequest(sh("echo first; sleep 2; echo second")))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		got := ""
		for got == "" && stream.Receive() {
			got = string(stream.Msg().GetEvent().GetData().GetStdout())
		}
		if got != "first\n" || time.Since(start) > time.Second {
			t.Fatalf("h2c=%v: first output %q after %v", h2c, got, time.Since(start))
		}
		for stream.Receive() {
		}
		stream.Close()
	}
}

func TestKeepalive(t *testing.T) {
	e := newEnv(t, false)
	req := connect.NewRequest(sh("sleep 1.5"))
	req.Header().Set("Keepalive-Ping-Interval", "1")
	stream, err := e.proc.Start(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	keepalives := 0
	for stream.Receive() {
		if stream.Msg().GetEvent().GetKeepalive() != nil {
			keepalives++
		}
	}
	if keepalives == 0 {
		t.Fatal("no keepalive event")
	}
}

func TestPermissionDeniedAndBadRequests(t *testing.T) {
	e := newEnv(t, false)
	if os.Geteuid() == 0 {
		// The test home sits below a 0700 temp dir: nobody cannot enter it.
		cwd := e.home
		req := sh("pwd")
		req.Process.Cwd = &cwd
		if r := e.run(context.Background(), req, "nobody"); codeOf(r.err) != connect.CodePermissionDenied {
			t.Fatalf("nobody in a 0700 dir: %v", r.err)
		}
		if r := e.run(context.Background(), sh("id -u"), "nobody"); r.stdout.String() != "65534\n" {
			t.Fatalf("run as nobody: %q %v", r.stdout.String(), r.err)
		}
	}
	// Garbage bodies are rejected, and envd keeps serving.
	for _, body := range []string{"{not json", "[1,2]", ""} {
		resp, err := http.Post(e.ts.URL+"/process.Process/List", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK && body != "" {
			t.Fatalf("body %q accepted", body)
		}
	}
	if _, err := e.proc.SendSignal(context.Background(), connect.NewRequest(&rpc.SendSignalRequest{})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("empty selector: %v", err)
	}
	if _, err := e.proc.List(context.Background(), connect.NewRequest(&rpc.ListRequest{})); err != nil {
		t.Fatalf("envd not serving after bad requests: %v", err)
	}
}

// Defaults a request may leave out: stdin stays open unless Stdin is false (E2B's
// behaviour), and a PTY without a size is 80x24.
func TestStdinOpenByDefaultAndPTYDefaultSize(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	r := e.run(ctx, sh("timeout 1 cat; echo $?"), "")
	if r.stdout.String() != "124\n" { // cat waited on the open stdin until timeout killed it
		t.Fatalf("stdin unset: stdout %q err %v", r.stdout.String(), r.err)
	}
	closed := false
	req := sh("timeout 1 cat; echo $?")
	req.Stdin = &closed
	if r := e.run(ctx, req, ""); r.stdout.String() != "0\n" { // EOF at once
		t.Fatalf("stdin false: stdout %q err %v", r.stdout.String(), r.err)
	}
	req = sh("stty size")
	req.Pty = &rpc.PTY{}
	if r := e.run(ctx, req, ""); !strings.Contains(r.pty.String(), "24 80") {
		t.Fatalf("pty without size: %q err %v", r.pty.String(), r.err)
	}
}
