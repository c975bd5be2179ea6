"""Peer-to-peer read path for committed chunks between cluster nodes (issue 24; off by
default, ``FORKYARD_P2P=on``).

The repository stays the source of truth: commits go there as always and a restore
that gets nothing from peers reads it exactly as without P2P. With P2P on, a node's
:class:`~.service.ChunkService` serves what its cache holds to the other members (over
iroh, :mod:`.transport`) and :class:`~forkyard.repository.snapshots.SnapshotStore` asks
peers for each chunk it lacks before the repository, verifying every chunk against its
content address. The cluster agent (:mod:`forkyard.cluster.agent`) starts the service
and keeps its member table current from the scheduler's heartbeat answers.
"""

from forkyard.repository.p2p.service import ChunkService, Peer

__all__ = ["ChunkService", "Peer"]
