// Package sudo gives unprivileged users of any image a working sudo under
// gVisor, which ignores set-user-ID bits (see forkyard/guest/sudo.py).
//
// envd is a multi-call binary for it: run as "sudo" (the image's
// /usr/bin/sudo is a link to /usr/local/bin/envd) it is the client, run as
// "sudo-broker" (/usr/local/lib/forkyard/sudo-broker, started as root next
// to envd at boot) it is the root broker. Both speak the protocol of the
// Python shim and broker the base template ships: the client sends a 4-byte
// big-endian length with its stdin/stdout/stderr (SCM_RIGHTS) and its
// credentials (SCM_CREDENTIALS: gVisor's SO_PEERCRED reports the listener's
// own), then a JSON body {"name", "argv", "cwd", "env"}; single bytes after
// it are signals to forward; the broker answers with the 4-byte exit status.
//
// Only root and members of group "sudo" may use it (the socket is 0660 root:sudo
// and the broker checks the caller's uid again). When the image has the real
// sudo (moved to /usr/bin/sudo.distrib), the broker runs it as root, so sudoers
// applies; otherwise it runs the command itself (Run: -u, -E, -H, -i, -s, -n,
// VAR=value, --; the rest is refused with a message).
package sudo

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"forkyard/envd/internal/identity"
)

const (
	// Socket is where the broker listens.
	Socket = "/run/forkyard/sudo.sock"
	// BrokerPath is the broker's name in the image (a link to envd).
	BrokerPath = "/usr/local/lib/forkyard/sudo-broker"
	// Real is where the image's own sudo is moved to.
	Real = "/usr/bin/sudo.distrib"
	// Group is the group whose members may use sudo.
	Group = "sudo"
	// maxBody bounds a request's JSON (argv + environment).
	maxBody = 4 << 20
)

type request struct {
	Name string            `json:"name"`
	Argv []string          `json:"argv"`
	Cwd  string            `json:"cwd"`
	Env  map[string]string `json:"env"`
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func envMap(environ []string) map[string]string {
	m := make(map[string]string, len(environ))
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			m[k] = v
		}
	}
	return m
}

func envList(m map[string]string) []string {
	out := make([]string, 0, len(m))
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	return out
}

// Client is envd run as "sudo" or "sudoedit" (name): it returns the exit
// status to exit with.
func Client(name string, args []string) int {
	if os.Geteuid() != 0 && !exists(Socket) && exists(BrokerPath) {
		// The broker starts with the sandbox: a sudo in its first moments waits
		// for the socket (at most 5 s).
		for deadline := time.Now().Add(5 * time.Second); !exists(Socket) && time.Now().Before(deadline); {
			time.Sleep(20 * time.Millisecond)
		}
	}
	cwd, err := os.Getwd()
	if err != nil {
		cwd = "/"
	}
	req := request{Name: name, Argv: args, Cwd: cwd, Env: envMap(os.Environ())}
	if os.Geteuid() == 0 {
		if exists(Real) {
			err := syscall.Exec(Real, append([]string{name}, args...), os.Environ())
			fmt.Fprintf(os.Stderr, "sudo: %v\n", err)
			return 1
		}
		stdio := [3]*os.File{os.Stdin, os.Stdout, os.Stderr}
		sigs := make(chan os.Signal, 4)
		signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
		return execute(req, 0, stdio, sigs)
	}
	if !exists(Socket) {
		if exists(Real) { // let the real sudo explain why it cannot
			_ = syscall.Exec(Real, append([]string{name}, args...), os.Environ())
		}
		fmt.Fprintf(os.Stderr, "sudo: no sudo broker is running in this sandbox (%s)\n", Socket)
		return 1
	}
	conn, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: Socket, Net: "unix"})
	// A socket left by an earlier boot (a filesystem-only image keeps /run) refuses
	// until the new broker renames its own over it: retry for the same 5 s.
	for deadline := time.Now().Add(5 * time.Second); errors.Is(err, syscall.ECONNREFUSED) && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		conn, err = net.DialUnix("unix", nil, &net.UnixAddr{Name: Socket, Net: "unix"})
	}
	if err != nil {
		if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
			fmt.Fprintln(os.Stderr, "sudo: you are not allowed to use sudo (not in group sudo)")
		} else {
			fmt.Fprintf(os.Stderr, "sudo: cannot reach the sudo broker at %s: %v\n", Socket, err)
		}
		return 1
	}
	defer conn.Close()
	body, _ := json.Marshal(req)
	head := binary.BigEndian.AppendUint32(nil, uint32(len(body)))
	oob := append(syscall.UnixRights(0, 1, 2),
		syscall.UnixCredentials(&syscall.Ucred{Pid: int32(os.Getpid()), Uid: uint32(os.Getuid()), Gid: uint32(os.Getgid())})...)
	if _, _, err := conn.WriteMsgUnix(head, oob, nil); err != nil {
		fmt.Fprintf(os.Stderr, "sudo: the sudo broker refused the request: %v\n", err)
		return 1
	}
	if _, err := conn.Write(body); err != nil {
		fmt.Fprintf(os.Stderr, "sudo: the sudo broker went away: %v\n", err)
		return 1
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT)
	go func() {
		for s := range sigs {
			_, _ = conn.Write([]byte{byte(s.(syscall.Signal))})
		}
	}()
	var status [4]byte
	if _, err := io.ReadFull(conn, status[:]); err != nil {
		fmt.Fprintln(os.Stderr, "sudo: the sudo broker went away")
		return 1
	}
	return int(int32(binary.BigEndian.Uint32(status[:])))
}

