package filesystem

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"github.com/fsnotify/fsnotify"

	"forkyard/envd/internal/fsutil"
	"forkyard/envd/internal/identity"
	rpc "forkyard/envd/internal/spec/filesystem"
)

// watcher turns inotify events below root into FilesystemEvents. With
// recursive set it watches every directory below root, adding directories
// as they appear (and reporting what was created inside them before their
// watch was in place).
type watcher struct {
	root         string
	recursive    bool
	includeEntry bool
	users        identity.DB

	w    *fsnotify.Watcher
	emit func(*rpc.FilesystemEvent)
	fail func(error)

	closeOnce sync.Once
	done      chan struct{}
}

func newWatcher(root string, recursive, includeEntry bool, users identity.DB,
	emit func(*rpc.FilesystemEvent), fail func(error)) (*watcher, error) {
	fw, err := fsnotify.NewBufferedWatcher(4096)
	if err != nil {
		return nil, fmt.Errorf("creating watcher: %w", err)
	}
	w := &watcher{
		root: root, recursive: recursive, includeEntry: includeEntry, users: users,
		w: fw, emit: emit, fail: fail, done: make(chan struct{}),
	}
	if err := fw.Add(root); err != nil {
		_ = fw.Close()
		return nil, fmt.Errorf("watching %s: %w", root, err)
	}
	if recursive {
		w.addTree(root, false)
	}
	go w.loop()
	return w, nil
}

// addTree watches every directory below dir. With report set, entries found
// are emitted as CREATE events (they appeared before the watch existed).
func (w *watcher) addTree(dir string, report bool) {
	_ = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == dir {
				return err
			}
			return nil
		}
		if p == dir {
			return nil
		}
		if report {
			w.send(p, rpc.EventType_EVENT_TYPE_CREATE)
		}
		if d.IsDir() {
			_ = w.w.Add(p)
		}
		return nil
	})
}

func (w *watcher) send(path string, t rpc.EventType) {
	name, err := filepath.Rel(w.root, path)
	if err != nil {
		name = path
	}
	ev := &rpc.FilesystemEvent{Name: name, Type: t}
	if w.includeEntry {
		if e, err := fsutil.Entry(path, identity.NewNameCache(w.users)); err == nil {
			ev.Entry = e
		}
	}
	w.emit(ev)
}

func (w *watcher) loop() {
	for {
		select {
		case <-w.done:
			return
		case err, ok := <-w.w.Errors:
			if !ok {
				return
			}
			if errors.Is(err, fsnotify.ErrEventOverflow) {
				// Events were lost; keep going rather than kill the watch.
				continue
			}
			w.fail(fmt.Errorf("watcher error: %w", err))
			return
		case e, ok := <-w.w.Events:
			if !ok {
				return
			}
			w.handle(e)
		}
	}
}

func (w *watcher) handle(e fsnotify.Event) {
	// One inotify event can carry several operations.
	if e.Has(fsnotify.Create) {
		w.send(e.Name, rpc.EventType_EVENT_TYPE_CREATE)
		if w.recursive {
			if st, err := os.Lstat(e.Name); err == nil && st.IsDir() {
				_ = w.w.Add(e.Name)
				w.addTree(e.Name, true)
			}
		}
	}
	if e.Has(fsnotify.Rename) {
		w.send(e.Name, rpc.EventType_EVENT_TYPE_RENAME)
	}
	if e.Has(fsnotify.Chmod) {
		w.send(e.Name, rpc.EventType_EVENT_TYPE_CHMOD)
	}
	if e.Has(fsnotify.Write) {
		w.send(e.Name, rpc.EventType_EVENT_TYPE_WRITE)
	}
	if e.Has(fsnotify.Remove) {
		w.send(e.Name, rpc.EventType_EVENT_TYPE_REMOVE)
	}
}

// Close stops the watch; it is safe to call more than once.
func (w *watcher) Close() {
	w.closeOnce.Do(func() {
		close(w.done)
		_ = w.w.Close()
	})
}
