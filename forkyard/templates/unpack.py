"""Reading untrusted tar archives (image layers, build ``COPY`` uploads) within limits.

The one place that bounds what an archive may make the server do (issue 25, item 3: a
1.5 MB import once took the server to 2.39 GB of memory, a 20 KB tar holding a sparse
file allocated 2 GiB of host disk). Every reader of an untrusted archive — image
import, ``COPY`` uploads and registry pulls — goes through :func:`members`
with a :class:`Meter` over :class:`Limits` taken from the settings:

* the archive is read as a stream (``tarfile`` ``r|`` mode, gzip decompressed as it is
  read): nothing is read whole into memory, member lists are not kept;
* ``FORKYARD_MAX_UNPACKED_MB`` bounds the bytes all members together unpack to, sparse
  files at their apparent size; ``FORKYARD_MAX_UNPACKED_FILES`` the number of entries;
  ``FORKYARD_MAX_UNPACKED_FILE_MB`` any one file. Past one: :class:`LimitExceeded`
  (the API answers 413 naming the setting);
* extended headers (PAX, GNU long names, sparse maps), which ``tarfile`` reads into
  memory whole, are refused past :data:`MAX_HEADER_BYTES` each and
  :data:`MAX_HEADER_TOTAL` per archive (:class:`ArchiveError`, 400);
* :func:`write_data` writes a member's data with runs of zeros left as holes, so a
  sparse file costs the disk what it holds, not its apparent size.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

#: One extended header (PAX record set, GNU long name/link, old GNU sparse map) at most
#: (bytes). Real ones are a few hundred bytes (paths ≤ 4096, xattrs, capabilities).
MAX_HEADER_BYTES = 1 << 20
#: All extended headers of one archive together (bytes).
MAX_HEADER_TOTAL = 64 << 20
_CHUNK = 1 << 20
_ZEROS = bytes(_CHUNK)
_EXT_TYPES = {tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE,
              tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_SPARSE}


class ArchiveError(Exception):
    """Not a tar archive this server reads (unsupported compression, broken or
    oversized headers); the API answers 400."""


class LimitExceeded(Exception):
    """An archive unpacks to more than a limit allows; ``setting`` names the limit's
    environment variable. The API answers 413."""

    status = 413

    def __init__(self, setting: str, message: str):
        super().__init__(f"{message} (limit: {setting})")
        self.setting = setting


@dataclass(frozen=True)
class Limits:
    """What one archive (or one image: its layers together) may unpack to.

    Attributes:
        max_bytes: bytes of all members together, sparse files at apparent size.
        max_files: entries (files, directories, links, whiteouts).
        max_file_bytes: bytes of any one member.
    """

    max_bytes: int
    max_files: int
    max_file_bytes: int

    @classmethod
    def from_settings(cls, settings) -> Limits:
        """The limits of :class:`forkyard.config.Settings` (``max_unpacked_mb``,
        ``max_unpacked_files``, ``max_unpacked_file_mb``)."""
        return cls(settings.max_unpacked_mb << 20, settings.max_unpacked_files, settings.max_unpacked_file_mb << 20)

    def stream_bytes(self) -> int:
        """The most bytes a tar stream within these limits can take (data, one header
        block and up to three extended-header blocks per entry, padding, the end): the
        bound for a whole decompressed archive, e.g. a gzipped upload."""
        return self.max_bytes + self.max_files * 2560 + MAX_HEADER_TOTAL + 10240


class Meter:
    """Counts entries and unpacked bytes against ``limits`` across one or more archives
    (an image's layers share one meter)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.files = 0
        self.bytes = 0

    def count(self, m: tarfile.TarInfo) -> None:
        """Count member ``m``.

        Raises:
            LimitExceeded: past a limit.
        """
        lim = self.limits
        self.files += 1
        if self.files > lim.max_files:
            raise LimitExceeded("FORKYARD_MAX_UNPACKED_FILES", f"the archive holds more than {lim.max_files} entries")
        size = max(m.size, 0)
        if size > lim.max_file_bytes:
            raise LimitExceeded("FORKYARD_MAX_UNPACKED_FILE_MB",
                                f"{m.name!r} is {size} bytes, more than {lim.max_file_bytes} for one file")
        self.bytes += size
        if self.bytes > lim.max_bytes:
            raise LimitExceeded("FORKYARD_MAX_UNPACKED_MB", f"the archive unpacks to more than {lim.max_bytes} bytes")


class _HeaderReads:
    """A tar file's ``fileobj`` stand-in while an extended header is parsed: reads pass
    through until ``budget`` bytes, then :class:`ArchiveError`."""

    def __init__(self, inner, budget: int):
        self.inner, self.budget, self.used = inner, budget, 0

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or self.used + size > self.budget:
            raise ArchiveError(f"an extended tar header is larger than {MAX_HEADER_BYTES} bytes "
                               f"(or all of them over {MAX_HEADER_TOTAL})")
        self.used += size
        return self.inner.read(size)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _BoundedTarInfo(tarfile.TarInfo):
    """TarInfo whose extended headers are read within :data:`MAX_HEADER_BYTES` (and the
    archive's :data:`MAX_HEADER_TOTAL`): ``tarfile`` reads them into memory whole."""

    def _proc_member(self, tf):  # noqa: D401 — tarfile's extension point (its docs: "subclass to add")
        if self.type not in _EXT_TYPES or isinstance(tf.fileobj, _HeaderReads):
            return super()._proc_member(tf)
        used = getattr(tf, "_fy_header_bytes", 0)
        real = tf.fileobj
        guard = _HeaderReads(real, min(MAX_HEADER_BYTES, MAX_HEADER_TOTAL - used))
        if self.size > guard.budget:
            raise ArchiveError(f"an extended tar header of {self.size} bytes is larger than {MAX_HEADER_BYTES}")
        tf.fileobj = guard
        try:
            return super()._proc_member(tf)
        finally:
            tf.fileobj = real
            tf._fy_header_bytes = used + guard.used


def decompressed(f: IO[bytes]) -> IO[bytes]:
    """``f`` (a file open for reading, with ``peek`` or at its start) as a plain tar
    stream: gzip is decompressed as it is read; plain tar passes through.

    Raises:
        ArchiveError: zstd, bzip2 or xz compression (not read here).
    """
    if not hasattr(f, "peek"):
        f = io.BufferedReader(f)  # type: ignore[arg-type]
    head = f.peek(6)[:6]
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if head[:4] == b"\x28\xb5\x2f\xfd":
        raise ArchiveError("zstd-compressed layers are not supported (recompress with gzip)")
    if head[:3] == b"BZh" or head == b"\xfd7zXZ\x00":
        raise ArchiveError("bzip2/xz-compressed archives are not supported (use gzip or plain tar)")
    return f


def members(f: IO[bytes], meter: Meter) -> Iterator[tuple[tarfile.TarInfo, tarfile.TarFile]]:
    """Stream the members of the tar archive in ``f`` (plain or gzip), each counted by
    ``meter`` before it is yielded with the open TarFile (whose ``extractfile`` reads the
    member's data — only until the next member is asked for).

    Raises:
        LimitExceeded: past a limit of ``meter``.
        ArchiveError: not a readable tar archive, or oversized headers.
    """
    try:
        with tarfile.open(fileobj=decompressed(f), mode="r|", tarinfo=_BoundedTarInfo) as tf:
            while True:
                m = tf.next()
                if m is None:
                    return
                tf.members.clear()  # a stream is read once: keep no list of every member
                meter.count(m)
                yield m, tf
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, OSError, UnicodeError, ValueError) as e:
        if isinstance(e, (ArchiveError, LimitExceeded)):
            raise
        raise ArchiveError(f"not a readable tar archive: {e}") from e


