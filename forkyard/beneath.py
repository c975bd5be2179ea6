"""File operations that cannot leave a root directory, whatever links it holds.

Used to lay image layers and the import fix-ups into a template's rootfs as root
(issue 25, item 2: a layer's ``..`` symlink, a directory later replaced by a link, and
dangling absolute links once made those writes, chmods and deletes land on host files).

Every path is resolved by the kernel with ``openat2(2)`` and ``RESOLVE_IN_ROOT`` (links
and ``..`` resolved as if the rootfs were ``/``, as in a container: an image's
``/lib -> usr/lib`` keeps working, ``/etc -> /host/path`` means the rootfs's own
``host/path``), ``RESOLVE_NO_MAGICLINKS`` (no ``/proc/*/fd`` jumps) and
``RESOLVE_NO_XDEV`` (no crossing into a mount below the root). The last component is
never followed: it is created, changed and removed through the descriptor of its
parent directory (``mkdirat``, ``openat(O_NOFOLLOW|O_EXCL)``, ``fchmod``/``fchown`` on
the opened file, ``fchownat(AT_SYMLINK_NOFOLLOW)``, ``unlinkat``, fd-based ``rmtree``).
openat2 needs Linux ≥ 5.6 (these machines run 6.18).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Iterator

#: openat2(2) is syscall 437 on every Linux architecture (the unified syscall table).
_SYS_OPENAT2 = 437
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_IN_ROOT = 0x10
_RESOLVE = RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV
_O_PATH = getattr(os, "O_PATH", 0o10000000)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def openat2(dirfd: int, path: str, flags: int, mode: int = 0, resolve: int = _RESOLVE) -> int:
    """``openat2(dirfd, path, {flags, mode, resolve})``: a new descriptor.

    Raises:
        OSError: the kernel's error (ENOENT, ENOTDIR, ELOOP, EXDEV, …; EAGAIN is
            retried: the kernel returns it when a rename raced the resolution).
    """
    how = _OpenHow(flags | os.O_CLOEXEC, mode, resolve)
    raw = os.fsencode(path)
    for _ in range(16):
        fd = _libc.syscall(_SYS_OPENAT2, ctypes.c_int(dirfd), ctypes.c_char_p(raw), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.EAGAIN:
            raise OSError(err, os.strerror(err), path)
    raise OSError(errno.EAGAIN, "path resolution kept racing a rename", path)


class EscapeError(ValueError):
    """A path names the root itself or leads above it (``..``)."""


def split(rel: str) -> tuple[str, str]:
    """``(parent, name)`` of a path inside the root (leading ``/`` and ``./`` ignored).

    Raises:
        EscapeError: the path is the root itself, or has a ``..`` that leads above it.
    """
    parts: list[str] = []
    for p in rel.split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if not parts:
                raise EscapeError(f"{rel!r} leads outside the root")
            parts.pop()
            continue
        parts.append(p)
    if not parts:
        raise EscapeError(f"{rel!r} is the root itself")
    return "/".join(parts[:-1]), parts[-1]


class Root:
    """A directory opened as a root; every method's ``rel`` is a path inside it.

    Use as a context manager (closes the descriptor). Methods raise OSError from the
    kernel (ENOTDIR: a parent is not a directory; ENOENT: a parent is a dangling link)
    and :class:`EscapeError` for paths that name the root or lead above it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)

    def close(self) -> None:
        """Close the root's descriptor."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- resolution ------------------------------------------------------------------
    def open(self, rel: str, flags: int = os.O_RDONLY, mode: int = 0) -> int:
        """A descriptor for ``rel`` resolved inside the root, last component followed
        (inside the root) unless ``flags`` has ``O_NOFOLLOW``."""
        return openat2(self.fd, rel.lstrip("/") or ".", flags, mode)

    def dir_fd(self, rel: str, create: bool = False) -> int:
        """An ``O_PATH`` descriptor of directory ``rel`` (``""``: the root); with
        ``create``, missing directories are made (0755) first."""
        try:
            return self.open(rel, _O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                raise
        self.makedirs(rel)
        return self.open(rel, _O_PATH | os.O_DIRECTORY)

    def makedirs(self, rel: str, mode: int = 0o755) -> None:
        """``mkdir -p rel`` inside the root; each directory made gets ``mode`` whatever
        the umask. Existing ones (or links to directories inside the root) are kept."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        for i in range(len(parts)):
            prefix = "/".join(parts[: i + 1])
            try:
                os.close(self.open(prefix, _O_PATH | os.O_DIRECTORY))
                continue
            except FileNotFoundError:
                pass
            parent, name = split(prefix)
            pfd = self.open(parent, _O_PATH | os.O_DIRECTORY)
            try:
                try:
                    os.mkdir(name, 0o700, dir_fd=pfd)
                except FileExistsError:  # a dangling link (or a race): resolve it again below
                    pass
                else:
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
                    try:
                        os.fchmod(fd, mode)
                    finally:
                        os.close(fd)
            finally:
                os.close(pfd)
            os.close(self.open(prefix, _O_PATH | os.O_DIRECTORY))  # ENOENT: a dangling link stays one

    def parent(self, rel: str, create: bool = False) -> tuple[int, str]:
        """``(O_PATH descriptor of rel's directory, rel's last component)``; the caller
        closes the descriptor."""
        parent, name = split(rel)
        return self.dir_fd(parent, create), name

    # ---- leaf operations (never follow the last component) ----------------------------
    @staticmethod
    def lstat(dfd: int, name: str) -> os.stat_result | None:
        """``lstat`` of ``name`` in ``dfd``, None when absent."""
        try:
            return os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None

    @staticmethod
    def remove(dfd: int, name: str) -> None:
        """Remove ``name`` in ``dfd`` (a directory with everything in it; a link, not
        what it points to). Absent: nothing to do."""
        st = Root.lstat(dfd, name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dfd)  # fd-based: never follows links below
        else:
            os.unlink(name, dir_fd=dfd)

    @staticmethod
    def children(dfd: int, name: str) -> list[str]:
        """Names in directory ``name`` of ``dfd`` (``name`` not followed; none when it is
        absent, a link or not a directory)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return []
            raise
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    @staticmethod
    def create_file(dfd: int, name: str) -> int:
        """A new regular file ``name`` in ``dfd`` (whatever was there removed first),
        open for writing, mode 0600 until the caller sets it with ``fchmod``."""
        Root.remove(dfd, name)
        return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                       dir_fd=dfd)

    @staticmethod
    def set_owner_mode(fd: int, uid: int, gid: int, mode: int) -> None:
        """Owner then mode (chown clears set-id bits) of an open file."""
        os.fchown(fd, uid, gid)
        os.fchmod(fd, stat.S_IMODE(mode))

    @staticmethod
    def open_dir_nofollow(dfd: int, name: str) -> int:
        """A read descriptor of directory ``name`` in ``dfd``; OSError (ELOOP, ENOTDIR)
        when it is a link or not a directory."""
        return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)

    @staticmethod
    def write_file(dfd: int, name: str, data: bytes, mode: int = 0o644) -> None:
        """Replace ``name`` in ``dfd`` with a root-owned regular file holding ``data``."""
        fd = Root.create_file(dfd, name)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
