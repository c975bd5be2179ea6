// Package filesystem implements the filesystem.Filesystem Connect service:
// stat, list, make dir, move, remove and directory watches (streamed or
// polled).
package filesystem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"connectrpc.com/connect"

	"forkyard/envd/internal/fsutil"
	"forkyard/envd/internal/identity"
	"forkyard/envd/internal/rpcutil"
	rpc "forkyard/envd/internal/spec/filesystem"
	"forkyard/envd/internal/spec/filesystem/filesystemconnect"
	"forkyard/envd/internal/state"
)

// maxPolledEvents bounds the events a polled watcher keeps between
// GetWatcherEvents calls; older ones are dropped beyond it.
const maxPolledEvents = 100_000

// Service implements filesystemconnect.FilesystemHandler.
type Service struct {
	st *state.State

	mu       sync.Mutex
	watchers map[string]*polledWatcher
}

var _ filesystemconnect.FilesystemHandler = (*Service)(nil)

// New returns a Service.
func New(st *state.State) *Service {
	return &Service{st: st, watchers: map[string]*polledWatcher{}}
}

// Handler returns the HTTP path prefix and handler for the service.
func (s *Service) Handler(opts ...connect.HandlerOption) (string, http.Handler) {
	return filesystemconnect.NewFilesystemHandler(s, opts...)
}

func (s *Service) userAndPath(h http.Header, p string) (*identity.User, string, error) {
	u, err := rpcutil.AuthUser(s.st, h)
	if err != nil {
		return nil, "", err
	}
	if strings.ContainsRune(p, 0) {
		return nil, "", connect.NewError(connect.CodeInvalidArgument, errors.New("path contains a NUL byte"))
	}
	abs, err := s.st.ResolvePath(p, u)
	if err != nil {
		return nil, "", connect.NewError(connect.CodeInvalidArgument, err)
	}
	return u, abs, nil
}

// Stat returns information about one path.
func (s *Service) Stat(_ context.Context, req *connect.Request[rpc.StatRequest]) (*connect.Response[rpc.StatResponse], error) {
	u, p, err := s.userAndPath(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	var e *rpc.EntryInfo
	err = identity.AsUser(u, func() (err error) {
		e, err = fsutil.Entry(p, identity.NewNameCache(s.st.Users))
		return err
	})
	if err != nil {
		return nil, fsutil.Error(err, "stat %s", p)
	}
	return connect.NewResponse(&rpc.StatResponse{Entry: e}), nil
}

// MakeDir creates a directory and its parents, owned by the user.
func (s *Service) MakeDir(_ context.Context, req *connect.Request[rpc.MakeDirRequest]) (resp *connect.Response[rpc.MakeDirResponse], err error) {
	u, err := rpcutil.AuthUser(s.st, req.Header())
	if err != nil {
		return nil, err
	}
	if aerr := identity.AsUser(u, func() error { // with exactly u's permissions
		resp, err = s.makeDirAs(req)
		return nil
	}); aerr != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("switching to user %s: %w", u.Name, aerr))
	}
	return resp, err
}

func (s *Service) makeDirAs(req *connect.Request[rpc.MakeDirRequest]) (*connect.Response[rpc.MakeDirResponse], error) {
	u, p, err := s.userAndPath(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if st, err := os.Stat(p); err == nil {
		if st.IsDir() {
			return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("directory already exists: %s", p))
		}
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path already exists but it is not a directory: %s", p))
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fsutil.Error(err, "stat %s", p)
	}
	if err := fsutil.EnsureDir(p, int(u.UID), int(u.GID)); err != nil {
		return nil, fsutil.Error(err, "creating directory %s", p)
	}
	e, err := fsutil.Entry(p, identity.NewNameCache(s.st.Users))
	if err != nil {
		return nil, fsutil.Error(err, "stat %s", p)
	}
	return connect.NewResponse(&rpc.MakeDirResponse{Entry: e}), nil
}

// Move renames source to destination, creating the destination's parents.
func (s *Service) Move(_ context.Context, req *connect.Request[rpc.MoveRequest]) (resp *connect.Response[rpc.MoveResponse], err error) {
	u, err := rpcutil.AuthUser(s.st, req.Header())
	if err != nil {
		return nil, err
	}
	if aerr := identity.AsUser(u, func() error { // with exactly u's permissions
		resp, err = s.moveAs(req)
		return nil
	}); aerr != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("switching to user %s: %w", u.Name, aerr))
	}
	return resp, err
}

