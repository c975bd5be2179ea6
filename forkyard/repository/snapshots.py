"""Snapshot store: the orchestrator's view of the repository (issue 4).

Three layers:

1. **Staging** — ``<root>/.staging-<id>/image``: runsc writes a checkpoint there; never
   visible to readers; removed at startup (:meth:`SnapshotStore.cleanup_staging`).
2. **Committed repository** — the source of truth (:mod:`.repo`): a manifest plus
   content-addressed, zstd-compressed chunks on ``posix_fs`` (default
   ``<root>/repository``, or any directory / shared mount) or ``s3`` (see
   :mod:`.config` for ``FORKYARD_REPO`` and the S3 settings).
3. **Node cache** — ``<root>/cache`` (:mod:`.cache`): fetched chunks and materialized
   image directories under one LRU bound (``FORKYARD_CACHE_BYTES``); safe to delete.

:meth:`SnapshotStore.commit` uploads the chunks the repository lacks, writes the manifest
atomically, then moves the staging image into the cache as that snapshot's materialized
image (so resume/fork on this node read it directly). :meth:`SnapshotStore.image` returns
a directory of plain files for ``runsc restore --image-path``: the cached one, or one
materialized from chunks (cached chunks first, then — with P2P on (:mod:`.p2p`) — peers,
the rest fetched from the repository in parallel, every chunk verified against its
BLAKE3 name). A missing or corrupt chunk fails
with :class:`~forkyard.repository.errors.ChunkMissing` /
:class:`~forkyard.repository.errors.ChunkCorrupt`, never a wrong image.
:meth:`SnapshotStore.delete` removes the manifest; chunks are freed by :meth:`SnapshotStore.gc`
(also run in the background at most every :data:`GC_INTERVAL_S` after deletions).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forkyard.ids import is_name, new_snapshot_id  # noqa: F401 — new_snapshot_id: also this module's name
from forkyard.repository import chunks as ck
from forkyard.repository.backends import Backend
from forkyard.repository.cache import NodeCache
from forkyard.repository.config import RepoConfig
from forkyard.repository.errors import ChunkCorrupt, ChunkMissing, RepositoryError
from forkyard.repository.repo import CommitStats, Manifest, Repository, verify_chunk

log = logging.getLogger("forkyard.repository")

#: How long :meth:`SnapshotStore.image` keeps an image from eviction unless released.
PIN_S = 600.0
#: Background GC runs at most this often (seconds), triggered by deletions.
GC_INTERVAL_S = 600.0
#: Chunk references fetched/written per parallel batch during materialization.
RESTORE_BATCH = 64


class SnapshotNotFound(RepositoryError, LookupError):
    """No committed snapshot has this id."""


@dataclass
class SnapshotMeta:
    """What a restore needs besides the image.

    Attributes:
        snapshot_id: id (also the manifest's name).
        kind: ``"snapshot"`` (user-visible), ``"pause"`` (a paused sandbox's state) or
            ``"fork"`` (the source image of a fork).
        template_id: template whose rootfs the image expects.
        source_sandbox_id: sandbox the checkpoint was taken from.
        vcpus, memory_mb: resource settings to restore with (cores, MiB).
        env_vars, metadata: the source's create-time settings.
        names: user-given names (``POST /sandboxes/{id}/snapshots`` ``name``).
        created_at: UNIX seconds.
        size_bytes: bytes of the image (its files, uncompressed).
        envd_access_token: the token envd holds inside the image (needed to re-init
            a restored child with a new one); it is stored in the manifest, so the
            repository (directory or bucket) must be as private as the data dir.
        parent_image_id: snapshot the source itself was restored from (lineage).
        memory: True for a checkpoint (memory, processes and files: a restore
            continues them); False for a filesystem-only image, whose files a cold boot
            lays over the template's rootfs (E2B ``memory: false`` / SDK
            ``mode="filesystem"``). Manifests from before the field are checkpoints.
            The image's files are the runtime driver's (its format,
            :meth:`forkyard.runtime.base.RuntimeDriver.image_at`); the repository stores
            them as they are.
        default_user, default_workdir: the source's envd defaults (set by a template
            build), for a cold boot's ``/init``; None: envd's own.
        disk_mb: the source's disk size (MiB), which sandboxes restored from it get;
            0 = the node's default (images made before disks were sized per template).
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
    memory: bool = True
    default_user: str | None = None
    default_workdir: str | None = None
    disk_mb: int = 0


_META_FIELDS = {f.name for f in dataclasses.fields(SnapshotMeta)}