// groupOf returns the gid and members of group name in /etc/group.
func groupOf(name string) (gid int, members []string, ok bool) {
	f, err := os.Open("/etc/group")
	if err != nil {
		return 0, nil, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Split(sc.Text(), ":")
		if len(fields) >= 4 && fields[0] == name {
			g, err := strconv.Atoi(fields[2])
			if err != nil {
				continue
			}
			var ms []string
			for _, m := range strings.Split(fields[3], ",") {
				if m = strings.TrimSpace(m); m != "" {
					ms = append(ms, m)
				}
			}
			return g, ms, true
		}
	}
	return 0, nil, false
}

// Allowed reports whether uid may use sudo: root, or a member of Group.
func Allowed(db identity.DB, uid uint32) bool {
	if uid == 0 {
		return true
	}
	gid, members, ok := groupOf(Group)
	if !ok {
		return false
	}
	name := db.UserName(uid)
	u, err := db.Lookup(name)
	if err != nil {
		return false
	}
	if int(u.GID) == gid {
		return true
	}
	for _, m := range members {
		if m == name {
			return true
		}
	}
	return false
}

// Broker is envd run as "sudo-broker" (as root): it serves Socket forever.
func Broker() error {
	// Observed, not ignored: commands must start with default dispositions.
	quiet := make(chan os.Signal, 4)
	signal.Notify(quiet, syscall.SIGINT, syscall.SIGQUIT, syscall.SIGHUP, syscall.SIGPIPE)
	go func() {
		for range quiet {
		}
	}()
	if err := os.MkdirAll(filepath.Dir(Socket), 0o755); err != nil {
		return err
	}
	// Bound, restricted and listening under a temporary name, then renamed: the
	// socket appears (the client waits for it) only when it accepts.
	tmp := Socket + ".new"
	_ = os.Remove(tmp)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return err
	}
	ln.SetUnlinkOnClose(false)
	if raw, err := ln.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_PASSCRED, 1) })
	}
	if gid, _, ok := groupOf(Group); ok {
		_ = os.Chown(tmp, 0, gid)
		_ = os.Chmod(tmp, 0o660)
	} else {
		_ = os.Chmod(tmp, 0o600)
	}
	if err := os.Rename(tmp, Socket); err != nil {
		return err
	}
	for {
		conn, err := ln.AcceptUnix()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return err
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		go handle(conn)
	}
}

