"""The E2B volume content API's file operations, confined to one volume's root.

Every path is resolved by the kernel beneath the volume's data directory
(:class:`forkyard.beneath.Root`: ``openat2`` with ``RESOLVE_IN_ROOT``, no magic
links, no crossing into another mount): ``..`` stops at the root and a link a sandbox
made (``ln -s / x``, ``ln -s ../../.. y``) resolves as if the volume were ``/``, never
to the host. The last component is never followed when it is stat'ed, changed or
removed. Blocking calls: run them in a thread.

Entries are E2B's ``VolumeEntryStat`` (e2b 2.63 ``volume/client/models``): ``name``,
``type`` (``file``/``directory``/``symlink``/``unknown``), ``path`` (from the volume
root, leading ``/``), ``size`` (bytes), ``mode`` (permission bits), ``uid``, ``gid``,
``atime``/``mtime``/``ctime`` (RFC 3339), ``target`` (links only).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from forkyard.ids import rfc3339
from forkyard.orchestrator.errors import BadRequest, NotFound, OrchestratorError
from forkyard.beneath import EscapeError, Root
from forkyard.orchestrator.volumes.store import OWNER_UID

#: ``depth`` of a listing at most, and entries one listing returns at most.
MAX_DEPTH = 16
MAX_ENTRIES = 100_000
CHUNK = 1 << 20


class VolumeFull(OrchestratorError):
    """The volume has no room left (507)."""

    status = 507


def _norm(path: str) -> str:
    """``/a/b`` form of ``path`` inside the volume (``..`` clamped at the root)."""
    parts: list[str] = []
    for p in (path or "").split("/"):
        if p in ("", "."):
            continue
        if p == "..":
            if parts:
                parts.pop()
            continue
        parts.append(p)
    return "/" + "/".join(parts)


def _errors(e: OSError, path: str) -> OrchestratorError:
    if e.errno == errno.ENOENT:
        return NotFound(f"path {path!r} not found in the volume")
    if e.errno == errno.ENOSPC or e.errno == errno.EDQUOT:
        return VolumeFull(f"the volume is full writing {path!r}")
    return BadRequest(f"{path!r}: {os.strerror(e.errno or 0) or e}")


def _entry(st: os.stat_result, path: str, target: str | None = None) -> dict:
    if stat.S_ISDIR(st.st_mode):
        kind = "directory"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    else:
        kind = "unknown"
    out = {"name": path.rsplit("/", 1)[-1] or "/", "type": kind, "path": path, "size": st.st_size,
           "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "gid": st.st_gid,
           "atime": rfc3339(st.st_atime), "mtime": rfc3339(st.st_mtime), "ctime": rfc3339(st.st_ctime)}
    if target is not None:
        out["target"] = target
    return out


class VolumeFiles:
    """File operations beneath ``root`` (a volume's mounted data directory). Every
    method raises NotFound (404), BadRequest (400) or :class:`VolumeFull` (507)."""

    def __init__(self, root: Path):
        self.root = root

    def _leaf(self, r: Root, path: str, create: bool = False) -> tuple[int, str]:
        try:
            return r.parent(path, create)
        except EscapeError:
            raise BadRequest(f"{path!r} is the volume's root") from None

    @contextmanager
    def _at(self, path: str):
        """For a with-block: ``(directory fd, leaf name)`` of the normalised ``path``
        inside the volume (the fd closed after); an ``OSError`` in the block becomes the
        API's error (:func:`_errors`)."""
        try:
            with Root(self.root) as r:
                dfd, name = self._leaf(r, path)
                try:
                    yield dfd, name
                finally:
                    os.close(dfd)
        except OSError as e:
            raise _errors(e, path) from None

    def stat(self, path: str) -> dict:
        """The entry at ``path`` (``/``: the root)."""
        path = _norm(path)
        try:
            with Root(self.root) as r:
                if path == "/":
                    return _entry(os.fstat(r.fd), "/")
                dfd, name = self._leaf(r, path)
                try:
                    return self._stat_at(dfd, name, path)
                finally:
                    os.close(dfd)
        except OSError as e:
            raise _errors(e, path) from None

    @staticmethod
    def _stat_at(dfd: int, name: str, path: str) -> dict:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=dfd) if stat.S_ISLNK(st.st_mode) else None
        return _entry(st, path, target)

    def list(self, path: str, depth: int = 1) -> list[dict]:
        """Entries below directory ``path``, ``depth`` levels (1…:data:`MAX_DEPTH`)."""
        path = _norm(path)
        if not 1 <= depth <= MAX_DEPTH:
            raise BadRequest(f"depth must be between 1 and {MAX_DEPTH}")
        out: list[dict] = []
        try:
            with Root(self.root) as r:
                fd = r.open(path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    self._walk(fd, path.rstrip("/"), depth, out)
                finally:
                    os.close(fd)
        except OSError as e:
            raise _errors(e, path) from None
        return out

    def _walk(self, fd: int, prefix: str, depth: int, out: list[dict]) -> None:
        for name in sorted(os.listdir(fd)):
            if len(out) >= MAX_ENTRIES:
                raise BadRequest(f"more than {MAX_ENTRIES} entries; list a smaller depth or directory")
            entry = self._stat_at(fd, name, f"{prefix}/{name}")
            out.append(entry)
            if depth > 1 and entry["type"] == "directory":
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                try:
                    self._walk(sub, entry["path"], depth - 1, out)
                finally:
                    os.close(sub)

    def make_dir(self, path: str, uid: int | None, gid: int | None, mode: int | None, force: bool) -> dict:
        """Make directory ``path`` (``force``: its parents too, as ``mkdir -p``)."""
        path = _norm(path)
        try:
            with Root(self.root) as r:
                dfd, name = self._leaf(r, path, create=force)
                try:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
                    try:
                        Root.set_owner_mode(fd, OWNER_UID if uid is None else uid, OWNER_UID if gid is None else gid,
                                            0o755 if mode is None else mode)
                    finally:
                        os.close(fd)
                    return self._stat_at(dfd, name, path)
                finally:
                    os.close(dfd)
        except OSError as e:
            raise _errors(e, path) from None

    def write(self, path: str, chunks: Iterator[bytes], uid: int | None, gid: int | None, mode: int | None,
              force: bool) -> dict:
        """Replace file ``path`` with the bytes of ``chunks`` (``force``: make missing
        parent directories). Written under a temporary name and renamed, so a reader
        never sees half a file and a failed write leaves the old one."""
        path = _norm(path)
        try:
            with Root(self.root) as r:
                dfd, name = self._leaf(r, path, create=force)
                tmp = f".{name}.fy-upload"
                try:
                    fd = Root.create_file(dfd, tmp)
                    try:
                        for chunk in chunks:
                            view = memoryview(chunk)
                            while view:
                                view = view[os.write(fd, view):]
                        Root.set_owner_mode(fd, OWNER_UID if uid is None else uid, OWNER_UID if gid is None else gid,
                                            0o644 if mode is None else mode)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    old = Root.lstat(dfd, name)
                    if old is not None and stat.S_ISDIR(old.st_mode):
                        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
                    os.rename(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    return self._stat_at(dfd, name, path)
                except BaseException:
                    Root.remove(dfd, tmp)
                    raise
                finally:
                    os.close(dfd)
        except OSError as e:
            raise _errors(e, path) from None

    def open_read(self, path: str) -> int:
        """A read descriptor of file ``path`` (links followed inside the volume)."""
        path = _norm(path)
        try:
            with Root(self.root) as r:
                fd = r.open(path, os.O_RDONLY)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise BadRequest(f"{path!r} is not a file")
            return fd
        except OSError as e:
            raise _errors(e, path) from None

    def update(self, path: str, uid: int | None, gid: int | None, mode: int | None) -> dict:
        """Change the owner and/or mode of ``path`` (a link itself: owner only)."""
        path = _norm(path)
        with self._at(path) as (dfd, name):
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            if uid is not None or gid is not None:
                os.chown(name, -1 if uid is None else uid, -1 if gid is None else gid, dir_fd=dfd,
                         follow_symlinks=False)
            if mode is not None and not stat.S_ISLNK(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dfd)
                try:
                    os.fchmod(fd, stat.S_IMODE(mode))
                finally:
                    os.close(fd)
            return self._stat_at(dfd, name, path)

    def remove(self, path: str) -> None:
        """Remove ``path`` (a directory with all it holds; a link, not its target)."""
        path = _norm(path)
        with self._at(path) as (dfd, name):
            if Root.lstat(dfd, name) is None:
                raise FileNotFoundError(errno.ENOENT, "not found", path)
            Root.remove(dfd, name)

