"""The committed repository: manifests + content-addressed chunks on a backend.

Keys on the backend (posix directory or S3 prefix)::

    chunks/<h[:2]>/<h>          zstd(chunk), h = BLAKE3(chunk) in hex; stored once
    manifests/<id>.json         one snapshot: its metadata and, per image file, the
                                ordered list of (chunk hash, length)
    leases/<id>-<rand>.json     an in-progress commit: the chunks it will reference
    locks/gc.json               held while a GC runs

**Commit** (:meth:`Repository.commit`): cut every image file into chunks and hash them;
write the lease naming all of them; wait while a GC holds the lock; upload the chunks
the repository lacks (existence check per chunk); make them durable (posix: fsync of the
files and their directories); create the manifest exclusively (posix: temp file, fsync,
``link()`` to the final name, fsync of the directory; S3: ``If-None-Match: *``); drop the
lease. Existence checks are skipped for chunks this process committed earlier in the
same *GC epoch* (``locks/gc-epoch``, rewritten by every GC as soon as it holds the lock
and before it reads leases; the commit reads it after its lease is written and no GC
runs): such a chunk was protected by that commit's lease, then its manifest, and can only
have been deleted by a GC, which would have changed the epoch first (chunks removed by
hand are not noticed then). A crash anywhere leaves no manifest (the snapshot does not
exist) or a complete one; orphan chunks and leases are collected by GC.

**GC** (:meth:`Repository.gc`): take the lock (exclusive create; a lock older than
:data:`GC_LOCK_TTL_S` is stale), read every lease younger than :data:`LEASE_TTL_S`,
*then* every manifest, and delete each chunk no lease or manifest names that is older
than the grace period. Why it never frees a chunk a commit needs: a commit writes its
lease before it checks the lock. If the GC's lease scan came after the lease was
written, the GC keeps the lease's chunks; otherwise the GC lock already existed when the
commit checked, so the commit waited until the GC ended before checking which chunks
exist. Manifests are read after leases, so a commit that finishes (manifest written,
lease dropped) between the two scans is seen through its manifest.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forkyard.repository import chunks as ck
from forkyard.repository.backends import Backend
from forkyard.repository.errors import (
    ChunkCorrupt,
    ChunkMissing,
    ObjectMissing,
    RepositoryError,
)

log = logging.getLogger("forkyard.repository")

FORMAT = 1
#: A lease older than this belongs to a crashed commit and no longer protects chunks.
LEASE_TTL_S = 6 * 3600.0
#: A GC lock older than this belongs to a crashed GC.
GC_LOCK_TTL_S = 3600.0
#: How long a commit waits for a running GC before giving up.
GC_WAIT_S = 600.0
GC_LOCK = "locks/gc.json"
#: Rewritten (random token) by every GC as soon as it holds the lock, before it reads
#: leases; lets a commit trust its memory of which chunks exist (see Repository.commit).
GC_EPOCH = "locks/gc-epoch"
#: Bound on the remembered chunk names (about 100 bytes each).
KNOWN_MAX = 2_000_000


def manifest_key(snapshot_id: str) -> str:
    """Repository key of a snapshot's manifest."""
    return f"manifests/{snapshot_id}.json"


@dataclass(frozen=True)
class FileEntry:
    """One image file: relative ``path``, ``size`` in bytes, permission ``mode`` and its
    ``chunks`` as ``(hash, length)`` pairs in file order."""

    path: str
    size: int
    mode: int
    chunks: tuple[tuple[str, int], ...]


@dataclass
class CommitStats:
    """What one commit did. Sizes in bytes, time in seconds.

    Attributes:
        raw_bytes: image size (sum of its files).
        chunks, unique_chunks: chunk references in the manifest / distinct hashes.
        new_chunks: chunks uploaded (the repository lacked them).
        new_raw_bytes: uncompressed size of the uploaded chunks.
        new_stored_bytes: bytes added to the repository (compressed chunks).
        seconds: wall time of the commit.
    """

    raw_bytes: int = 0
    chunks: int = 0
    unique_chunks: int = 0
    new_chunks: int = 0
    new_raw_bytes: int = 0
    new_stored_bytes: int = 0
    seconds: float = 0.0


