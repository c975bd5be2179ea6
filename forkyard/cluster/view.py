"""The candidates a scheduler replica plans on, read from Redis at most every few
hundred milliseconds (issue 26: placements per second).

A placement read the best-indexed nodes' hashes from Redis every time (two pipelined
calls and ~8 hashes decoded: about half of a placement's CPU in the scheduler), then took
the room with one script (:meth:`~.store.ClusterStore.reserve`). The script is what makes
placement safe — it checks status, liveness and room atomically on Redis's clock — so
the plan may be made on a view a little old: a :class:`CandidateView` keeps what
:meth:`~.store.ClusterStore.candidates` answered for :data:`VIEW_TTL_S`, counts the room
this replica takes meanwhile (so one burst spreads over the nodes as a fresh read would
have it), and is read again when a reservation made on it fails or it finds no room.
What a stale view costs is a lost race (one more read), never a wrong grant.
"""

from __future__ import annotations

import time
from dataclasses import replace

from forkyard.cluster.store import ClusterStore
from forkyard.cluster.types import NodeInfo

#: How long a view is planned on (s): at 500 placements a second one read serves ~100;
#: a node's report changes once a second (its heartbeat), so a view misses at most a
#: quarter of a beat. Far below the heartbeat timeout (5 s), which the reservation
#: checks on Redis's clock anyway.
VIEW_TTL_S = 0.25
#: Views kept at most (one per distinct (k, snapshot, preferred nodes) asked for).
MAX_VIEWS = 64


class CandidateView:
    """Cached :meth:`ClusterStore.candidates` answers, per ``(k, snapshot_id, also)``.

    Args:
        store: the cluster state.
        ttl_s: see :data:`VIEW_TTL_S` (0: every call reads Redis, as without a view).
    """

    def __init__(self, store: ClusterStore, ttl_s: float = VIEW_TTL_S):
        self.store, self.ttl_s = store, ttl_s
        self._views: dict[tuple, tuple[float, list[NodeInfo], dict[str, int], float, int]] = {}

    async def candidates(self, k: int, snapshot_id: str | None = None, also: list[str] = (), fresh: bool = False
                         ) -> tuple[list[NodeInfo], dict[str, int], float, int, bool]:
        """:meth:`ClusterStore.candidates`' ``(nodes, placing, now, indexed)`` and whether
        it came from a view (``False``: read just now). From a view, ``now`` and each
        node's ``age`` have moved on by the time since the read (monotonic clock) and
        ``placing`` counts what :meth:`taken` recorded since; ``fresh`` reads Redis.

        Raises:
            ClusterStoreUnavailable: Redis failed (a read was needed).
        """
        key = (k, snapshot_id, tuple(also))
        got = self._views.get(key)
        t = time.monotonic()
        if got is not None and not fresh and t - got[0] < self.ttl_s:
            at, nodes, placing, now, indexed = got
            dt = t - at
            return ([replace(n, age=None if n.age is None else n.age + dt) for n in nodes],
                    dict(placing), now + dt, indexed, True)
        nodes, placing, now, indexed = await self.store.candidates(k, snapshot_id, also)
        if len(self._views) >= MAX_VIEWS:
            self._views.clear()
        self._views[key] = (time.monotonic(), nodes, dict(placing), now, indexed)
        return nodes, placing, now, indexed, False

    def taken(self, plan: list[tuple[str, int]]) -> None:
        """Count the room a reservation of ``plan`` (``[(node id, sandboxes), …]``) took
        in every view holding those nodes, until they are read again."""
        for _, _, placing, _, _ in self._views.values():
            for node_id, n in plan:
                if node_id in placing:
                    placing[node_id] += n
