"""E2B volumes: what they are, where they live, how big they may grow, who mounts them.

A volume (E2B ``Volume``: ``volumeID``, ``name``, a ``token`` for the content API) is a
directory ``<root>/<id>/`` holding a sparse ext4 image ``volume.img`` of
:attr:`~forkyard.config.Settings.volume_size_mb` and its row ``volume.json`` (``id``,
``name``, ``token``, ``size_mb``, ``created_at``); ``<root>/names/<name>`` holds the id of
the volume of that name (made with ``O_EXCL``: two nodes creating one name at once get
one volume and one 409). ``<root>`` is :attr:`~forkyard.config.Settings.volumes_root`:
``<data_dir>/volumes`` on a single node, one directory shared by every node of a
cluster (``FORKYARD_VOLUMES_DIR``), so every node sees every volume. ``<root>``, each
``<id>/`` and the files are 0700/0600 (the row holds the token).

A node loop-mounts an image (``nosuid,nodev``) at ``<data_dir>/volumes/<id>/data`` and
sandboxes bind-mount that directory (:func:`forkyard.runtime.gvisor.spec.build_spec`).
The image is the size limit: a write beyond it fails with ENOSPC, whether it comes from
the content API or from a sandbox. The root of the filesystem belongs to uid/gid 1000
(the templates' ``user``), so the sandbox's default user can write.

**One node at a time.** An ext4 image must never be mounted by two hosts at once (each
would overwrite the other's metadata). With :attr:`Volumes.leases` set (a cluster node:
:mod:`forkyard.cluster.volumes`), a node mounts an image only after the cluster granted it
the volume's lease, asked again before every mount and every sandbox start; it gives the
lease back only after unmounting (:meth:`Volumes.release_idle`: no sandbox of the node,
running or paused, mounts it and no content call used it for
:attr:`~forkyard.config.Settings.volume_idle_s`). Without leases (a single node) every
volume is mounted at start (:meth:`Volumes.mount_all`) and the stop unmounts those no
running sandbox uses (:meth:`Volumes.unmount_idle`: a volume a sandbox still has bound
stays mounted, so the next start finds it mounted instead of mounting the same ext4
image a second time beside the sandbox's reference).
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import secrets
import shutil
import sqlite3
import stat
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from forkyard.hostfs import is_mounted, run_checked, unmount
from forkyard.ids import is_name, new_volume_id
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound, OrchestratorError

log = logging.getLogger("forkyard.orchestrator.volumes")

IMAGE_NAME = "volume.img"
ROW_NAME = "volume.json"
NAMES = "names"
#: A ``names/<name>`` file whose volume has no row yet is a create in progress; older
#: than this (s) it was left by a node that died mid-create, and the name is free again.
STALE_NAME_S = 600.0
#: uid/gid owning a new volume's root: the templates' ``user``
#: (:data:`forkyard.templates.base.USER_UID`).
OWNER_UID = 1000
#: The header of a 409 :class:`VolumeHeld` answer: the node that holds the volume (the
#: gateway places the create again, on that node).
HOLDER_HEADER = "x-forkyard-volume-holder"
#: Largest ``volume.json`` read (bytes): a row is five short fields.
_MAX_ROW = 64 << 10


class VolumeFailed(OrchestratorError):
    """The volume's image could not be made, mounted or removed (500)."""

    status = 500


class LeaseUnavailable(OrchestratorError):
    """The cluster could not be asked for a volume's lease (503: retry)."""

    status = 503


class VolumeHeld(Conflict):
    """Another node holds the volume's lease, i.e. mounts it (409; :data:`HOLDER_HEADER`
    names that node)."""

    def __init__(self, message: str, holder: str):
        super().__init__(message)
        self.holder = holder
        self.headers = {HOLDER_HEADER: holder}