@dataclass
class Manifest:
    """A committed snapshot: ``meta`` (SnapshotMeta fields as a dict), ``files`` and the
    ``stats`` of its commit."""

    snapshot_id: str
    meta: dict
    files: list[FileEntry]
    stats: dict = field(default_factory=dict)

    def chunk_hashes(self) -> set[str]:
        """Every chunk hash the snapshot needs."""
        return {h for f in self.files for h, _ in f.chunks}

    def to_json(self) -> bytes:
        """Serialized manifest (UTF-8 JSON)."""
        return json.dumps({
            "format": FORMAT, "snapshot_id": self.snapshot_id, "meta": self.meta,
            "chunking": {"algorithm": "fastcdc", "min": ck.MIN_SIZE, "avg": ck.AVG_SIZE, "max": ck.MAX_SIZE,
                         "hash": ck.HASH_NAME, "compression": "zstd"},
            "files": [{"path": f.path, "size": f.size, "mode": f.mode, "chunks": [list(c) for c in f.chunks]}
                      for f in self.files],
            "stats": self.stats,
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse a manifest.

        Raises:
            RepositoryError: not a manifest of a known format.
        """
        try:
            d = json.loads(data)
            if d.get("format") != FORMAT:
                raise RepositoryError(f"manifest format {d.get('format')!r} is not supported")
            files = [FileEntry(_image_path(f["path"]), int(f["size"]), int(f["mode"]),
                               tuple((_chunk_hash(h), int(n)) for h, n in f["chunks"]))
                     for f in d["files"]]
            return cls(d["snapshot_id"], d["meta"], files, d.get("stats", {}))
        except (ValueError, KeyError, TypeError) as e:
            raise RepositoryError(f"malformed manifest: {e}") from e


def _image_path(path) -> str:
    """``path`` if it is a file path relative to an image directory and stays in it
    (normalised, no ``..``, not absolute, no NUL); else ValueError. A manifest is read
    from the repository, which other writers share: its paths are joined to image
    directories by restores and by P2P serving, so one must never leave them."""
    if not isinstance(path, str) or not path or "\0" in path or path.startswith("/") or "\\" in path:
        raise ValueError(f"image path {path!r} is not a relative path")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"image path {path!r} leaves its image or is not normalised")
    return path


def _chunk_hash(h) -> str:
    """``h`` if it is a chunk's content address (64 lowercase hex digits, BLAKE3:
    forkyard.repository.chunks); else ValueError (it names a backend object)."""
    if not isinstance(h, str) or len(h) != 64 or h.strip("0123456789abcdef"):
        raise ValueError(f"chunk hash {h!r} is not 64 lowercase hex digits")
    return h


def _image_files(image_dir: Path) -> list[tuple[str, Path]]:
    out = []
    for dirpath, dirs, files in os.walk(image_dir):
        dirs.sort()
        for name in sorted(files):
            p = Path(dirpath) / name
            if p.is_symlink() or not p.is_file():
                raise RepositoryError(f"image entry {p} is not a regular file")
            out.append((p.relative_to(image_dir).as_posix(), p))
    return sorted(out)


class Repository:
    """Manifests and chunks on ``backend`` (thread-safe).

    Args:
        backend: where objects live.
        workers: parallel existence checks / uploads / downloads.
    """

    def __init__(self, backend: Backend, workers: int = 8):
        self.backend = backend
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="repo")
        self._manifests: dict[str, Manifest] = {}
        self._lock = threading.Lock()
        self._known: set[str] = set()  # chunks this process committed since GC epoch _known_epoch
        self._known_epoch: bytes | None = None
        self.counters = {"commits": 0, "chunks_uploaded": 0, "chunks_reused": 0, "bytes_uploaded": 0,
                         "gc_runs": 0, "gc_chunks_freed": 0, "gc_bytes_freed": 0}

    # ---- manifests --------------------------------------------------------------------
    def manifest(self, snapshot_id: str, check: bool = True) -> Manifest | None:
        """The committed manifest of ``snapshot_id`` or None. Manifests are immutable and
        memoized; ``check`` re-confirms that a memoized one was not deleted since."""
        with self._lock:
            m = self._manifests.get(snapshot_id)
        if m is not None:
            if not check or self.backend.exists(manifest_key(snapshot_id)):
                return m
            with self._lock:
                self._manifests.pop(snapshot_id, None)
            return None
        try:
            m = Manifest.from_json(self.backend.get(manifest_key(snapshot_id)))
        except ObjectMissing:
            return None
        with self._lock:
            self._manifests[snapshot_id] = m
        return m

    def snapshot_ids(self) -> list[str]:
        """Ids of every committed manifest."""
        out = []
        for info in self.backend.list("manifests/"):
            name = info.key.rsplit("/", 1)[-1]
            if name.endswith(".json"):
                out.append(name[:-5])
        return out

    def manifests(self) -> list[Manifest]:
        """Every committed manifest (ones deleted while listing are skipped)."""
        out = []
        for sid in self.snapshot_ids():
            m = self.manifest(sid, check=False)
            if m is not None:
                out.append(m)
        return out

    def delete(self, snapshot_id: str) -> bool:
        """Remove a snapshot's manifest (its chunks go with the next GC); False when
        absent."""
        existed = self.backend.exists(manifest_key(snapshot_id))
        if existed:
            self.backend.delete(manifest_key(snapshot_id))
        with self._lock:
            self._manifests.pop(snapshot_id, None)
        return existed

    # ---- commit -----------------------------------------------------------------------
    def _gc_epoch(self) -> bytes:
        try:
            return self.backend.get(GC_EPOCH)
        except ObjectMissing:
            return b""

    def _wait_for_gc(self) -> None:
        deadline = time.time() + GC_WAIT_S
        while not self._gc_lock_stale():  # True when absent
            if time.time() > deadline:
                raise RepositoryError(f"a repository GC has held {GC_LOCK} for over {GC_WAIT_S:.0f} s")
            time.sleep(0.2)

    def commit(self, snapshot_id: str, image_dir: Path, meta: dict) -> CommitStats:
        """Store the image files under ``image_dir`` as snapshot ``snapshot_id`` (see the
        module doc for the protocol). ``meta`` goes into the manifest as is.

        Raises:
            FileExistsError: ``snapshot_id`` is already committed.
            RepositoryError: backend failure (nothing visible was committed).
        """
        t0 = time.perf_counter()
        if self.backend.exists(manifest_key(snapshot_id)):
            raise FileExistsError(f"snapshot {snapshot_id} already exists")
        maps: list[ck.MappedFile] = []
        try:
            files: list[FileEntry] = []
            where: dict[str, tuple[int, int, int]] = {}  # hash -> (file index, offset, length)
            stats = CommitStats()
            for rel, path in _image_files(image_dir):
                mf = ck.MappedFile(path)
                maps.append(mf)
                refs = ck.chunk_view(mf.view)
                for r in refs:
                    where.setdefault(r.hash, (len(maps) - 1, r.offset, r.length))
                files.append(FileEntry(rel, len(mf.view), path.stat().st_mode & 0o7777,
                                       tuple((r.hash, r.length) for r in refs)))
                stats.raw_bytes += len(mf.view)
                stats.chunks += len(refs)
            stats.unique_chunks = len(where)
            lease = f"leases/{snapshot_id}-{secrets.token_hex(4)}.json"
            self.backend.put(lease, json.dumps({"snapshot_id": snapshot_id, "created_at": time.time(),
                                                "chunks": sorted(where)}).encode(), exclusive=True)
            try:
                self._wait_for_gc()
                epoch = self._gc_epoch()
                with self._lock:
                    if epoch != self._known_epoch or len(self._known) > KNOWN_MAX:
                        self._known, self._known_epoch = set(), epoch
                    hashes = [h for h in where if h not in self._known]
                present = list(self.pool.map(lambda h: self.backend.exists(ck.chunk_key(h)), hashes))
                missing = [h for h, p in zip(hashes, present) if not p]

                def upload(h: str) -> int:
                    i, off, n = where[h]
                    with maps[i].view[off:off + n] as raw:
                        blob = ck.compress(raw)
                    self.backend.put(ck.chunk_key(h), blob)
                    return len(blob)

                # Wait for every upload before looking at any failure: the image's
                # mappings are closed on the way out and must outlive all readers.
                futures = [self.pool.submit(upload, h) for h in missing]
                wait(futures)
                sizes = [f.result() for f in futures]
                self.backend.barrier([ck.chunk_key(h) for h in missing])
                stats.new_chunks = len(missing)
                stats.new_raw_bytes = sum(where[h][2] for h in missing)
                stats.new_stored_bytes = sum(sizes)
                stats.seconds = time.perf_counter() - t0
                m = Manifest(snapshot_id, meta, files, asdict(stats))
                if not self.backend.put(manifest_key(snapshot_id), m.to_json(), exclusive=True):
                    raise FileExistsError(f"snapshot {snapshot_id} already exists")
            finally:
                try:
                    self.backend.delete(lease)
                except RepositoryError as e:  # GC drops it after LEASE_TTL_S
                    log.warning("could not drop commit lease %s: %s", lease, e)
            with self._lock:
                self._manifests[snapshot_id] = m
                if self._known_epoch == epoch:
                    self._known.update(where)
                c = self.counters
                c["commits"] += 1
                c["chunks_uploaded"] += stats.new_chunks
                c["chunks_reused"] += stats.unique_chunks - stats.new_chunks
                c["bytes_uploaded"] += stats.new_stored_bytes
            stats.seconds = time.perf_counter() - t0
            return stats
        finally:
            for mf in maps:
                mf.close()

    # ---- chunks -----------------------------------------------------------------------
    def fetch_chunk(self, h: str) -> bytes:
        """The stored (compressed) bytes of chunk ``h``, not yet verified.

        Raises:
            ChunkMissing: the repository has no such chunk.
        """
        try:
            return self.backend.get(ck.chunk_key(h))
        except ObjectMissing:
            raise ChunkMissing(f"chunk {h} is missing from the repository {self.backend.location}", h) from None

    def stored_bytes(self) -> tuple[int, int]:
        """``(chunk count, bytes)`` of every chunk in the repository (a full listing)."""
        n = size = 0
        for info in self.backend.list("chunks/"):
            n += 1
            size += info.size
        return n, size

    # ---- GC ---------------------------------------------------------------------------
    def _gc_lock_stale(self) -> bool:
        try:
            held = json.loads(self.backend.get(GC_LOCK))
            return time.time() - float(held.get("created_at", 0)) > GC_LOCK_TTL_S
        except ObjectMissing:
            return True
        except (ValueError, AttributeError):
            return True

    def gc(self, grace_s: float) -> dict:
        """Delete chunks that no manifest and no live lease references and that are older
        than ``grace_s`` seconds (see the module doc).

        Returns:
            ``{"skipped": bool, "chunks_freed": int, "bytes_freed": int, "chunks_kept": int,
            "stale_leases": int, "seconds": float}``; ``skipped`` when another GC holds
            the lock.

        Raises:
            RepositoryError: backend failure (the lock is released; nothing needed is
                deleted).
        """
        t0 = time.perf_counter()
        out = {"skipped": False, "chunks_freed": 0, "bytes_freed": 0, "chunks_kept": 0, "stale_leases": 0}
        lock = json.dumps({"created_at": time.time(), "owner": f"{os.uname().nodename}:{os.getpid()}"}).encode()
        if not self.backend.put(GC_LOCK, lock, exclusive=True):
            acquired = False
            if self._gc_lock_stale():
                self.backend.delete(GC_LOCK)
                acquired = self.backend.put(GC_LOCK, lock, exclusive=True)
            if not acquired:
                out["skipped"] = True
                out["seconds"] = time.perf_counter() - t0
                return out
        try:
            self.backend.put(GC_EPOCH, secrets.token_hex(16).encode())
            live: set[str] = set()
            now = time.time()
            for info in self.backend.list("leases/"):
                try:
                    lease = json.loads(self.backend.get(info.key))
                except ObjectMissing:
                    continue  # its commit finished; its manifest is read below
                except ValueError:
                    lease = {"created_at": info.mtime, "chunks": []}
                if now - float(lease.get("created_at", info.mtime)) > LEASE_TTL_S:
                    self.backend.delete(info.key)
                    out["stale_leases"] += 1
                    continue
                live.update(lease.get("chunks", []))
            for m in self.manifests():
                live |= m.chunk_hashes()
            cutoff = time.time() - grace_s
            doomed = []
            for info in self.backend.list("chunks/"):
                h = info.key.rsplit("/", 1)[-1]
                if h in live or info.mtime >= cutoff:
                    out["chunks_kept"] += 1
                else:
                    doomed.append(info)
            for _ in self.pool.map(lambda i: self.backend.delete(i.key), doomed):
                pass
            out["chunks_freed"] = len(doomed)
            out["bytes_freed"] = sum(i.size for i in doomed)
            self.backend.cleanup_temporary(max(grace_s, 3600.0))
        finally:
            self.backend.delete(GC_LOCK)
        with self._lock:
            self.counters["gc_runs"] += 1
            self.counters["gc_chunks_freed"] += out["chunks_freed"]
            self.counters["gc_bytes_freed"] += out["bytes_freed"]
        out["seconds"] = time.perf_counter() - t0
        return out

    def close(self) -> None:
        """Stop the worker threads."""
        self.pool.shutdown(wait=False)


def verify_chunk(h: str, blob: bytes, length: int, snapshot_id: str | None = None) -> bytes:
    """Decode a stored chunk and check its hash and length (see :func:`chunks.decode`).

    Raises:
        ChunkCorrupt: with ``snapshot_id`` set.
    """
    try:
        return ck.decode(h, blob, length)
    except ChunkCorrupt as e:
        e.snapshot_id = snapshot_id
        raise