def _meta(m: Manifest) -> SnapshotMeta:
    return SnapshotMeta(**{k: v for k, v in m.meta.items() if k in _META_FIELDS})


@functools.lru_cache(maxsize=64)
def _zero_hash(n: int) -> str:
    return ck.digest(bytes(n))


class SnapshotStore:
    """Staging, commit, lookup, restore images, deletion and GC of snapshots.

    Args:
        root: node-local directory for staging and the cache (``<data>/snapshots``).
        config: repository settings; default :meth:`RepoConfig.from_env` with the
            posix repository at ``<root>/repository``.
        backend: use this backend instead of the one ``config`` names (tests).
        auto_gc: run :meth:`gc` in a background thread after deletions (at most every
            :data:`GC_INTERVAL_S`).

    Raises:
        RepositoryConfigError: incomplete S3 settings, unusable bucket or directory.
    """

    def __init__(self, root: Path, config: RepoConfig | None = None, backend: Backend | None = None,
                 auto_gc: bool = True):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config or RepoConfig.from_env(self.root / "repository")
        self.repo = Repository(backend or self.config.open_backend())
        self.cache = NodeCache(self.root / "cache", self.config.cache_bytes)
        self.auto_gc = auto_gc
        self._id_locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()
        self._gc_lock = threading.Lock()
        self._last_gc = 0.0
        self.last_gc: dict | None = None
        #: Where chunks are asked for before the repository (P2P, :mod:`.p2p`): an object
        #: with ``fetch_many(sid, [(hash, length)]) -> {(hash, length): (blob, raw)}`` that
        #: returns only verified chunks, and ``stats() -> dict``; None (default) reads the
        #: repository only.
        self.peers = None
        self.counters = {"chunks_fetched": 0, "bytes_fetched": 0, "materializations": 0,
                         "materialize_seconds": 0.0, "zero_chunks_skipped": 0}

    # ---- staging / commit -------------------------------------------------------------
    def staging(self, snapshot_id: str) -> Path:
        """Fresh staging directory; the runtime writes the image into ``<it>/image``."""
        path = self.staging_path(snapshot_id)
        shutil.rmtree(path, ignore_errors=True)
        (path / "image").mkdir(parents=True)
        return path

    def staging_path(self, snapshot_id: str) -> Path:
        """Where :meth:`staging` put ``snapshot_id``'s staging directory (it may be gone)."""
        return self.root / f".staging-{snapshot_id}"

    def commit(self, staging: Path, meta: SnapshotMeta) -> SnapshotMeta:
        """Store ``<staging>/image`` in the repository as ``meta.snapshot_id`` (chunks,
        then the manifest atomically) and keep the image in the node cache as that
        snapshot's materialized image. Sets ``meta.size_bytes`` (image bytes) and
        ``meta.created_at``; the commit's :class:`CommitStats` are in
        :attr:`last_commit_stats` and :meth:`commit_stats`.

        Raises:
            FileExistsError: a snapshot with that id is already committed.
            RepositoryError: the repository failed; nothing was committed.
        """
        image = staging / "image"
        meta.size_bytes = sum(p.stat().st_size for p in image.rglob("*") if p.is_file())
        meta.created_at = meta.created_at or time.time()
        stats = self.repo.commit(meta.snapshot_id, image, asdict(meta))
        self.last_commit_stats = stats
        try:
            self.cache.add_image(meta.snapshot_id, image)
        except OSError as e:
            log.warning("could not keep the image of %s in the cache: %s", meta.snapshot_id, e)
        shutil.rmtree(staging, ignore_errors=True)
        return meta

    def discard(self, staging: Path) -> None:
        """Remove an uncommitted staging directory."""
        shutil.rmtree(staging, ignore_errors=True)

    def commit_stats(self, snapshot_id: str) -> CommitStats | None:
        """What committing ``snapshot_id`` uploaded (None when unknown)."""
        m = self.repo.manifest(snapshot_id)
        if m is None:
            return None
        return CommitStats(**{k: v for k, v in m.stats.items() if k in CommitStats.__dataclass_fields__})

    # ---- restore images ---------------------------------------------------------------
    def _id_lock(self, snapshot_id: str) -> threading.Lock:
        with self._locks_guard:
            return self._id_locks.setdefault(snapshot_id, threading.Lock())

    def image(self, snapshot_id: str, pin_s: float = PIN_S) -> Path:
        """Directory of plain image files for ``runsc restore --image-path``.

        Reuses this node's materialized copy when it has one; otherwise materializes it
        from chunks (cache first, missing ones fetched from the repository, each
        verified). Blocking (call it in a thread). The directory is pinned against
        eviction for ``pin_s`` seconds or until :meth:`release`.

        Raises:
            SnapshotNotFound: no such committed snapshot.
            ChunkMissing / ChunkCorrupt: a chunk is absent or fails verification (the
                message names the snapshot and the chunk); nothing is cached as the image.
            RepositoryError / OSError: backend or local I/O failure.
        """
        with self._id_lock(snapshot_id):
            m = self.repo.manifest(snapshot_id) if is_name(snapshot_id) else None
            if m is None:
                raise SnapshotNotFound(f"snapshot {snapshot_id} is not in the repository {self.repo.backend.location}")
            d = self.cache.get_image(snapshot_id, pin_s=pin_s)  # pinned atomically with the lookup
            if d is not None:
                if all(_size_or_none(d / f.path) == f.size for f in m.files):
                    return d
                self.cache.unpin(snapshot_id)
                log.warning("cached image of %s does not match its manifest; materializing again", snapshot_id)
                self.cache.drop_image(snapshot_id, force=True)
            return self._materialize(m, pin_s)

    def release(self, snapshot_id: str) -> None:
        """Unpin an image returned by :meth:`image` (its restore has finished)."""
        self.cache.unpin(snapshot_id)

    def _from_peers(self, sid: str, need: list[tuple[str, int]]) -> dict:
        """The chunks of ``need`` the cache lacks, from peers (verified), when P2P is on."""
        if self.peers is None:
            return {}
        lacking = [hn for hn in need if not self.cache.has_chunk(hn[0])]
        return self.peers.fetch_many(sid, lacking) if lacking else {}

    def _load_chunk(self, sid: str, h: str, n: int, peers: dict | None = None) -> bytes:
        blob = self.cache.get_chunk(h)
        if blob is not None:
            try:
                return verify_chunk(h, blob, n, sid)
            except ChunkCorrupt as e:
                log.warning("cached chunk dropped: %s", e)
                self.cache.drop_chunk(h)
        got = (peers or {}).get((h, n))
        if got is not None:  # verified by the peer source against h and n
            blob, raw = got
            self.cache.put_chunk(h, blob)
            return raw
        try:
            blob = self.repo.fetch_chunk(h)
            raw = verify_chunk(h, blob, n, sid)
        except ChunkMissing as e:
            raise ChunkMissing(f"snapshot {sid} cannot be restored: {e}", h, sid) from None
        except ChunkCorrupt as e:
            raise ChunkCorrupt(f"snapshot {sid} cannot be restored: {e} (repository {self.repo.backend.location})",
                               h, sid) from None
        self.cache.put_chunk(h, blob)
        with self._locks_guard:
            self.counters["chunks_fetched"] += 1
            self.counters["bytes_fetched"] += len(blob)
        return raw

    def _materialize(self, m: Manifest, pin_s: float) -> Path:
        t0 = time.perf_counter()
        sid = m.snapshot_id
        self.cache.reserve(sum(f.size for f in m.files))
        tmp = self.cache.new_image_dir()
        fds: list[int] = []
        try:
            refs: list[tuple[int, int, str, int]] = []
            for f in m.files:
                path = tmp / f.path
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f.mode & 0o777 or 0o600)
                fds.append(fd)
                os.ftruncate(fd, f.size)
                off = 0
                for h, n in f.chunks:
                    refs.append((fd, off, h, n))
                    off += n
                if off != f.size:
                    raise RepositoryError(f"manifest of {sid}: chunks of {f.path} add up to {off}, not {f.size}")
            zeros = 0
            for i in range(0, len(refs), RESTORE_BATCH):
                batch = refs[i:i + RESTORE_BATCH]
                need = list(dict.fromkeys((h, n) for _, _, h, n in batch if h != _zero_hash(n)))
                peers = self._from_peers(sid, need)
                raws = dict(zip(need, self.repo.pool.map(lambda hn: self._load_chunk(sid, *hn, peers), need)))
                for fd, off, h, n in batch:
                    raw = raws.get((h, n))
                    if raw is None:  # all-zero chunk: the file is already zero (sparse) there
                        zeros += 1
                        continue
                    os.pwrite(fd, raw, off)
            for fd in fds:
                os.close(fd)
            fds.clear()
            d = self.cache.add_image(sid, tmp, pin_s)
        except BaseException:
            for fd in fds:
                os.close(fd)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        with self._locks_guard:
            self.counters["materializations"] += 1
            self.counters["materialize_seconds"] += time.perf_counter() - t0
            self.counters["zero_chunks_skipped"] += zeros
        return d

    # ---- lookup -----------------------------------------------------------------------
    def get(self, snapshot_id: str) -> SnapshotMeta | None:
        """Committed snapshot by id, or None."""
        if not is_name(snapshot_id):
            return None
        m = self.repo.manifest(snapshot_id)
        return _meta(m) if m is not None else None

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
        out = [_meta(m) for m in self.repo.manifests()]
        out = [m for m in out if kind is None or m.kind == kind]
        return sorted(out, key=lambda m: (m.created_at, m.snapshot_id))

    # ---- deletion / GC ----------------------------------------------------------------
    def delete(self, snapshot_id: str) -> bool:
        """Delete a committed snapshot (its manifest: atomic on both backends) and its
        cached image; False when absent. Its chunks are freed by the next :meth:`gc`."""
        if not is_name(snapshot_id):
            return False
        existed = self.repo.delete(snapshot_id)
        self.cache.drop_image(snapshot_id)
        if existed:
            self._maybe_gc()
        return existed

    def _maybe_gc(self) -> None:
        if not self.auto_gc or time.time() - self._last_gc < GC_INTERVAL_S:
            return
        self._last_gc = time.time()

        def run() -> None:
            try:
                self.gc()
            except Exception as e:  # noqa: BLE001 — background; retried after the interval
                log.warning("repository GC failed: %s", e)

        threading.Thread(target=run, name="repo-gc", daemon=True).start()

    def gc(self, grace_s: float | None = None) -> dict:
        """Free chunks that no snapshot or in-progress commit needs and that are older
        than ``grace_s`` (default ``config.gc_grace_s``) seconds. See
        :meth:`Repository.gc` for the result dict.

        Raises:
            RepositoryError: backend failure.
        """
        with self._gc_lock:
            self._last_gc = time.time()
            out = self.repo.gc(self.config.gc_grace_s if grace_s is None else grace_s)
            self.last_gc = out
            return out

    def cleanup_staging(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Remove every staging/trash directory (startup) except those named in
        ``keep``; returns the names removed."""
        gone = []
        for d in self.root.iterdir():
            if d.name.startswith((".staging-", ".trash-")) and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
        return gone

    # ---- metrics ----------------------------------------------------------------------
    def metrics(self) -> dict:
        """Repository and cache metrics (JSON-ready), e.g. for ``GET /metrics/repository``::

            {"backend": "posix_fs"|"s3", "location": str,
             "cache": {"limit_bytes", "used_bytes", "entries", "images", "chunk_hits",
                       "chunk_misses", "image_hits", "image_misses", "evictions",
                       "evicted_bytes"},
             "restore": {"chunks_fetched", "bytes_fetched", "materializations",
                         "materialize_seconds", "zero_chunks_skipped"},
             "commit": {"commits", "chunks_uploaded", "chunks_reused", "bytes_uploaded"},
             "gc": {"gc_runs", "gc_chunks_freed", "gc_bytes_freed", "last": dict|None},
             "p2p": {"chunks_from_peers", "bytes_from_peers", "served_chunks", …}}  # P2P on only

        ``restore.chunks_fetched`` / ``bytes_fetched`` count repository reads only; chunks
        from peers are in ``p2p`` (:meth:`~.p2p.ChunkService.stats`).

        Byte counts are stored (compressed) bytes except ``*_bytes`` of the cache's
        images (apparent file sizes). Counters are since this process started.
        """
        rc = dict(self.repo.counters)
        with self._locks_guard:
            restore = dict(self.counters)
        return {
            "backend": self.repo.backend.kind,
            "location": self.repo.backend.location,
            "cache": self.cache.stats(),
            "restore": restore,
            "commit": {k: rc[k] for k in ("commits", "chunks_uploaded", "chunks_reused", "bytes_uploaded")},
            "gc": {**{k: rc[k] for k in ("gc_runs", "gc_chunks_freed", "gc_bytes_freed")}, "last": self.last_gc},
            **({"p2p": self.peers.stats()} if self.peers is not None else {}),
        }

    def close(self) -> None:
        """Stop worker threads (the store must not be used afterwards)."""
        self.repo.close()


def _size_or_none(p: Path) -> int | None:
    try:
        return p.stat().st_size
    except OSError:
        return None
