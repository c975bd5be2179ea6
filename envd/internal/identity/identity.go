// Package identity resolves sandbox users and groups by reading /etc/passwd
// and /etc/group directly, in process, without cgo or NSS helpers.
package identity

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// User is one /etc/passwd entry plus the supplementary groups that list it.
type User struct {
	Name   string
	UID    uint32
	GID    uint32
	Home   string
	Shell  string
	Groups []uint32 // supplementary group ids (from /etc/group), without GID
}

// ErrUnknownUser is returned when a user name is not in the passwd file.
var ErrUnknownUser = errors.New("unknown user")

// DB reads users and groups from files below Root ("/" when empty).
// Edits in the sandbox (useradd etc.) are seen immediately: the parsed
// files are cached but revalidated against their stat on every lookup.
type DB struct {
	Root string
}

func (d DB) path(name string) string {
	root := d.Root
	if root == "" {
		root = "/"
	}
	return filepath.Join(root, "etc", name)
}

// fileCache keeps parsed passwd/group files, revalidated by a stat per
// lookup (cheap even under gVisor), so RPCs do not re-read them each time.
var fileCache = struct {
	sync.Mutex
	m map[string]cachedFile
}{m: map[string]cachedFile{}}

type cachedFile struct {
	size  int64
	mtime int64
	ino   uint64
	lines [][]string
}

func readLines(path string) ([][]string, error) {
	st, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	var ino uint64
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		ino = sys.Ino
	}
	fileCache.Lock()
	c, ok := fileCache.m[path]
	fileCache.Unlock()
	if ok && c.size == st.Size() && c.mtime == st.ModTime().UnixNano() && c.ino == ino {
		return c.lines, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var lines [][]string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || line[0] == '+' || line[0] == '-' {
			continue
		}
		lines = append(lines, strings.Split(line, ":"))
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	fileCache.Lock()
	fileCache.m[path] = cachedFile{size: st.Size(), mtime: st.ModTime().UnixNano(), ino: ino, lines: lines}
	fileCache.Unlock()
	return lines, nil
}

// forEachLine calls fn with the colon-separated fields of every
// non-comment line of the named file under /etc. fn returns false to stop.
func (d DB) forEachLine(name string, fn func(fields []string) bool) error {
	lines, err := readLines(d.path(name))
	if err != nil {
		return err
	}
	for _, f := range lines {
		if !fn(f) {
			return nil
		}
	}
	return nil
}

func parseID(s string) (uint32, bool) {
	v, err := strconv.ParseUint(s, 10, 32)
	return uint32(v), err == nil
}

// Lookup returns the user named name. A purely numeric name that is not in
// the passwd file is accepted as a uid only if a passwd entry has that uid.
func (d DB) Lookup(name string) (*User, error) {
	if name == "" {
		return nil, fmt.Errorf("%w: empty name", ErrUnknownUser)
	}
	var u *User
	err := d.forEachLine("passwd", func(f []string) bool {
		if len(f) < 7 || f[0] != name {
			return true
		}
		uid, ok1 := parseID(f[2])
		gid, ok2 := parseID(f[3])
		if !ok1 || !ok2 {
			return true
		}
		u = &User{Name: f[0], UID: uid, GID: gid, Home: f[5], Shell: f[6]}
		return false
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("reading passwd: %w", err)
	}
	if u == nil {
		if name == "root" {
			// A rootfs without /etc/passwd still has root.
			u = &User{Name: "root", UID: 0, GID: 0, Home: "/root", Shell: "/bin/sh"}
		} else {
			return nil, fmt.Errorf("%w: %q", ErrUnknownUser, name)
		}
	}
	if u.Home == "" {
		u.Home = "/"
	}
	u.Groups = d.supplementary(u.Name, u.GID)
	return u, nil
}

func (d DB) supplementary(name string, primary uint32) []uint32 {
	var out []uint32
	_ = d.forEachLine("group", func(f []string) bool {
		if len(f) < 4 {
			return true
		}
		gid, ok := parseID(f[2])
		if !ok || gid == primary {
			return true
		}
		for _, m := range strings.Split(f[3], ",") {
			if strings.TrimSpace(m) == name {
				out = append(out, gid)
				break
			}
		}
		return true
	})
	return out
}

// UserName returns the name for uid, or the decimal uid when unknown.
func (d DB) UserName(uid uint32) string {
	name := strconv.FormatUint(uint64(uid), 10)
	_ = d.forEachLine("passwd", func(f []string) bool {
		if len(f) >= 3 {
			if v, ok := parseID(f[2]); ok && v == uid {
				name = f[0]
				return false
			}
		}
		return true
	})
	return name
}

// GroupName returns the name for gid, or the decimal gid when unknown.
func (d DB) GroupName(gid uint32) string {
	name := strconv.FormatUint(uint64(gid), 10)
	_ = d.forEachLine("group", func(f []string) bool {
		if len(f) >= 3 {
			if v, ok := parseID(f[2]); ok && v == gid {
				name = f[0]
				return false
			}
		}
		return true
	})
	return name
}

// NameCache memoizes uid/gid to name lookups for the span of one request
// (a directory listing resolves the same few owners many times).
type NameCache struct {
	db     DB
	users  map[uint32]string
	groups map[uint32]string
}

// NewNameCache returns an empty cache over db.
func NewNameCache(db DB) *NameCache {
	return &NameCache{db: db, users: map[uint32]string{}, groups: map[uint32]string{}}
}

// User returns the user name for uid.
func (c *NameCache) User(uid uint32) string {
	if n, ok := c.users[uid]; ok {
		return n
	}
	n := c.db.UserName(uid)
	c.users[uid] = n
	return n
}

// Group returns the group name for gid.
func (c *NameCache) Group(gid uint32) string {
	if n, ok := c.groups[gid]; ok {
		return n
	}
	n := c.db.GroupName(gid)
	c.groups[gid] = n
	return n
}