def write_data(src: IO[bytes], fd: int, size: int) -> None:
    """Copy a member's ``size`` bytes from ``src`` to the file open at ``fd``, runs of
    zeros (1 MiB chunks) left as holes; the file ends at ``size``.

    Raises:
        ArchiveError: the archive ends inside the member.
    """
    left = size
    while left > 0:
        chunk = src.read(min(_CHUNK, left))
        if not chunk:
            raise ArchiveError("the archive ends inside a file")
        left -= len(chunk)
        if chunk == _ZEROS[: len(chunk)]:
            os.lseek(fd, len(chunk), os.SEEK_CUR)
            continue
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]
    os.ftruncate(fd, size)


def gunzip_to(src: IO[bytes], dst: IO[bytes], max_bytes: int) -> int:
    """Decompress gzip ``src`` into ``dst`` (streaming); returns the bytes written.

    Raises:
        LimitExceeded: it decompresses to more than ``max_bytes``
            (``FORKYARD_MAX_UNPACKED_MB``, through :meth:`Limits.stream_bytes`).
        ArchiveError: not gzip data.
    """
    total = 0
    try:
        with gzip.GzipFile(fileobj=src, mode="rb") as gz:
            while chunk := gz.read(_CHUNK):
                total += len(chunk)
                if total > max_bytes:
                    raise LimitExceeded("FORKYARD_MAX_UNPACKED_MB", f"the archive decompresses to more than {max_bytes} bytes")
                dst.write(chunk)
    except (gzip.BadGzipFile, EOFError, OSError) as e:
        raise ArchiveError(f"not readable gzip data: {e}") from e
    return total


def is_gzip(path: str | os.PathLike) -> bool:
    """True when the file at ``path`` starts with the gzip magic."""
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"
