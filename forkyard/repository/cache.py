"""Node-local cache: fetched chunks and materialized image directories, one LRU bound.

Layout under ``root``::

    chunks/<h[:2]>/<h>     a chunk exactly as stored in the repository (zstd)
    images/<id>/...        a snapshot's image files as runsc reads them
    images/.tmp-*          being materialized; removed at startup
    images/.evict-*        being evicted; removed at startup

Entries are chunks and whole images; their sizes (compressed chunk bytes, apparent
image bytes) add up to at most ``limit_bytes`` after every insertion. The least recently
used entry goes first, except images *pinned* by a restore in progress (a pin is released
by :meth:`NodeCache.unpin` or expires); only pinned images can hold the total above the
bound, and only until they are unpinned. Everything here is derived from the repository:
deleting the whole directory at any time is safe (missing files count as misses).
Recency survives restarts through file modification times.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger("forkyard.repository")


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                pass
    return total


class NodeCache:
    """Bounded LRU cache of chunks and materialized images (thread-safe).

    Args:
        root: cache directory (created).
        limit_bytes: bound on the sum of entry sizes (bytes, > 0).

    Attributes:
        counters: ``chunk_hits``, ``chunk_misses``, ``image_hits``, ``image_misses``,
            ``evictions``, ``evicted_bytes`` (ints, since start).
    """

    def __init__(self, root: Path, limit_bytes: int):
        if limit_bytes <= 0:
            raise ValueError("cache limit must be positive")
        self.root = Path(root)
        self.limit_bytes = int(limit_bytes)
        self._lru: OrderedDict[str, int] = OrderedDict()  # "c:<hash>" / "i:<id>" -> bytes
        self._used = 0
        self._pins: dict[str, list[float]] = {}
        self._lock = threading.RLock()
        self.counters = {"chunk_hits": 0, "chunk_misses": 0, "image_hits": 0, "image_misses": 0,
                         "evictions": 0, "evicted_bytes": 0}
        self._scan()

    # ---- paths ------------------------------------------------------------------------
    def _chunk_path(self, h: str) -> Path:
        return self.root / "chunks" / h[:2] / h

    def image_dir(self, snapshot_id: str) -> Path:
        """Where the materialized image of ``snapshot_id`` lives (may not exist)."""
        return self.root / "images" / snapshot_id

    # ---- index ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Rebuild the index from disk (startup), oldest first; drop leftovers."""
        found: list[tuple[float, str, int]] = []
        images = self.root / "images"
        images.mkdir(parents=True, exist_ok=True)
        (self.root / "chunks").mkdir(parents=True, exist_ok=True)
        for d in images.iterdir():
            if d.name.startswith("."):
                shutil.rmtree(d, ignore_errors=True)
            elif d.is_dir():
                found.append((d.stat().st_mtime, f"i:{d.name}", _tree_size(d)))
        for dirpath, _, files in os.walk(self.root / "chunks"):
            for name in files:
                p = Path(dirpath) / name
                if name.startswith("."):
                    p.unlink(missing_ok=True)
                    continue
                st = p.stat()
                found.append((st.st_mtime, f"c:{name}", st.st_size))
        with self._lock:
            for _, key, size in sorted(found):
                self._lru[key] = size
                self._used += size
            self._evict(0)

    def _drop(self, key: str) -> None:
        size = self._lru.pop(key, None)
        if size is not None:
            self._used -= size

    def _pinned(self, key: str) -> bool:
        if not key.startswith("i:"):
            return False
        pins = self._pins.get(key[2:])
        if not pins:
            return False
        now = time.time()
        pins[:] = [t for t in pins if t > now]
        if not pins:
            self._pins.pop(key[2:], None)
        return bool(pins)

    def _evict(self, incoming: int) -> None:
        """Evict LRU entries until ``used + incoming <= limit`` (pinned images stay)."""
        if self._used + incoming <= self.limit_bytes:
            return
        for key in list(self._lru):
            if self._used + incoming <= self.limit_bytes:
                break
            if self._pinned(key):
                continue
            size = self._lru[key]
            self._drop(key)
            self.counters["evictions"] += 1
            self.counters["evicted_bytes"] += size
            if key.startswith("c:"):
                self._chunk_path(key[2:]).unlink(missing_ok=True)
            else:
                self._remove_image_dir(key[2:])

    def _remove_image_dir(self, snapshot_id: str) -> None:
        d = self.image_dir(snapshot_id)
        trash = d.parent / f".evict-{snapshot_id}-{secrets.token_hex(4)}"
        try:
            os.rename(d, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    # ---- chunks -----------------------------------------------------------------------
    def get_chunk(self, h: str) -> bytes | None:
        """Stored bytes of chunk ``h`` or None (counted as hit / miss)."""
        key = f"c:{h}"
        with self._lock:
            known = key in self._lru
            if known:
                self._lru.move_to_end(key)
        if known:
            p = self._chunk_path(h)
            try:
                data = p.read_bytes()
                os.utime(p)
                with self._lock:
                    self.counters["chunk_hits"] += 1
                return data
            except FileNotFoundError:  # the cache was wiped under us
                with self._lock:
                    self._drop(key)
        with self._lock:
            self.counters["chunk_misses"] += 1
        return None

    def put_chunk(self, h: str, blob: bytes) -> None:
        """Keep chunk ``h`` (stored bytes); skipped when larger than the whole bound."""
        if len(blob) > self.limit_bytes:
            return
        key = f"c:{h}"
        with self._lock:
            if key in self._lru:
                return
            self._evict(len(blob))
            self._lru[key] = len(blob)
            self._used += len(blob)
        p = self._chunk_path(h)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.parent / f".tmp-{secrets.token_hex(6)}"
            tmp.write_bytes(blob)
            os.replace(tmp, p)
        except OSError as e:
            log.warning("could not cache chunk %s: %s", h, e)
            with self._lock:
                self._drop(key)

    def has_chunk(self, h: str) -> bool:
        """Whether the index holds chunk ``h`` (not counted; the file may still vanish)."""
        return f"c:{h}" in self._lru

    def peek_chunk(self, h: str) -> bytes | None:
        """Stored bytes of chunk ``h`` or None, for a peer (:mod:`.p2p`): not counted as
        a hit or miss of this node's restores, and the LRU order is kept."""
        if f"c:{h}" not in self._lru:
            return None
        try:
            return self._chunk_path(h).read_bytes()
        except FileNotFoundError:
            return None

    def held_image(self, snapshot_id: str) -> Path | None:
        """The materialized image directory of ``snapshot_id`` when the cache holds it,
        else None, for a peer (:mod:`.p2p`): not counted, not pinned, LRU order kept (an
        eviction may remove it while a peer reads it: the read then fails)."""
        d = self.image_dir(snapshot_id)
        return d if f"i:{snapshot_id}" in self._lru and d.is_dir() else None

    def drop_chunk(self, h: str) -> None:
        """Forget chunk ``h`` (e.g. it failed verification)."""
        with self._lock:
            self._drop(f"c:{h}")
        self._chunk_path(h).unlink(missing_ok=True)

    # ---- images -----------------------------------------------------------------------
    def get_image(self, snapshot_id: str, pin_s: float = 0.0) -> Path | None:
        """The materialized image directory or None (counted as hit / miss); pinned for
        ``pin_s`` seconds when found."""
        key = f"i:{snapshot_id}"
        d = self.image_dir(snapshot_id)
        with self._lock:
            if key in self._lru and d.is_dir():
                self._lru.move_to_end(key)
                self.counters["image_hits"] += 1
                if pin_s > 0:
                    self._pins.setdefault(snapshot_id, []).append(time.time() + pin_s)
                try:
                    os.utime(d)
                except FileNotFoundError:
                    pass
                return d
            self._drop(key)
            self.counters["image_misses"] += 1
            return None

    def new_image_dir(self) -> Path:
        """A fresh temporary directory to materialize an image into (pass it to
        :meth:`add_image` or remove it)."""
        d = self.root / "images" / f".tmp-{secrets.token_hex(8)}"
        d.mkdir(parents=True)
        return d

    def reserve(self, nbytes: int) -> None:
        """Evict so that ``nbytes`` more fit (before writing an image of that size)."""
        with self._lock:
            self._evict(nbytes)

    def add_image(self, snapshot_id: str, src: Path, pin_s: float = 0.0) -> Path:
        """Move the complete image directory ``src`` (same filesystem) into the cache as
        ``snapshot_id``, evicting others to make room; pinned for ``pin_s`` seconds.
        Returns its new path."""
        size = _tree_size(src)
        key = f"i:{snapshot_id}"
        dst = self.image_dir(snapshot_id)
        with self._lock:
            self._drop(key)
            if pin_s > 0:
                self._pins.setdefault(snapshot_id, []).append(time.time() + pin_s)
            self._evict(size)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists():
                self._remove_image_dir(snapshot_id)
            os.rename(src, dst)
            os.utime(dst)
            self._lru[key] = size
            self._used += size
        return dst

    def drop_image(self, snapshot_id: str, force: bool = False) -> None:
        """Remove a materialized image unless a restore has it pinned (then it is left to
        the LRU) or ``force``."""
        key = f"i:{snapshot_id}"
        with self._lock:
            if self._pinned(key) and not force:
                return
            self._drop(key)
            self._remove_image_dir(snapshot_id)

    def pin(self, snapshot_id: str, seconds: float) -> None:
        """Keep ``snapshot_id``'s image from eviction for ``seconds`` (or until
        :meth:`unpin`); no-op for ``seconds <= 0``."""
        if seconds > 0:
            with self._lock:
                self._pins.setdefault(snapshot_id, []).append(time.time() + seconds)

    def unpin(self, snapshot_id: str) -> None:
        """Release one pin of ``snapshot_id``'s image (no-op when none)."""
        with self._lock:
            pins = self._pins.get(snapshot_id)
            if pins:
                pins.remove(min(pins))
                if not pins:
                    self._pins.pop(snapshot_id, None)

    # ---- whole cache ------------------------------------------------------------------
    def image_ids(self, limit: int = 1000) -> list[str]:
        """Ids of the snapshots whose materialized image is cached, most recently used
        first, at most ``limit`` (a cluster node reports them for placement locality)."""
        with self._lock:
            keys = [k[2:] for k in reversed(self._lru) if k.startswith("i:")]
        return keys[:limit]

    @property
    def used_bytes(self) -> int:
        """Sum of entry sizes now (bytes)."""
        return self._used

    def disk_bytes(self) -> int:
        """Apparent size of every file under the cache directory now (bytes)."""
        return _tree_size(self.root)

    def wipe(self) -> None:
        """Empty the cache (pins are kept; pinned images are removed too)."""
        with self._lock:
            self._lru.clear()
            self._used = 0
            for sub in ("chunks", "images"):
                shutil.rmtree(self.root / sub, ignore_errors=True)
                (self.root / sub).mkdir(parents=True, exist_ok=True)

    def stats(self) -> dict:
        """Counters plus ``limit_bytes``, ``used_bytes``, ``entries``, ``images``."""
        with self._lock:
            images = sum(1 for k in self._lru if k.startswith("i:"))
            return {**self.counters, "limit_bytes": self.limit_bytes, "used_bytes": self._used,
                    "entries": len(self._lru), "images": images}
