"""Shapes shared by scheduler, gateway and node agent (JSON over HTTP and in Redis).

Times are UNIX seconds (float); sizes bytes; memory MiB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from forkyard.config import ControlPlaneSettings

#: Node heartbeat period (s); the issue asks for ≤ 2 s.
HEARTBEAT_INTERVAL_S = 1.0
#: A node silent this long (s, ``FORKYARD_HEARTBEAT_TIMEOUT_S``) gets no new placements;
#: silent this long *while the control plane itself was healthy* (see
#: :mod:`forkyard.cluster.liveness`) it is declared down by the scheduler: its running
#: sandboxes are reported gone, its paused ones resume elsewhere. Default 5: 3 missed
#: heartbeats and some slack; raise it where nodes can stall longer (an overloaded host).
HEARTBEAT_TIMEOUT_S = ControlPlaneSettings().heartbeat_timeout_s

NODE_UP, NODE_DRAINING, NODE_DOWN = "up", "draining", "down"


@dataclass
class NodeReport:
    """What a node tells the scheduler with every heartbeat.

    Attributes:
        vcpus, memory_mb: the host's CPU count and memory (MiB).
        max_sandboxes: how many sandboxes may run at once here (``FORKYARD_NODE_MAX_SANDBOXES``).
        running, paused: sandbox counts now; ``vcpus_reserved`` sums running sandboxes' vCPUs.
        free_slots: network slots built ahead and ready (spares).
        cache_bytes: node cache bound (bytes).
        load1: 1-minute load average of the host.
        runtime: runtime build (e.g. ``runsc 0.0~20240729.0``); checkpoints restore only
            on the same build.
        cached_snapshots: snapshot ids whose image this node's cache holds (at most 1000).
        boot: random id of the node process (a new one after every restart).
        drain_done: the node was told to drain and has paused what it could; the
            sandboxes still ``running`` then are those whose pause failed.
        p2p: with ``FORKYARD_P2P=on``, the node's iroh address ``{"id": endpoint id
            (64 hex), "addrs": ["ip:port", …]}`` (:mod:`.p2p`); None without P2P.
    """

    vcpus: int = 0
    memory_mb: int = 0
    max_sandboxes: int = 0
    running: int = 0
    paused: int = 0
    vcpus_reserved: int = 0
    free_slots: int = 0
    cache_bytes: int = 0
    load1: float = 0.0
    runtime: str = ""
    cached_snapshots: list[str] = field(default_factory=list)
    boot: str = ""
    drain_done: bool = False
    p2p: dict | None = None

    @classmethod
    def from_dict(cls, d: dict) -> NodeReport:
        """Build from JSON, ignoring unknown keys (newer nodes may send more)."""
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in (d or {}).items() if k in known})

    def to_dict(self) -> dict:
        """JSON-ready dict (shallow: its lists and dict are the report's own; a heartbeat
        serializes one per beat, where ``dataclasses.asdict``'s deep copy cost ~3 % of a
        scheduler's CPU at 300 nodes)."""
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass
class NodeInfo:
    """A registered node as the scheduler sees it.

    Attributes:
        node_id: unique name (``FORKYARD_NODE_ID``, default the host name).
        url: where the gateway reaches the node's API (``FORKYARD_ADVERTISE_URL``).
        status: ``up``, ``draining`` (no new placements; its sandboxes are paused) or
            ``down`` (silent past :data:`HEARTBEAT_TIMEOUT_S`).
        last_seen: time of its last heartbeat.
        report: its last :class:`NodeReport`.
        age: seconds since that heartbeat, measured on Redis's clock when the node was
            read (None when built without a store); every liveness judgement uses
            Redis's clock, so skewed host clocks do not matter.
        grace_until: Redis time before which it is not declared down: it announced a
            restart (``SIGTERM``; ``FORKYARD_NODE_RESTART_GRACE_S``,
            :class:`~forkyard.config.ClusterSettings`); 0 when it did not.
    """

    node_id: str
    url: str
    status: str
    last_seen: float
    report: NodeReport
    age: float | None = None
    grace_until: float = 0.0

    def heartbeat_age(self, now: float | None = None) -> float:
        """Seconds since the last heartbeat: ``now - last_seen`` when ``now`` is given,
        else :attr:`age` as read."""
        if now is None and self.age is not None:
            return self.age
        return (time.time() if now is None else now) - self.last_seen

    def alive(self, now: float | None = None) -> bool:
        """Heard from within the heartbeat timeout (placement takes only such nodes).
        Not the same as "not declared down" (:attr:`declared_down`): a silent node is
        only declared down on evidence about the node itself."""
        return self.heartbeat_age(now) <= HEARTBEAT_TIMEOUT_S

    @property
    def declared_down(self) -> bool:
        """The scheduler declared it down (:mod:`forkyard.cluster.liveness`)."""
        return self.status == NODE_DOWN

    def to_dict(self, now: float | None = None) -> dict:
        """JSON shape of ``GET /v1/nodes`` entries: ``status`` as declared (``up``,
        ``draining``, ``down``), ``silent`` when its last heartbeat is older than the
        timeout (not declared down: e.g. while the control plane recovers)."""
        age = self.heartbeat_age(now)
        return {"nodeID": self.node_id, "url": self.url, "status": self.status,
                "silent": age > HEARTBEAT_TIMEOUT_S,
                "lastSeen": self.last_seen, "heartbeatAge": round(age, 3),
                "report": self.report.to_dict()}


@dataclass
class Binding:
    """Which node owns a sandbox, and the sandbox's persisted record as that node last
    published it (the node's ``SandboxRecord`` as a dict; it holds the envd token and
    env vars, so Redis must be as private as a node's data dir).

    ``state`` is the record's state (``running``, ``paused`` or a transient one such
    as ``pausing``); anything but ``paused`` dies with its node.
    """

    sandbox_id: str
    node_id: str
    state: str
    record: dict
    updated: float
    #: False while a paused sandbox's image is only on its node (being committed, or
    #: the repository refused it): it cannot resume elsewhere yet.
    committed: bool = True