class Leases(Protocol):
    """The cluster's volume leases as a node sees them (:mod:`forkyard.cluster.volumes`).
    Blocking calls."""

    def acquire(self, volume_id: str, name: str) -> str | None:
        """Take (or keep) the lease of ``volume_id`` for this node. Returns None when
        granted, else the id of the node that holds it.

        Raises:
            LeaseUnavailable: the cluster could not be asked.
        """

    def release(self, volume_id: str) -> None:
        """Give the lease back (nothing when this node does not hold it).

        Raises:
            LeaseUnavailable: the cluster could not be told (the lease stays).
        """


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


def _read_small(path: Path, limit: int) -> bytes:
    """At most ``limit`` bytes of regular file ``path`` (a file of the shared directory:
    another node wrote it, so a link, a FIFO or a huge file is refused, never waited on
    or read whole).

    Raises:
        OSError: absent, a link (ELOOP), or not a regular file (EINVAL).
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        return os.read(fd, limit)
    finally:
        os.close(fd)


def _write_private(path: Path, data: str) -> None:
    """Write ``path`` (0600) whole or not at all: a temporary file, fsync'ed, renamed."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, data.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Volumes:
    """The volumes a node sees (see module doc). Thread-safe; methods block (call them
    in a thread from async code).

    Args:
        root: where images and rows live (:attr:`~forkyard.config.Settings.volumes_root`).
        mounts: where this node mounts them (:attr:`~forkyard.config.Settings.volumes_dir`).
        max_count: volumes at most in ``root`` (more: 400).
        size_mb: size of each new volume (MiB).
        legacy_db: a node database whose ``volumes`` table (rows of an older forkyard)
            is copied into ``root`` once, for the images that are there.

    Attributes:
        leases: the cluster's leases (None: a single node, no leases); set before start.
    """

    def __init__(self, root: Path, mounts: Path, max_count: int, size_mb: int, legacy_db: Path | None = None):
        self.root, self.mounts, self.max_count, self.size_mb = root, mounts, max_count, size_mb
        for d in (root, mounts, root / NAMES):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(d, 0o700)
        self.leases: Leases | None = None
        self._lock = threading.Lock()
        self._vlocks: dict[str, threading.Lock] = {}
        #: volume id -> when a start or content call last mounted it (monotonic s)
        self._touched: dict[str, float] = {}
        #: the ids whose lease this node took and has not given back
        self._leased: set[str] = set()
        if legacy_db is not None and legacy_db.exists():
            self._import_legacy(legacy_db)

    def close(self) -> None:
        """Nothing to close (rows are files); kept for the orchestrator's stop."""

    def _import_legacy(self, db_path: Path) -> None:
        try:
            db = sqlite3.connect(str(db_path))
            try:
                rows = db.execute("SELECT id, name, token, size_mb, created_at FROM volumes").fetchall()
            finally:
                db.close()
        except sqlite3.Error:
            return  # no such table: nothing to import
        for vid, name, token, size_mb, created_at in rows:
            vdir = self.root / vid
            if is_name(vid) and is_name(name) and (vdir / IMAGE_NAME).exists() and not (vdir / ROW_NAME).exists():
                rec = VolumeRecord(vid, name, token, size_mb, created_at)
                _write_private(vdir / ROW_NAME, json.dumps(asdict(rec)))
                _write_private(self.root / NAMES / name, vid)
                log.info("volume %s (%s): row imported from %s", vid, name, db_path)

    def _vlock(self, volume_id: str) -> threading.Lock:
        with self._lock:
            return self._vlocks.setdefault(volume_id, threading.Lock())

    # ---- paths -----------------------------------------------------------------------
    def data_dir(self, volume_id: str) -> Path:
        """Host directory of the volume's files (its mounted filesystem) on this node.

        Raises:
            ValueError: ``volume_id`` is not a name (it would lead out of ``mounts``).
        """
        if not is_name(volume_id) or volume_id == NAMES:
            raise ValueError(f"volume id {volume_id!r} is not a name")
        return self.mounts / volume_id / "data"

    # ---- rows ------------------------------------------------------------------------
    def _row(self, volume_id: str) -> VolumeRecord | None:
        if not is_name(volume_id) or volume_id == NAMES or os.path.islink(self.root / volume_id):
            return None
        try:
            d = json.loads(_read_small(self.root / volume_id / ROW_NAME, _MAX_ROW))
        except (OSError, ValueError):
            return None
        # The row is data from the shared directory (any node, or an older forkyard,
        # wrote it): its id builds host paths (data_dir, the image), so it must be the
        # directory it lies in, and every field has its type, or the row is skipped.
        if (not isinstance(d, dict) or d.get("id") != volume_id or not is_name(d.get("name"))
                or not isinstance(d.get("token"), str) or not d["token"]
                or type(d.get("size_mb")) is not int or type(d.get("created_at")) not in (int, float)):
            log.warning("volume %s: its row %s is malformed: skipped", volume_id, ROW_NAME)
            return None
        return VolumeRecord(**{k: d[k] for k in ("id", "name", "token", "size_mb", "created_at")})

    def all(self) -> list[VolumeRecord]:
        """Every volume, oldest first."""
        try:
            names = os.listdir(self.root)
        except OSError as e:
            raise VolumeFailed(f"volumes directory {self.root} cannot be read: {e}") from e
        rows = [r for r in (self._row(n) for n in names if n != NAMES) if r is not None]
        return sorted(rows, key=lambda r: (r.created_at, r.id))

    def get(self, volume_id: str) -> VolumeRecord:
        """The volume with id ``volume_id``.

        Raises:
            NotFound: no such volume (E2B: 404).
        """
        rec = self._row(volume_id)
        if rec is None:
            raise NotFound(f"volume {volume_id!r} not found")
        return rec

    def by_name(self, name: str) -> VolumeRecord:
        """The volume named ``name`` (how ``volumeMounts`` names them).

        Raises:
            NotFound: no such volume.
        """
        vid = None
        if is_name(name):
            try:
                vid = _read_small(self.root / NAMES / name, 256).decode("utf-8", "replace").strip()
            except OSError:
                pass
        rec = self._row(vid) if vid else None
        if rec is None or rec.name != name:
            raise NotFound(f"volume {name!r} not found")
        return rec

    def check_token(self, volume_id: str, token: str) -> bool:
        """True when ``token`` is the content-API token of ``volume_id`` (constant time);
        False for an unknown volume too (no way to tell which from outside)."""
        rec = self._row(volume_id)
        return rec is not None and bool(token) and hmac.compare_digest(token.encode(), rec.token.encode())

    # ---- life --------------------------------------------------------------------------
    def _claim_name(self, name: str, volume_id: str) -> None:
        """Make ``names/<name>`` hold ``volume_id`` (``O_EXCL``: atomic on a shared
        directory too); a stale claim (:data:`STALE_NAME_S`) is taken over.

        Raises:
            Conflict: the name is taken.
        """
        path = self.root / NAMES / name
        for _ in range(2):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                try:
                    other = _read_small(path, 256).decode("utf-8", "replace").strip()
                    age = time.time() - path.stat().st_mtime
                except OSError:
                    continue  # removed meanwhile: try again
                if self._row(other) is None and age > STALE_NAME_S:
                    log.warning("volume name %r: claim by %s without a row (a create died): taken over", name, other)
                    path.unlink(missing_ok=True)
                    continue
                raise Conflict(f"volume {name!r} already exists") from None
            try:
                os.write(fd, volume_id.encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return
        raise Conflict(f"volume {name!r} already exists")

    def create(self, name: str) -> VolumeRecord:
        """Make volume ``name``: its image (sparse, ``size_mb``), ext4, and its row; on a
        single node it is mounted too (with leases it is mounted where it is used).

        Raises:
            BadRequest: ``name`` is not a :func:`forkyard.ids.is_name`, or ``root``
                holds ``max_count`` volumes already.
            Conflict: a volume of that name exists (409).
            VolumeFailed: mkfs or mount failed (nothing is left behind).
        """
        if not is_name(name):
            raise BadRequest(f"invalid volume name {name!r}: 1-64 of a-z, 0-9, '_' and '-', "
                             "starting with a letter or digit")
        rec = VolumeRecord(id=new_volume_id(), name=name, token=secrets.token_urlsafe(32),
                           size_mb=self.size_mb, created_at=time.time())
        with self._lock:
            count = len(self.all())
            if count >= self.max_count:
                raise BadRequest(f"{count} volumes exist, the limit (FORKYARD_MAX_VOLUMES)")
            self._claim_name(name, rec.id)
            vdir = self.root / rec.id
            try:
                vdir.mkdir(mode=0o700)
                self._make(vdir, rec.size_mb)
                _write_private(vdir / ROW_NAME, json.dumps(asdict(rec)))
                if self.leases is None:
                    self._mount(rec.id)
            except BaseException:
                self._unmount(rec.id)
                shutil.rmtree(vdir, ignore_errors=True)
                (self.root / NAMES / name).unlink(missing_ok=True)
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

    def _image(self, volume_id: str) -> Path:
        """``<root>/<id>/volume.img``, checked: the shared directory is written by every
        node, and a link there (at ``<id>`` or at the image) would make this node
        loop-mount a host file or disk of its own and bind it into a sandbox.

        Raises:
            VolumeFailed: ``<id>`` is not a directory or the image not a regular file
                (a link is neither), or it resolves outside ``root``.
        """
        vdir, image = self.root / volume_id, self.root / volume_id / IMAGE_NAME
        try:
            dst, ist = os.lstat(vdir), os.lstat(image)
        except OSError as e:
            raise VolumeFailed(f"volume {volume_id}: its image cannot be read: {e}") from e
        if (not stat.S_ISDIR(dst.st_mode) or not stat.S_ISREG(ist.st_mode)
                or os.path.realpath(image) != os.path.join(os.path.realpath(self.root), volume_id, IMAGE_NAME)):
            raise VolumeFailed(f"volume {volume_id}: {image} is not a regular file in its own directory "
                               "(a link?): not mounted")
        return image

    def _mount(self, volume_id: str) -> None:
        data = self.data_dir(volume_id)
        if not is_mounted(data):
            image = self._image(volume_id)
            data.parent.mkdir(mode=0o700, exist_ok=True)
            data.mkdir(mode=0o700, exist_ok=True)
            _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(data)])

    def _unmount(self, volume_id: str) -> None:
        """Unmount on this node (busy: lazily, on a single node only)."""
        data = self.data_dir(volume_id)
        if not is_mounted(data):
            return
        if self.leases is None:
            unmount(data)
            return
        # With leases a lazy unmount would leave the filesystem live while the lease goes
        # to another node: unmounted for good, or the lease is kept.
        proc = subprocess.run(["umount", str(data)], capture_output=True, text=True)
        if proc.returncode != 0 and is_mounted(data):
            raise VolumeFailed(f"volume {volume_id} cannot be unmounted ({proc.stderr.strip()}): its lease is kept")

    def destroy(self, volume_id: str, in_use: bool) -> None:
        """Remove volume ``volume_id`` and its files.

        Args:
            in_use: a sandbox of this node (running or paused) mounts it.

        Raises:
            NotFound: no such volume.
            Conflict: ``in_use`` (kill those sandboxes first; a paused one would not
                resume without it); :class:`VolumeHeld`: another node mounts it.
            LeaseUnavailable: the cluster could not be asked.
        """
        rec = self.get(volume_id)
        if in_use:
            raise Conflict(f"volume {rec.name!r} is mounted by a sandbox; kill it first")
        with self._vlock(volume_id):
            if self.leases is not None:
                self._take(rec)  # nobody else mounts it while it goes
            self._unmount(volume_id)
            (self.root / volume_id / ROW_NAME).unlink(missing_ok=True)  # gone from here on
            shutil.rmtree(self.root / volume_id, ignore_errors=True)
            shutil.rmtree(self.mounts / volume_id, ignore_errors=True)
            names = self.root / NAMES / rec.name
            try:
                if _read_small(names, 256).decode("utf-8", "replace").strip() == volume_id:
                    names.unlink()
            except OSError:
                pass
            if self.leases is not None:
                self._give_back(volume_id)

    # ---- mounts and leases -----------------------------------------------------------
    def _take(self, rec: VolumeRecord, wait_s: float = 0.0) -> None:
        """Take ``rec``'s lease for this node, waiting up to ``wait_s`` for its holder
        to give it back.

        Raises:
            VolumeHeld: another node holds it; LeaseUnavailable.
        """
        deadline = time.monotonic() + wait_s
        # Counted before asking: a grant whose answer was lost is given back once idle.
        self._leased.add(rec.id)
        while True:
            holder = self.leases.acquire(rec.id, rec.name)
            if holder is None:
                return
            if time.monotonic() >= deadline:
                raise VolumeHeld(f"volume {rec.name!r} is mounted on node {holder}: a sandbox mounting it runs "
                                 "there (or its content was used there lately); an ext4 volume is mounted on one "
                                 "node at a time", holder)
            time.sleep(0.25)

    def _give_back(self, volume_id: str) -> None:
        try:
            self.leases.release(volume_id)
        except LeaseUnavailable as e:
            log.warning("volume %s: lease not given back yet (retried): %s", volume_id, e)
            return
        self._leased.discard(volume_id)

    def ensure_mounted(self, rec: VolumeRecord, wait_s: float = 0.0) -> Path:
        """The data directory of ``rec``, mounted on this node (a sandbox is about to
        bind it, or a content call to use it); with leases, only once the cluster has
        granted this node the lease (asked every time), waiting up to ``wait_s`` for
        another holder to give it back.

        Raises:
            VolumeFailed: it could not be mounted; VolumeHeld: another node mounts it
            (409); LeaseUnavailable: the cluster could not be asked (503).
        """
        with self._vlock(rec.id):
            self._touched[rec.id] = time.monotonic()
            if self.leases is not None:
                self._take(rec, wait_s)
            self._mount(rec.id)
        return self.data_dir(rec.id)

    def leased(self) -> set[str]:
        """The ids whose lease this node took (or asked for) and has not given back."""
        return set(self._leased)

    def release_idle(self, used: set[str], idle_s: float) -> list[str]:
        """With leases: unmount every volume this node holds that no id in ``used``
        names (the volumes its sandboxes mount, running or paused) and no start or
        content call mounted within ``idle_s``, and give its lease back (only once
        unmounted). Returns the ids given back."""
        out = []
        if self.leases is None:
            return out
        for vid in sorted(self._leased):
            if vid in used or time.monotonic() - self._touched.get(vid, 0.0) < idle_s:
                continue
            with self._vlock(vid):
                if time.monotonic() - self._touched.get(vid, 0.0) < idle_s:
                    continue  # mounted again meanwhile
                try:
                    self._unmount(vid)
                except VolumeFailed as e:
                    log.warning("%s", e)
                    continue
                self._give_back(vid)
                if vid not in self._leased:
                    out.append(vid)
        return out

    def mount_all(self) -> None:
        """Node start. Without leases: mount every volume not mounted (one that fails is
        logged and left unmounted; its sandboxes then fail to start with a clear
        error). With leases: nothing is mounted, and every volume counts as possibly
        leased here (this node may hold leases from before its restart: for volumes
        still mounted by sandboxes that kept running, or of its paused sandboxes), so
        :meth:`release_idle` gives back those no sandbox here uses (a release of a lease
        another node holds changes nothing)."""
        for rec in self.all():
            if self.leases is not None:
                self._leased.add(rec.id)
                continue
            try:
                self._mount(rec.id)
            except VolumeFailed as e:
                log.error("volume %s (%s) could not be mounted: %s", rec.id, rec.name, e)

    def unmount_idle(self, used: set[str], referenced: set[str] = frozenset()) -> None:
        """Node stop: unmount every volume whose id is not in ``used`` (running
        sandboxes bind it); with leases, give back those not in ``referenced`` either
        (no sandbox here, running or paused, mounts it)."""
        for rec in self.all():
            if rec.id in used:
                continue
            try:
                self._unmount(rec.id)
            except VolumeFailed as e:
                log.warning("%s", e)
                continue
            if self.leases is not None and rec.id in self._leased and rec.id not in referenced:
                self._give_back(rec.id)


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