func (s *Service) moveAs(req *connect.Request[rpc.MoveRequest]) (*connect.Response[rpc.MoveResponse], error) {
	u, src, err := s.userAndPath(req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	_, dst, err := s.userAndPath(req.Header(), req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	if _, err := os.Lstat(src); err != nil {
		return nil, fsutil.Error(err, "source %s", src)
	}
	if err := fsutil.EnsureDir(filepath.Dir(dst), int(u.UID), int(u.GID)); err != nil {
		return nil, fsutil.Error(err, "creating parent of %s", dst)
	}
	if err := os.Rename(src, dst); err != nil {
		return nil, fsutil.Error(err, "renaming %s to %s", src, dst)
	}
	e, err := fsutil.Entry(dst, identity.NewNameCache(s.st.Users))
	if err != nil {
		return nil, fsutil.Error(err, "stat %s", dst)
	}
	return connect.NewResponse(&rpc.MoveResponse{Entry: e}), nil
}

// ListDir lists a directory down to the requested depth (1 = direct
// children). A symlinked directory argument is followed; symlinks below it
// are listed, not followed.
func (s *Service) ListDir(_ context.Context, req *connect.Request[rpc.ListDirRequest]) (resp *connect.Response[rpc.ListDirResponse], err error) {
	u, err := rpcutil.AuthUser(s.st, req.Header())
	if err != nil {
		return nil, err
	}
	if aerr := identity.AsUser(u, func() error { // with exactly u's permissions
		resp, err = s.listDirAs(req)
		return nil
	}); aerr != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("switching to user %s: %w", u.Name, aerr))
	}
	return resp, err
}

func (s *Service) listDirAs(req *connect.Request[rpc.ListDirRequest]) (*connect.Response[rpc.ListDirResponse], error) {
	_, p, err := s.userAndPath(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := int(req.Msg.GetDepth())
	if depth <= 0 {
		depth = 1
	}
	real, err := filepath.EvalSymlinks(p)
	if err != nil {
		return nil, fsutil.Error(err, "resolving %s", p)
	}
	st, err := os.Stat(real)
	if err != nil {
		return nil, fsutil.Error(err, "stat %s", p)
	}
	if !st.IsDir() {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path is not a directory: %s", p))
	}
	names := identity.NewNameCache(s.st.Users)
	entries := []*rpc.EntryInfo{}
	err = filepath.WalkDir(real, func(path string, d fs.DirEntry, werr error) error {
		if werr != nil {
			if path == real {
				return werr
			}
			return nil // unreadable subtree: skip it
		}
		if path == real {
			return nil
		}
		rel, err := filepath.Rel(real, path)
		if err != nil {
			return err
		}
		level := strings.Count(rel, string(filepath.Separator)) + 1
		if level > depth {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return nil // vanished meanwhile
		}
		e := fsutil.EntryFromInfo(path, info, names)
		e.Path = filepath.Join(p, rel)
		entries = append(entries, e)
		if d.IsDir() && level == depth {
			return filepath.SkipDir
		}
		return nil
	})
	if err != nil {
		return nil, fsutil.Error(err, "reading directory %s", p)
	}
	return connect.NewResponse(&rpc.ListDirResponse{Entries: entries}), nil
}

// Remove deletes a file or a directory tree. A missing path is not an error
// (as in E2B's envd).
func (s *Service) Remove(_ context.Context, req *connect.Request[rpc.RemoveRequest]) (resp *connect.Response[rpc.RemoveResponse], err error) {
	u, err := rpcutil.AuthUser(s.st, req.Header())
	if err != nil {
		return nil, err
	}
	if aerr := identity.AsUser(u, func() error { // with exactly u's permissions
		resp, err = s.removeAs(req)
		return nil
	}); aerr != nil {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("switching to user %s: %w", u.Name, aerr))
	}
	return resp, err
}

func (s *Service) removeAs(req *connect.Request[rpc.RemoveRequest]) (*connect.Response[rpc.RemoveResponse], error) {
	_, p, err := s.userAndPath(req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if p == "/" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("refusing to remove /"))
	}
	if err := os.RemoveAll(p); err != nil {
		return nil, fsutil.Error(err, "removing %s", p)
	}
	return connect.NewResponse(&rpc.RemoveResponse{}), nil
}

// Filesystem magic numbers of network filesystems (linux/magic.h).
var networkFSMagic = map[int64]bool{
	0x6969:     true, // NFS
	0xFF534D42: true, // CIFS
	0x517B:     true, // SMB
	0xFE534D42: true, // SMB2
	0x65735546: true, // FUSE
}

func (s *Service) watchTarget(h http.Header, path string, allowNetwork bool) (string, error) {
	_, p, err := s.userAndPath(h, path)
	if err != nil {
		return "", err
	}
	st, err := os.Stat(p)
	if err != nil {
		return "", fsutil.Error(err, "path %s", p)
	}
	if !st.IsDir() {
		return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("path %s is not a directory", p))
	}
	if !allowNetwork {
		var sfs syscall.Statfs_t
		if err := syscall.Statfs(p, &sfs); err == nil && networkFSMagic[int64(sfs.Type)] {
			return "", connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("cannot watch path on network filesystem: %s", p))
		}
	}
	return p, nil
}

