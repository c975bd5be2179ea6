"""Content-defined chunking, naming, compression and verification of chunks.

A file is cut with FastCDC (``fastcdc`` package, Cython build) into chunks of
:data:`MIN_SIZE`…:data:`MAX_SIZE` bytes (about :data:`AVG_SIZE` on average). Cut
points depend on content only, so an insertion or a shifted region in ``pages.img``
changes only the chunks around it. A chunk is named by the BLAKE3 hash of its
*uncompressed* bytes (64 hex digits) and stored zstd-compressed under
``chunks/<first two hex digits>/<name>``.

Measured on real runsc images of the ``base`` template (17.5 MB pages.img + 0.7 MB
checkpoint.img) before and after writing 1 MB of random data in the sandbox: with
16/64/256 KiB chunks the second image has 2.1 MB of chunks the first lacks (16 KiB
average: 1.9 MB; 256 KiB: 3.5 MB); checkpoint.img changes almost entirely every time
but compresses ~9x.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import blake3
import zstandard

from forkyard.repository.errors import ChunkCorrupt

MIN_SIZE = 16 << 10
AVG_SIZE = 64 << 10
MAX_SIZE = 256 << 10
#: zstd level (3 is zstd's default: ~300 MB/s per core here on image data).
ZSTD_LEVEL = 3
HASH_NAME = "blake3"

_local = threading.local()


@dataclass(frozen=True)
class ChunkRef:
    """A chunk of one file: BLAKE3 ``hash`` (hex), ``offset`` and ``length`` in bytes."""

    hash: str
    offset: int
    length: int


def chunk_key(h: str) -> str:
    """Repository key of chunk ``h``: ``chunks/<h[:2]>/<h>``."""
    return f"chunks/{h[:2]}/{h}"


def digest(data: bytes | memoryview) -> str:
    """Hex BLAKE3 of ``data``."""
    return blake3.blake3(data).hexdigest()


def cut(data: bytes | memoryview | mmap.mmap) -> list[tuple[int, int]]:
    """FastCDC cut points of ``data``: ``[(offset, length), …]`` covering it in order."""
    if len(data) == 0:
        return []
    from fastcdc.fastcdc_cy import fastcdc_cy

    return [(c.offset, c.length) for c in fastcdc_cy(data, min_size=MIN_SIZE, avg_size=AVG_SIZE, max_size=MAX_SIZE)]


class MappedFile:
    """A read-only mapping of a file for chunking: ``view`` is a memoryview (empty for
    an empty file). Use as a context manager."""

    def __init__(self, path: Path):
        self._f = open(path, "rb")  # noqa: SIM115 — closed by close()
        size = os.fstat(self._f.fileno()).st_size
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        self.view = memoryview(self._mm) if self._mm is not None else memoryview(b"")

    def close(self) -> None:
        self.view.release()
        if self._mm is not None:
            self._mm.close()
        self._f.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chunk_view(view: memoryview) -> list[ChunkRef]:
    """Cut and hash ``view`` into :class:`ChunkRef` in file order."""
    return [ChunkRef(digest(view[o:o + n]), o, n) for o, n in cut(view)]


def compress(raw: bytes | memoryview) -> bytes:
    """zstd frame of ``raw`` (content size recorded in the frame)."""
    c = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c.compress(raw)


def decode(h: str, blob: bytes, expected_len: int | None = None) -> bytes:
    """Decompress a stored chunk and check it hashes to ``h``.

    Raises:
        ChunkCorrupt: not a valid zstd frame, wrong length, or wrong hash.
    """
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    try:
        raw = d.decompress(blob, max_output_size=MAX_SIZE * 2)
    except zstandard.ZstdError as e:
        raise ChunkCorrupt(f"chunk {h} is corrupt: it does not decompress ({e})", h) from None
    if expected_len is not None and len(raw) != expected_len:
        raise ChunkCorrupt(f"chunk {h} is corrupt: it has {len(raw)} bytes, the manifest says {expected_len}", h)
    if digest(raw) != h:
        raise ChunkCorrupt(f"chunk {h} is corrupt: its content hashes to {digest(raw)}", h)
    return raw
