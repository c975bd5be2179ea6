// Package fsutil holds the filesystem helpers shared by the Filesystem RPC
// service and the /files HTTP API: entry info, metadata xattrs, creating
// parent directories owned by a user, and errno to Connect code mapping.
package fsutil

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/timestamppb"

	"forkyard/envd/internal/identity"
	rpc "forkyard/envd/internal/spec/filesystem"
)

// MetadataXattrPrefix namespaces user metadata stored on files.
const MetadataXattrPrefix = "user.e2b."

// Code maps a filesystem error to a Connect code.
func Code(err error) connect.Code {
	var errno syscall.Errno
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return connect.CodeNotFound
	case errors.Is(err, fs.ErrExist):
		return connect.CodeAlreadyExists
	case errors.Is(err, fs.ErrPermission), errors.Is(err, syscall.EROFS):
		return connect.CodePermissionDenied
	case errors.As(err, &errno):
		switch errno {
		case syscall.ENOTDIR, syscall.EISDIR, syscall.EINVAL, syscall.ENAMETOOLONG, syscall.ELOOP, syscall.EXDEV:
			return connect.CodeInvalidArgument
		case syscall.ENOTEMPTY, syscall.EBUSY:
			return connect.CodeFailedPrecondition
		case syscall.ENOSPC, syscall.EDQUOT:
			return connect.CodeResourceExhausted
		}
	}
	return connect.CodeInternal
}

// Error wraps err as a Connect error with the mapped code.
func Error(err error, format string, args ...any) error {
	return connect.NewError(Code(err), fmt.Errorf(format+": %w", append(args, err)...))
}

// fileType maps a mode to the proto file type.
func fileType(m fs.FileMode) rpc.FileType {
	switch {
	case m.IsRegular():
		return rpc.FileType_FILE_TYPE_FILE
	case m.IsDir():
		return rpc.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		return rpc.FileType_FILE_TYPE_SYMLINK
	}
	return rpc.FileType_FILE_TYPE_UNSPECIFIED
}

// Entry returns the EntryInfo of path (not following a final symlink; a
// symlink reports its target's type and is_symlink). names may be nil.
func Entry(path string, names *identity.NameCache) (*rpc.EntryInfo, error) {
	info, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	return EntryFromInfo(path, info, names), nil
}

// EntryFromInfo builds the EntryInfo for path from its Lstat result.
func EntryFromInfo(path string, info fs.FileInfo, names *identity.NameCache) *rpc.EntryInfo {
	if names == nil {
		names = identity.NewNameCache(identity.DB{})
	}
	mode := info.Mode()
	e := &rpc.EntryInfo{
		Name:         filepath.Base(path),
		Path:         path,
		Size:         info.Size(),
		Mode:         uint32(mode.Perm()),
		Permissions:  mode.String(),
		ModifiedTime: timestamppb.New(info.ModTime()),
		Type:         fileType(mode),
	}
	if mode&fs.ModeSymlink != 0 {
		e.IsSymlink = true
		target, err := filepath.EvalSymlinks(path)
		if err != nil {
			// Dangling: report the raw link text made absolute.
			raw, rerr := os.Readlink(path)
			if rerr == nil {
				if !filepath.IsAbs(raw) {
					raw = filepath.Join(filepath.Dir(path), raw)
				}
				target = raw
			} else {
				target = path
			}
		} else if ti, serr := os.Stat(target); serr == nil {
			e.Type = fileType(ti.Mode())
			e.Mode = uint32(ti.Mode().Perm())
		}
		e.SymlinkTarget = &target
	}
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		e.Owner = names.User(st.Uid)
		e.Group = names.Group(st.Gid)
	}
	if md := ReadMetadata(path); len(md) > 0 {
		e.Metadata = md
	}
	return e
}

// ReadMetadata returns the user.e2b.* xattrs of path (without following a
// final symlink), nil when none or unsupported.
func ReadMetadata(path string) map[string]string {
	size, err := unix.Llistxattr(path, nil)
	if err != nil || size <= 0 {
		return nil
	}
	buf := make([]byte, size)
	n, err := unix.Llistxattr(path, buf)
	if err != nil {
		return nil
	}
	var out map[string]string
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, MetadataXattrPrefix) {
			continue
		}
		vsize, err := unix.Lgetxattr(path, name, nil)
		if err != nil {
			continue
		}
		val := make([]byte, vsize)
		vn, err := unix.Lgetxattr(path, name, val)
		if err != nil {
			continue
		}
		if out == nil {
			out = map[string]string{}
		}
		out[strings.TrimPrefix(name, MetadataXattrPrefix)] = string(val[:vn])
	}
	return out
}

// ReplaceMetadata makes md the file's whole user metadata: user.e2b.* xattrs
// not in md are removed (an upload without metadata clears what an earlier
// upload of the same path left, as E2B's envd does), then md is written.
func ReplaceMetadata(path string, md map[string]string) error {
	for k := range ReadMetadata(path) {
		if _, keep := md[k]; keep {
			continue
		}
		if err := unix.Removexattr(path, MetadataXattrPrefix+k); err != nil && !errors.Is(err, unix.ENODATA) {
			return fmt.Errorf("clearing metadata %q: %w", k, err)
		}
	}
	return WriteMetadata(path, md)
}

// WriteMetadata stores md as user.e2b.* xattrs on path.
func WriteMetadata(path string, md map[string]string) error {
	for k, v := range md {
		if err := unix.Setxattr(path, MetadataXattrPrefix+k, []byte(v), 0); err != nil {
			if errors.Is(err, unix.ENOTSUP) {
				return fmt.Errorf("file metadata is not supported on this filesystem: %w", err)
			}
			return fmt.Errorf("setting metadata %q: %w", k, err)
		}
	}
	return nil
}

// EnsureDir creates dir and any missing parents, chowning each directory it
// creates to uid:gid. An existing non-directory on the way is an error.
func EnsureDir(dir string, uid, gid int) error {
	dir = filepath.Clean(dir)
	st, err := os.Stat(dir)
	if err == nil {
		if !st.IsDir() {
			return &fs.PathError{Op: "mkdir", Path: dir, Err: syscall.ENOTDIR}
		}
		return nil
	}
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if parent := filepath.Dir(dir); parent != dir {
		if err := EnsureDir(parent, uid, gid); err != nil {
			return err
		}
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		if errors.Is(err, fs.ErrExist) {
			if st, serr := os.Stat(dir); serr == nil && st.IsDir() {
				return nil
			}
		}
		return err
	}
	return Chown(dir, uid, gid)
}

// Chown changes ownership when envd may do so. Running as the user itself
// (identity.AsUser) it sets the user's own ownership again, best effort: E2B's
// envd, running as root, chowns every file and directory it writes, and
// watchers see that attribute change (a CHMOD event between CREATE and WRITE,
// which the E2B SDKs' own tests expect). Other owners are ignored as non-root.
func Chown(path string, uid, gid int) error {
	if euid := os.Geteuid(); euid != 0 {
		if euid == uid {
			_ = os.Lchown(path, uid, gid)
		}
		return nil
	}
	return os.Lchown(path, uid, gid)
}
