"""Placement: filter → score → pick, one sandbox at a time.

**Filter**: the node is ``up`` (not draining, not down), heard from within the heartbeat
timeout, and has room: ``max_sandboxes − running − placing > 0`` where ``placing`` counts
placements made since its last heartbeat (so two schedulers, or one burst, do not all
pick the same node before its report catches up).

**Score** (lower wins), E2B's least-busy score (``placement_best_of_K``: ``(cpu requested
+ cpu reserved + 0.5 × cpu in use) / (4 × cpu count)``) with snapshot locality added::

    score = (vcpus_new + vcpus_reserved + vcpus_new × placing + 0.5 × load1) / (4 × vcpus)
    score × 0.5   when the node's cache already holds the snapshot being restored

``load1`` (the 1-minute load average) stands in for "CPU in use". Ties go to the node
with the lower id, so placement is deterministic for a given cluster state. The
scheduler scores only the best-indexed nodes (:mod:`.rooms`: E2B samples K=3 of its
fleet), and takes the chosen room atomically there; this function is the pure choice.

**Fork**: children go to the source's node while it has room (they restore from the
staged image there, no repository round trip), the rest one at a time by score.

**Volumes**: a sandbox that mounts a volume another node holds (:mod:`.volumes`), and
the fork children of a sandbox that mounts volumes, go to that one node (``only``) or
nowhere: an ext4 volume is mounted on one node at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

from forkyard.cluster.types import NODE_UP, NodeInfo

#: Score multiplier for a node whose cache holds the snapshot (see module docstring).
LOCALITY_FACTOR = 0.5


class NoCapacity(Exception):
    """No node can take the sandbox (all down, draining or full)."""


@dataclass
class _Candidate:
    node: NodeInfo
    placing: int

    def room(self) -> int:
        r = self.node.report
        return r.max_sandboxes - r.running - self.placing

    def score(self, vcpus: int, snapshot_id: str | None) -> float:
        r = self.node.report
        s = (vcpus + r.vcpus_reserved + vcpus * self.placing + 0.5 * r.load1) / (4 * max(r.vcpus, 1))
        if snapshot_id and snapshot_id in r.cached_snapshots:
            s *= LOCALITY_FACTOR
        return s


def eligible(nodes: list[NodeInfo], now: float, exclude: set[str] = frozenset()) -> list[NodeInfo]:
    """Nodes that may take new sandboxes: up and heard from within the heartbeat
    timeout (a node's :attr:`~.types.NodeInfo.age` as read from Redis when known, else
    ``now - last_seen``)."""
    return [n for n in nodes if n.status == NODE_UP and (n.alive() if n.age is not None else n.alive(now))
            and n.node_id not in exclude]


def place(nodes: list[NodeInfo], placing: dict[str, int], now: float, count: int = 1, vcpus: int = 2,
          snapshot_id: str | None = None, prefer: str | None = None,
          exclude: set[str] = frozenset(), only: str | None = None) -> list[tuple[NodeInfo, int]]:
    """Spread ``count`` sandboxes of ``vcpus`` each over the cluster.

    Args:
        nodes: every registered node; placing: placements per node since its last
            heartbeat; now: current time (s).
        snapshot_id: image the sandbox restores from (locality bonus).
        prefer: node filled first while it has room (a fork's source node).
        exclude: node ids never chosen.
        only: the one node that may be chosen (it holds the sandbox's volumes).

    Returns:
        ``[(node, n), …]`` with ``n ≥ 1``, the preferred node first, then in order of
        first choice; the ``n`` add up to ``count``.

    Raises:
        NoCapacity: fewer than ``count`` places exist (nothing is placed).
    """
    cands = [_Candidate(n, placing.get(n.node_id, 0)) for n in eligible(nodes, now, exclude)
             if only is None or n.node_id == only]
    chosen: dict[str, int] = {}
    order: list[_Candidate] = []
    pref = next((c for c in cands if c.node.node_id == prefer), None)
    for _ in range(count):
        if pref is not None and pref.room() > 0:
            best = pref
        else:
            room = [c for c in cands if c.room() > 0]
            if not room:
                total = sum(chosen.values())
                raise NoCapacity(f"no node has room for {count - total} more sandbox(es) "
                                 f"({len(cands)} node(s) up; add nodes or raise FORKYARD_NODE_MAX_SANDBOXES)")
            best = min(room, key=lambda c: (c.score(vcpus, snapshot_id), c.node.node_id))
        if best.node.node_id not in chosen:
            order.append(best)
            chosen[best.node.node_id] = 0
        chosen[best.node.node_id] += 1
        best.placing += 1
    return [(c.node, chosen[c.node.node_id]) for c in order]
