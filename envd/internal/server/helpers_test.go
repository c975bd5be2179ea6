package server

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/reaper"
	"forkyard/envd/internal/spec/filesystem/filesystemconnect"
	"forkyard/envd/internal/spec/process/processconnect"
	"forkyard/envd/internal/state"
)

// One reaper per test binary: it waits for every child of the process.
var (
	reaperOnce sync.Once
	testReaper *reaper.Reaper
)

func sharedReaper() *reaper.Reaper {
	reaperOnce.Do(func() { testReaper = reaper.New() })
	return testReaper
}

type env struct {
	t    *testing.T
	srv  *Server
	ts   *httptest.Server
	home string
	proc processconnect.ProcessClient
	fs   filesystemconnect.FilesystemClient
}

// newEnv starts envd's handler on a local test server. The sandbox user
// "tester" is the current uid, with a temporary home, defined in a
// temporary /etc so no real account is needed.
func newEnv(t *testing.T, h2c bool) *env {
	t.Helper()
	root := t.TempDir()
	home := filepath.Join(root, "home", "tester")
	if err := os.MkdirAll(filepath.Join(root, "etc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(home, 0o755); err != nil {
		t.Fatal(err)
	}
	uid, gid := os.Getuid(), os.Getgid()
	passwd := fmt.Sprintf("root:x:0:0:root:/root:/bin/sh\ntester:x:%d:%d::%s:/bin/sh\n", uid, gid, home)
	if uid == 0 {
		passwd = fmt.Sprintf("tester:x:0:0::%s:/bin/sh\nroot:x:0:0:root:/root:/bin/sh\n", home)
	}
	passwd += "nobody:x:65534:65534::/nonexistent:/bin/sh\n"
	group := fmt.Sprintf("testers:x:%d:\n", gid)
	if err := os.WriteFile(filepath.Join(root, "etc", "passwd"), []byte(passwd), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "etc", "group"), []byte(group), 0o644); err != nil {
		t.Fatal(err)
	}
	st := state.New(identity.DB{Root: root}, "tester")
	s := New(st, sharedReaper(), Options{})
	ts := httptest.NewUnstartedServer(s.Handler)
	ts.Config = s.HTTPServer(nil)
	ts.Start()
	t.Cleanup(func() {
		ts.Close()
		s.Filesystem.Close()
	})

	client := ts.Client()
	if h2c {
		tr := &http.Transport{}
		p := new(http.Protocols)
		p.SetUnencryptedHTTP2(true)
		tr.Protocols = p
		client = &http.Client{Transport: tr}
	}
	return &env{
		t: t, srv: s, ts: ts, home: home,
		// JSON, like the Python SDK.
		proc: processconnect.NewProcessClient(client, ts.URL, connect.WithProtoJSON()),
		fs:   filesystemconnect.NewFilesystemClient(client, ts.URL, connect.WithProtoJSON()),
	}
}

func codeOf(err error) connect.Code {
	return connect.CodeOf(err)
}
