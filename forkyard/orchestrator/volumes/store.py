"""E2B volumes on one node: what they are, where they live, how big they may grow.

A volume (E2B ``Volume``: ``volumeID``, ``name``, a ``token`` for the content API) is a
sparse ext4 image ``<data_dir>/volumes/<id>/volume.img`` of
:attr:`~forkyard.config.Settings.volume_size_mb`, loop-mounted (``nosuid,nodev``) at
``<data_dir>/volumes/<id>/data``; ``volumes/`` and each ``<id>/`` are 0700. The image is
the size limit: a write beyond it fails with ENOSPC, whether it comes from the content
API or from a sandbox that mounts the volume (a bind mount of ``data``, see
:func:`forkyard.runtime.gvisor.spec.build_spec`). The root of the filesystem belongs to
uid/gid 1000 (the templates' ``user``), so the sandbox's default user can write.

Rows live in the node's SQLite database (``state.db``, table ``volumes``; its own
connection, WAL, ``synchronous=FULL``), so a restarted node keeps its volumes; it mounts
them again at start (:meth:`Volumes.mount_all`) and unmounts at stop those no running
sandbox uses (:meth:`Volumes.unmount_idle`: a volume a sandbox still has bound stays
mounted, so the next start finds it mounted instead of mounting the same ext4 image a
second time beside the sandbox's reference).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import shutil
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from forkyard.hostfs import is_mounted, run_checked, unmount
from forkyard.ids import is_name, new_volume_id
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound, OrchestratorError

log = logging.getLogger("forkyard.orchestrator.volumes")

SCHEMA = """
CREATE TABLE IF NOT EXISTS volumes (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    token TEXT NOT NULL,
    size_mb INTEGER NOT NULL,
    created_at REAL NOT NULL
);
"""
IMAGE_NAME = "volume.img"
#: uid/gid owning a new volume's root: the templates' ``user``
#: (:data:`forkyard.templates.base.USER_UID`).
OWNER_UID = 1000


class VolumeFailed(OrchestratorError):
    """The volume's image could not be made, mounted or removed (500)."""

    status = 500


@dataclass
class VolumeRecord:
    """A persisted volume. ``created_at``: UNIX seconds; ``size_mb``: MiB."""

    id: str
    name: str
    token: str
    size_mb: int
    created_at: float


def _run(argv: list[str]) -> None:
    run_checked(argv, VolumeFailed)


