"""Committed checkpoint images on this node (posix directory layout).

Layout under ``<data>/snapshots``::

    .staging-<id>/          being written; never listed, removed at startup
    <id>/image/             runsc checkpoint files
    <id>/meta.json          SnapshotMeta, written last before the rename

Commit protocol (crash-safe): the runtime writes into ``.staging-<id>/image``; we
fsync every file, write ``meta.json`` (fsync), then ``rename`` the staging directory to
``<id>`` and fsync the parent. A crash at any point leaves either no ``<id>`` or a
complete one. The content-addressed chunk store (repository issue) replaces the image
directory with a manifest later; this class's interface stays.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import string
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

_ALPHABET = string.ascii_lowercase + string.digits
_ID = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


@dataclass
class SnapshotMeta:
    """What a restore needs besides the image.

    Attributes:
        snapshot_id: id (also the directory name).
        kind: ``"snapshot"`` (user-visible), ``"pause"`` (a paused sandbox's state) or
            ``"fork"`` (the source image of a fork).
        template_id: template whose rootfs the image expects.
        source_sandbox_id: sandbox the checkpoint was taken from.
        vcpus, memory_mb: resource settings to restore with (cores, MiB).
        env_vars, metadata: the source's create-time settings.
        names: user-given names (``POST /sandboxes/{id}/snapshots`` ``name``).
        created_at: UNIX seconds.
        size_bytes: bytes of the image on disk.
        envd_access_token: the token envd holds inside the image (needed to re-init
            a restored child with a new one); the file is root-only like the data dir.
        parent_image_id: snapshot the source itself was restored from (lineage).
    """

    snapshot_id: str
    kind: str
    template_id: str
    source_sandbox_id: str
    vcpus: int
    memory_mb: int
    env_vars: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, str] = field(default_factory=dict)
    names: list[str] = field(default_factory=list)
    created_at: float = 0.0
    size_bytes: int = 0
    envd_access_token: str | None = None
    parent_image_id: str | None = None


def new_snapshot_id() -> str:
    """A 20-character lower-case alphanumeric id."""
    return "".join(secrets.choice(_ALPHABET) for _ in range(20))


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotStore:
    """Staging, commit, lookup and deletion of snapshots under ``root``.

    Raises ``OSError`` on I/O failure.
    """

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def staging(self, snapshot_id: str) -> Path:
        """Fresh staging directory; the runtime writes the image into ``<it>/image``."""
        path = self.root / f".staging-{snapshot_id}"
        shutil.rmtree(path, ignore_errors=True)
        (path / "image").mkdir(parents=True)
        return path

    def commit(self, staging: Path, meta: SnapshotMeta) -> SnapshotMeta:
        """Make ``staging`` durable and visible as ``meta.snapshot_id`` (see module doc).

        Raises:
            FileExistsError: a snapshot with that id is already committed.
        """
        final = self.root / meta.snapshot_id
        if final.exists():
            raise FileExistsError(f"snapshot {meta.snapshot_id} already exists")
        size = 0
        for dirpath, _, files in os.walk(staging):
            for name in files:
                p = Path(dirpath) / name
                size += p.stat().st_size
                _fsync_path(p)
            _fsync_path(Path(dirpath))
        meta.size_bytes = size
        meta.created_at = meta.created_at or time.time()
        tmp = staging / "meta.json.tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(meta), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, staging / "meta.json")
        _fsync_path(staging)
        os.rename(staging, final)
        _fsync_path(self.root)
        return meta

    def discard(self, staging: Path) -> None:
        """Remove an uncommitted staging directory."""
        shutil.rmtree(staging, ignore_errors=True)

    def image(self, snapshot_id: str) -> Path:
        """Image directory of a committed snapshot."""
        return self.root / snapshot_id / "image"

    def get(self, snapshot_id: str) -> SnapshotMeta | None:
        """Committed snapshot by id, or None."""
        if not _ID.match(snapshot_id):
            return None
        try:
            with open(self.root / snapshot_id / "meta.json") as f:
                return SnapshotMeta(**json.load(f))
        except (FileNotFoundError, NotADirectoryError):
            return None

    def find(self, ref: str) -> SnapshotMeta | None:
        """User-visible snapshot by id or by one of its names (the newest snapshot
        carrying the name wins, as E2B re-points a reused name to the new build)."""
        meta = self.get(ref)
        if meta is not None and meta.kind == "snapshot":
            return meta
        for m in reversed(self.list("snapshot")):
            if ref in m.names:
                return m
        return None

    def list(self, kind: str | None = None) -> list[SnapshotMeta]:
        """Committed snapshots (of ``kind`` when given), oldest first."""
        out = []
        for d in self.root.iterdir():
            if d.name.startswith("."):
                continue
            meta = self.get(d.name)
            if meta and (kind is None or meta.kind == kind):
                out.append(meta)
        return sorted(out, key=lambda m: (m.created_at, m.snapshot_id))

    def delete(self, snapshot_id: str) -> bool:
        """Delete a committed snapshot; False when absent. The directory is renamed
        out of sight first, so a crash never leaves a half-deleted listed snapshot."""
        final = self.root / snapshot_id
        if not final.is_dir():
            return False
        trash = self.root / f".trash-{snapshot_id}-{secrets.token_hex(4)}"
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def cleanup_staging(self) -> list[str]:
        """Remove every staging/trash directory (startup); returns their names."""
        gone = []
        for d in self.root.iterdir():
            if d.name.startswith((".staging-", ".trash-")):
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        return gone
