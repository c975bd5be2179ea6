"""Snapshot repository: staging → committed store (posix_fs | s3) → node cache.

See :mod:`forkyard.repository.snapshots` for the layers and
:mod:`forkyard.repository.repo` for the on-repository format and protocols.
"""

from forkyard.repository.errors import (
    ChunkCorrupt,
    ChunkError,
    ChunkMissing,
    RepositoryConfigError,
    RepositoryError,
)
from forkyard.repository.snapshots import (
    SnapshotMeta,
    SnapshotNotFound,
    SnapshotStore,
    new_snapshot_id,
)

__all__ = [
    "ChunkCorrupt", "ChunkError", "ChunkMissing", "RepositoryConfigError", "RepositoryError",
    "SnapshotMeta", "SnapshotNotFound", "SnapshotStore", "new_snapshot_id",
]