// WatchDir streams filesystem events below a directory until the client
// goes away.
func (s *Service) WatchDir(ctx context.Context, req *connect.Request[rpc.WatchDirRequest], stream *connect.ServerStream[rpc.WatchDirResponse]) error {
	p, err := s.watchTarget(req.Header(), req.Msg.GetPath(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return err
	}
	events := make(chan *rpc.FilesystemEvent, 1024)
	failed := make(chan error, 1)
	w, err := newWatcher(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), s.st.Users,
		func(ev *rpc.FilesystemEvent) {
			select {
			case events <- ev:
			case <-ctx.Done():
			}
		},
		func(err error) {
			select {
			case failed <- err:
			default:
			}
		})
	if err != nil {
		return fsutil.Error(err, "watching %s", p)
	}
	defer w.Close()

	if err := stream.Send(&rpc.WatchDirResponse{Event: &rpc.WatchDirResponse_Start{Start: &rpc.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	ka := rpcutil.NewKeepalive(rpcutil.KeepaliveInterval(req.Header()))
	defer ka.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-failed:
			return connect.NewError(connect.CodeInternal, err)
		case <-ka.C:
			if err := stream.Send(&rpc.WatchDirResponse{Event: &rpc.WatchDirResponse_Keepalive{Keepalive: &rpc.WatchDirResponse_KeepAlive{}}}); err != nil {
				return err
			}
		case ev := <-events:
			if err := stream.Send(&rpc.WatchDirResponse{Event: &rpc.WatchDirResponse_Filesystem{Filesystem: ev}}); err != nil {
				return err
			}
			ka.Reset()
		}
	}
}

// polledWatcher buffers events for GetWatcherEvents.
type polledWatcher struct {
	w *watcher

	mu     sync.Mutex
	events []*rpc.FilesystemEvent
	err    error
}

func newWatcherID() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	return "w" + hex.EncodeToString(b)
}

// CreateWatcher starts a watch whose events are fetched by polling.
func (s *Service) CreateWatcher(_ context.Context, req *connect.Request[rpc.CreateWatcherRequest]) (*connect.Response[rpc.CreateWatcherResponse], error) {
	p, err := s.watchTarget(req.Header(), req.Msg.GetPath(), req.Msg.GetAllowNetworkMounts())
	if err != nil {
		return nil, err
	}
	pw := &polledWatcher{}
	w, err := newWatcher(p, req.Msg.GetRecursive(), req.Msg.GetIncludeEntry(), s.st.Users,
		func(ev *rpc.FilesystemEvent) {
			pw.mu.Lock()
			if len(pw.events) >= maxPolledEvents {
				pw.events = pw.events[1:]
			}
			pw.events = append(pw.events, ev)
			pw.mu.Unlock()
		},
		func(err error) {
			pw.mu.Lock()
			pw.err = err
			pw.mu.Unlock()
		})
	if err != nil {
		return nil, fsutil.Error(err, "watching %s", p)
	}
	pw.w = w
	id := newWatcherID()
	s.mu.Lock()
	s.watchers[id] = pw
	s.mu.Unlock()
	return connect.NewResponse(&rpc.CreateWatcherResponse{WatcherId: id}), nil
}

func (s *Service) getWatcher(id string) (*polledWatcher, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	pw, ok := s.watchers[id]
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher with id %s not found", id))
	}
	return pw, nil
}

// GetWatcherEvents returns and clears the events collected since the last
// call.
func (s *Service) GetWatcherEvents(_ context.Context, req *connect.Request[rpc.GetWatcherEventsRequest]) (*connect.Response[rpc.GetWatcherEventsResponse], error) {
	pw, err := s.getWatcher(req.Msg.GetWatcherId())
	if err != nil {
		return nil, err
	}
	pw.mu.Lock()
	defer pw.mu.Unlock()
	if pw.err != nil {
		return nil, connect.NewError(connect.CodeInternal, pw.err)
	}
	events := pw.events
	pw.events = nil
	if events == nil {
		events = []*rpc.FilesystemEvent{}
	}
	return connect.NewResponse(&rpc.GetWatcherEventsResponse{Events: events}), nil
}

// RemoveWatcher stops a polled watch.
func (s *Service) RemoveWatcher(_ context.Context, req *connect.Request[rpc.RemoveWatcherRequest]) (*connect.Response[rpc.RemoveWatcherResponse], error) {
	id := req.Msg.GetWatcherId()
	s.mu.Lock()
	pw, ok := s.watchers[id]
	delete(s.watchers, id)
	s.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("watcher with id %s not found", id))
	}
	pw.w.Close()
	return connect.NewResponse(&rpc.RemoveWatcherResponse{}), nil
}

// Close stops all polled watches.
func (s *Service) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, pw := range s.watchers {
		pw.w.Close()
		delete(s.watchers, id)
	}
}