class Volumes:
    """The node's volumes (see module doc). Thread-safe; methods block (call them in a
    thread from async code).

    Args:
        db_path: the node's SQLite database.
        root: ``<data_dir>/volumes``.
        max_count: volumes at most (more: 400).
        size_mb: size of each new volume (MiB).
    """

    def __init__(self, db_path: Path, root: Path, max_count: int, size_mb: int):
        self.root, self.max_count, self.size_mb = root, max_count, size_mb
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(root, 0o700)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(db_path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    # ---- paths -----------------------------------------------------------------------
    def data_dir(self, volume_id: str) -> Path:
        """Host directory of the volume's files (its mounted filesystem)."""
        return self.root / volume_id / "data"

    # ---- rows ------------------------------------------------------------------------
    def all(self) -> list[VolumeRecord]:
        """Every volume, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM volumes ORDER BY created_at").fetchall()
        return [VolumeRecord(**dict(r)) for r in rows]

    def get(self, volume_id: str) -> VolumeRecord:
        """The volume with id ``volume_id``.

        Raises:
            NotFound: no such volume (E2B: 404).
        """
        with self._lock:
            row = self._db.execute("SELECT * FROM volumes WHERE id = ?", (volume_id,)).fetchone()
        if row is None:
            raise NotFound(f"volume {volume_id!r} not found")
        return VolumeRecord(**dict(row))

    def by_name(self, name: str) -> VolumeRecord:
        """The volume named ``name`` (how ``volumeMounts`` names them).

        Raises:
            NotFound: no such volume.
        """
        with self._lock:
            row = self._db.execute("SELECT * FROM volumes WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(f"volume {name!r} not found")
        return VolumeRecord(**dict(row))

    def check_token(self, volume_id: str, token: str) -> bool:
        """True when ``token`` is the content-API token of ``volume_id`` (constant time);
        False for an unknown volume too (no way to tell which from outside)."""
        try:
            rec = self.get(volume_id)
        except NotFound:
            return False
        return bool(token) and hmac.compare_digest(token.encode(), rec.token.encode())

    # ---- life --------------------------------------------------------------------------
    def create(self, name: str) -> VolumeRecord:
        """Make volume ``name``: its image (sparse, ``size_mb``), ext4, mounted.

        Raises:
            BadRequest: ``name`` is not a :func:`forkyard.ids.is_name`, or the node holds
                ``max_count`` volumes already.
            Conflict: a volume of that name exists (409).
            VolumeFailed: mkfs or mount failed (nothing is left behind).
        """
        if not is_name(name):
            raise BadRequest(f"invalid volume name {name!r}: 1-64 of a-z, 0-9, '_' and '-', "
                             "starting with a letter or digit")
        rec = VolumeRecord(id=new_volume_id(), name=name, token=secrets.token_urlsafe(32),
                           size_mb=self.size_mb, created_at=time.time())
        with self._lock:
            if self._db.execute("SELECT 1 FROM volumes WHERE name = ?", (name,)).fetchone():
                raise Conflict(f"volume {name!r} already exists")
            (count,) = self._db.execute("SELECT COUNT(*) FROM volumes").fetchone()
            if count >= self.max_count:
                raise BadRequest(f"this node holds {count} volumes, its limit (FORKYARD_MAX_VOLUMES)")
            vdir = self.root / rec.id
            try:
                vdir.mkdir(mode=0o700)
                self._make(vdir, rec.size_mb)
                self._db.execute("INSERT INTO volumes VALUES (:id, :name, :token, :size_mb, :created_at)",
                                 rec.__dict__)
            except BaseException:
                self._remove(vdir)
                raise
        return rec

    @staticmethod
    def _make(vdir: Path, size_mb: int) -> None:
        image = vdir / IMAGE_NAME
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size_mb << 20)
        finally:
            os.close(fd)
        # A journal: a volume holds data a user keeps, and a host crash must not cost it.
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E",
              f"root_owner={OWNER_UID}:{OWNER_UID},lazy_itable_init=1,nodiscard", str(image)])
        (vdir / "data").mkdir(mode=0o700)
        Volumes._mount(vdir)

    @staticmethod
    def _mount(vdir: Path) -> None:
        if not is_mounted(vdir / "data"):
            _run(["mount", "-o", "loop,nosuid,nodev", str(vdir / IMAGE_NAME), str(vdir / "data")])

    @staticmethod
    def _unmount(vdir: Path) -> None:
        if is_mounted(vdir / "data"):
            unmount(vdir / "data")

    def _remove(self, vdir: Path) -> None:
        self._unmount(vdir)
        shutil.rmtree(vdir, ignore_errors=True)

    def destroy(self, volume_id: str, in_use: bool) -> None:
        """Remove volume ``volume_id`` and its files.

        Args:
            in_use: a sandbox (running or paused) mounts it.

        Raises:
            NotFound: no such volume.
            Conflict: ``in_use`` (kill those sandboxes first; a paused one would not
                resume without it).
        """
        rec = self.get(volume_id)
        if in_use:
            raise Conflict(f"volume {rec.name!r} is mounted by a sandbox; kill it first")
        with self._lock:
            self._db.execute("DELETE FROM volumes WHERE id = ?", (volume_id,))
        self._remove(self.root / volume_id)

    def mount_all(self) -> None:
        """Mount every volume not mounted (node start). A volume that fails is logged and
        left unmounted (its sandboxes then fail to start with a clear error)."""
        for rec in self.all():
            try:
                self._mount(self.root / rec.id)
            except VolumeFailed as e:
                log.error("volume %s (%s) could not be mounted: %s", rec.id, rec.name, e)

    def unmount_idle(self, used: set[str]) -> None:
        """Unmount every volume whose id is not in ``used`` (node stop)."""
        for rec in self.all():
            if rec.id not in used:
                self._unmount(self.root / rec.id)

    def ensure_mounted(self, rec: VolumeRecord) -> Path:
        """The data directory of ``rec``, mounted (a sandbox is about to bind it).

        Raises:
            VolumeFailed: it could not be mounted.
        """
        self._mount(self.root / rec.id)
        return self.data_dir(rec.id)


#: Guest paths a volume may not cover: what the sandbox's own mounts and envd need.
_RESERVED = ("/proc", "/dev", "/sys", "/etc/hosts", "/etc/hostname", "/usr/local/bin/envd", "/etc", "/usr",
             "/bin", "/sbin", "/lib", "/lib64", "/var/run", "/run")


def check_mount_path(path: object, rootfs: Path | None = None) -> str:
    """``path`` when it is a valid guest mount path: absolute, at most 1024 characters,
    no empty, ``.`` or ``..`` component, not ``/`` and not (below) a system directory
    (``/proc``, ``/dev``, ``/sys``, ``/etc``, ``/usr``, ``/bin``, ``/lib``, ``/run``…),
    and, given the template's ``rootfs``, a directory there reached through no symbolic
    link. (runsc's gofer bind-mounts a volume onto the template's read-only rootfs
    before the sandbox's writable layer exists, so it cannot make a missing mount point:
    forkyard mounts only onto directories the template has, e.g. ``/mnt``, ``/opt``,
    ``/srv``, ``/media`` of ``base``; E2B makes the path.)

    Raises:
        BadRequest: it is not.
    """
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 1024 or "\0" in path:
        raise BadRequest(f"volume mount path {path!r} must be an absolute path (at most 1024 characters)")
    parts = path.rstrip("/").split("/")[1:]
    if not parts or any(p in ("", ".", "..") for p in parts):
        raise BadRequest(f"volume mount path {path!r} must be a normalized path below / (no '.', '..' or '//')")
    norm = "/" + "/".join(parts)
    for r in _RESERVED:
        if norm == r or norm.startswith(r + "/"):
            raise BadRequest(f"volume mount path {path!r} would cover {r}, which the sandbox needs")
    if rootfs is not None:
        at = rootfs
        for p in parts:
            at = at / p
            if at.is_symlink() or not at.is_dir():
                raise BadRequest(f"volume mount path {path!r} must be a directory of the template (forkyard "
                                 "cannot make a mount point in the template's read-only root; use e.g. /mnt, "
                                 "/opt, /srv or /media of base)")
    return norm
