"""Errors of the snapshot repository."""

from __future__ import annotations


class RepositoryError(Exception):
    """Base class: the repository could not do what was asked (I/O, backend, format)."""


class RepositoryConfigError(RepositoryError):
    """The repository settings are incomplete or wrong (raised at startup), e.g. an
    ``s3://`` repository without ``FORKYARD_S3_REGION``."""


class ChunkError(RepositoryError):
    """A chunk a snapshot needs cannot be used; the restore fails rather than produce a
    wrong sandbox.

    Attributes:
        chunk: hex BLAKE3 name of the chunk.
        snapshot_id: snapshot being read, when known.
    """

    def __init__(self, message: str, chunk: str, snapshot_id: str | None = None):
        super().__init__(message)
        self.chunk = chunk
        self.snapshot_id = snapshot_id


class ChunkMissing(ChunkError):
    """A chunk a manifest lists is absent from the repository."""


class ChunkCorrupt(ChunkError):
    """A chunk's content does not hash to its name (or does not decompress)."""


class ObjectMissing(RepositoryError, KeyError):
    """A backend object does not exist (``key`` attribute)."""

    def __init__(self, key: str):
        super().__init__(f"object {key!r} not found")
        self.key = key

    def __str__(self) -> str:  # KeyError would quote the message
        return f"object {self.key!r} not found"