func handle(conn *net.UnixConn) {
	defer conn.Close()
	var fds []int
	defer func() {
		for _, fd := range fds {
			syscall.Close(fd)
		}
	}()
	if raw, err := conn.SyscallConn(); err == nil {
		_ = raw.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_PASSCRED, 1) })
	}
	reply := func(code int) { _, _ = conn.Write(binary.BigEndian.AppendUint32(nil, uint32(int32(code)))) }
	head := make([]byte, 4)
	oob := make([]byte, syscall.CmsgSpace(3*4)+syscall.CmsgSpace(syscall.SizeofUcred))
	n, oobn, _, _, err := conn.ReadMsgUnix(head, oob)
	if err != nil {
		return
	}
	var cred *syscall.Ucred
	if msgs, err := syscall.ParseSocketControlMessage(oob[:oobn]); err == nil {
		for i := range msgs {
			m := &msgs[i]
			if m.Header.Level != syscall.SOL_SOCKET {
				continue
			}
			switch m.Header.Type {
			case syscall.SCM_RIGHTS:
				if r, err := syscall.ParseUnixRights(m); err == nil {
					fds = append(fds, r...)
				}
			case syscall.SCM_CREDENTIALS:
				if c, err := syscall.ParseUnixCredentials(m); err == nil {
					cred = c
				}
			}
		}
	}
	if _, err := io.ReadFull(conn, head[n:]); err != nil {
		return
	}
	size := binary.BigEndian.Uint32(head)
	if size > maxBody {
		reply(1)
		return
	}
	body := make([]byte, size)
	if _, err := io.ReadFull(conn, body); err != nil {
		return
	}
	var req request
	if err := json.Unmarshal(body, &req); err != nil || len(fds) != 3 {
		reply(1)
		return
	}
	stdio := [3]*os.File{}
	for i, fd := range fds {
		stdio[i] = os.NewFile(uintptr(fd), fmt.Sprintf("fd%d", i))
	}
	fds = nil // the files own them now
	defer func() {
		for _, f := range stdio {
			f.Close()
		}
	}()
	if cred == nil || !Allowed(identity.DB{}, cred.Uid) {
		fmt.Fprintln(stdio[2], "sudo: you are not allowed to use sudo (not in group sudo)")
		reply(1)
		return
	}
	sigs := make(chan os.Signal, 4)
	go func() {
		b := make([]byte, 1)
		for {
			if _, err := conn.Read(b); err != nil {
				sigs <- syscall.SIGHUP // the client went away
				return
			}
			sigs <- syscall.Signal(b[0])
		}
	}()
	reply(execute(req, cred.Uid, stdio, sigs))
}

// execute runs req for the caller uid with stdio, relaying sigs to it; it
// returns the exit status (128+N for a command killed by signal N).
func execute(req request, caller uint32, stdio [3]*os.File, sigs <-chan os.Signal) int {
	var cmd *exec.Cmd
	if exists(Real) {
		name := "sudo"
		if req.Name == "sudoedit" { // the real sudo's edit mode is chosen by its argv[0]
			name = req.Name
		}
		cmd = &exec.Cmd{Path: Real, Args: append([]string{name}, req.Argv...), Env: envList(req.Env)}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	} else if req.Name == "sudoedit" {
		fmt.Fprintln(stdio[2], "sudoedit: not supported here (this image has no sudo package)")
		return 1
	} else {
		p, err := Plan(identity.DB{}, req.Argv, req.Env, caller)
		if err != nil {
			fmt.Fprintf(stdio[2], "sudo: %v\n", err)
			return 1
		}
		if p == nil { // -v, -k: nothing to run
			return 0
		}
		cmd = &exec.Cmd{Path: p.Path, Args: p.Argv, Env: p.Env, Dir: p.Dir}
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Credential: p.Cred}
	}
	if cmd.Dir == "" {
		cmd.Dir = req.Cwd
	}
	if st, err := os.Stat(cmd.Dir); err != nil || !st.IsDir() {
		cmd.Dir = "/"
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdio[0], stdio[1], stdio[2]
	if err := cmd.Start(); err != nil {
		fmt.Fprintf(stdio[2], "sudo: %v\n", err)
		return 1
	}
	done := make(chan struct{})
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err := cmd.Wait()
	close(done)
	if err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) {
			return 1
		}
	}
	ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
	if ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return ws.ExitStatus()
}
