package server

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"connectrpc.com/connect"

	rpc "forkyard/envd/internal/spec/filesystem"
)

func TestStatMakeDirMoveRemove(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()

	// Relative paths are taken from the user's home.
	md, err := e.fs.MakeDir(ctx, connect.NewRequest(&rpc.MakeDirRequest{Path: "a/b/c"}))
	if err != nil {
		t.Fatal(err)
	}
	if md.Msg.GetEntry().GetPath() != filepath.Join(e.home, "a/b/c") || md.Msg.GetEntry().GetType() != rpc.FileType_FILE_TYPE_DIRECTORY {
		t.Fatalf("make dir entry %+v", md.Msg.GetEntry())
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&rpc.MakeDirRequest{Path: "~/a/b/c"})); codeOf(err) != connect.CodeAlreadyExists {
		t.Fatalf("second make dir: %v", err)
	}

	file := filepath.Join(e.home, "a", "f.txt")
	if err := os.WriteFile(file, []byte("12345"), 0o640); err != nil {
		t.Fatal(err)
	}
	st, err := e.fs.Stat(ctx, connect.NewRequest(&rpc.StatRequest{Path: file}))
	if err != nil {
		t.Fatal(err)
	}
	en := st.Msg.GetEntry()
	if en.GetName() != "f.txt" || en.GetSize() != 5 || en.GetMode() != 0o640 || en.GetPermissions() != "-rw-r-----" ||
		en.GetType() != rpc.FileType_FILE_TYPE_FILE || en.GetOwner() != "tester" || en.GetModifiedTime() == nil {
		t.Fatalf("stat %+v", en)
	}
	if _, err := e.fs.MakeDir(ctx, connect.NewRequest(&rpc.MakeDirRequest{Path: file})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("make dir over file: %v", err)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&rpc.StatRequest{Path: "/no/such/path"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("stat missing: %v", err)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&rpc.StatRequest{Path: file + "/below"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("stat below a file: %v", err)
	}
	if _, err := e.fs.Stat(ctx, connect.NewRequest(&rpc.StatRequest{Path: "~other/x"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("~other: %v", err)
	}

	// Symlink: reports the target's type and is_symlink.
	link := filepath.Join(e.home, "link")
	if err := os.Symlink(filepath.Join(e.home, "a"), link); err != nil {
		t.Fatal(err)
	}
	st, err = e.fs.Stat(ctx, connect.NewRequest(&rpc.StatRequest{Path: link}))
	if err != nil || !st.Msg.GetEntry().GetIsSymlink() || st.Msg.GetEntry().GetType() != rpc.FileType_FILE_TYPE_DIRECTORY ||
		st.Msg.GetEntry().GetSymlinkTarget() != filepath.Join(e.home, "a") {
		t.Fatalf("symlink stat %+v %v", st, err)
	}

	mv, err := e.fs.Move(ctx, connect.NewRequest(&rpc.MoveRequest{Source: file, Destination: "new/dir/g.txt"}))
	if err != nil || mv.Msg.GetEntry().GetPath() != filepath.Join(e.home, "new/dir/g.txt") || mv.Msg.GetEntry().GetSize() != 5 {
		t.Fatalf("move %+v %v", mv, err)
	}
	if _, err := e.fs.Move(ctx, connect.NewRequest(&rpc.MoveRequest{Source: file, Destination: "x"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("move missing: %v", err)
	}

	if _, err := e.fs.Remove(ctx, connect.NewRequest(&rpc.RemoveRequest{Path: "new"})); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.home, "new")); !os.IsNotExist(err) {
		t.Fatalf("not removed: %v", err)
	}
}

func TestListDirDepth(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	for _, d := range []string{"d/x/y", "d/z"} {
		if err := os.MkdirAll(filepath.Join(e.home, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(e.home, "d/x/y/deep.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.home, "d/top.txt"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	names := func(depth uint32) []string {
		res, err := e.fs.ListDir(ctx, connect.NewRequest(&rpc.ListDirRequest{Path: "d", Depth: depth}))
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, en := range res.Msg.GetEntries() {
			rel, _ := filepath.Rel(filepath.Join(e.home, "d"), en.GetPath())
			out = append(out, rel)
		}
		sort.Strings(out)
		return out
	}
	if got := names(1); len(got) != 3 || got[0] != "top.txt" || got[1] != "x" || got[2] != "z" {
		t.Fatalf("depth 1: %v", got)
	}
	if got := names(0); len(got) != 3 || got[0] != "top.txt" { // unset depth lists one level, as E2B's
		t.Fatalf("depth 0: %v", got)
	}
	if got := names(2); len(got) != 4 {
		t.Fatalf("depth 2: %v", got)
	}
	if got := names(5); len(got) != 5 {
		t.Fatalf("depth 5: %v", got)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&rpc.ListDirRequest{Path: "d/top.txt"})); codeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("list a file: %v", err)
	}
	if _, err := e.fs.ListDir(ctx, connect.NewRequest(&rpc.ListDirRequest{Path: "nope"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("list missing: %v", err)
	}
}

func TestWatchDirStream(t *testing.T) {
	e := newEnv(t, true)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := filepath.Join(e.home, "w")
	// "old" exists before the watch: a recursive watch covers it too.
	if err := os.MkdirAll(filepath.Join(dir, "old"), 0o755); err != nil {
		t.Fatal(err)
	}
	stream, err := e.fs.WatchDir(ctx, connect.NewRequest(&rpc.WatchDirRequest{Path: dir, Recursive: true, IncludeEntry: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	if !stream.Receive() || stream.Msg().GetStart() == nil {
		t.Fatalf("no start event: %v", stream.Err())
	}
	go func() {
		_ = os.Mkdir(filepath.Join(dir, "sub"), 0o755)
		time.Sleep(100 * time.Millisecond)
		_ = os.WriteFile(filepath.Join(dir, "sub", "f"), []byte("x"), 0o644)
		_ = os.WriteFile(filepath.Join(dir, "old", "g"), []byte("x"), 0o644)
	}()
	seen := map[string]bool{}
	timeout := time.AfterFunc(5*time.Second, cancel)
	defer timeout.Stop()
	for !(seen["sub/f WRITE"] && seen["old/g WRITE"]) && stream.Receive() {
		ev := stream.Msg().GetFilesystem()
		if ev == nil {
			continue
		}
		seen[ev.GetName()+" "+ev.GetType().String()[len("EVENT_TYPE_"):]] = true
		if ev.GetType() == rpc.EventType_EVENT_TYPE_CREATE && ev.GetEntry() == nil {
			t.Fatalf("create event without entry: %+v", ev)
		}
	}
	if !seen["sub CREATE"] || !seen["sub/f CREATE"] || !seen["sub/f WRITE"] || !seen["old/g CREATE"] {
		t.Fatalf("events: %v (err %v)", seen, stream.Err())
	}
}

func TestPolledWatcher(t *testing.T) {
	e := newEnv(t, false)
	ctx := context.Background()
	if _, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&rpc.CreateWatcherRequest{Path: "missing"})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("watch missing: %v", err)
	}
	cw, err := e.fs.CreateWatcher(ctx, connect.NewRequest(&rpc.CreateWatcherRequest{Path: e.home}))
	if err != nil {
		t.Fatal(err)
	}
	id := cw.Msg.GetWatcherId()
	_ = os.WriteFile(filepath.Join(e.home, "p.txt"), []byte("x"), 0o644)
	var events []*rpc.FilesystemEvent
	for deadline := time.Now().Add(3 * time.Second); len(events) == 0 && time.Now().Before(deadline); {
		time.Sleep(50 * time.Millisecond)
		got, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&rpc.GetWatcherEventsRequest{WatcherId: id}))
		if err != nil {
			t.Fatal(err)
		}
		events = append(events, got.Msg.GetEvents()...)
	}
	if len(events) == 0 || events[0].GetName() != "p.txt" || events[0].GetType() != rpc.EventType_EVENT_TYPE_CREATE {
		t.Fatalf("events %v", events)
	}
	if _, err := e.fs.RemoveWatcher(ctx, connect.NewRequest(&rpc.RemoveWatcherRequest{WatcherId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := e.fs.GetWatcherEvents(ctx, connect.NewRequest(&rpc.GetWatcherEventsRequest{WatcherId: id})); codeOf(err) != connect.CodeNotFound {
		t.Fatalf("removed watcher: %v", err)
	}
}
