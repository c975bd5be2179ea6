"""How a node joins a cluster (:class:`ClusterSettings`), the timings the control plane
and the node agent share (:class:`ControlPlaneSettings`), and the peer-to-peer chunk
transport (:class:`P2PSettings`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from forkyard.config._env import _env, _env_on


@dataclass(frozen=True)
class ClusterSettings:
    """How ``forkyard node`` joins a cluster; unset values mean the node runs alone (the
    control plane's credentials and addresses: :class:`ControlPlaneEnv`, checked in
    :mod:`forkyard.cluster.config`).

    Attributes:
        scheduler_url: ``FORKYARD_SCHEDULER_URL``: join the cluster of this scheduler.
        node_id: ``FORKYARD_NODE_ID``: this node's name (default: the host name).
        advertise_url: ``FORKYARD_ADVERTISE_URL``: the URL gateways reach this node at.
        repo: ``FORKYARD_REPO`` as given ("" when unset): a cluster node refuses to start
            without the shared repository unless ``allow_local_repo``
            (``FORKYARD_ALLOW_LOCAL_REPO=1``).
        restart_grace_s: ``FORKYARD_NODE_RESTART_GRACE_S`` (120): how long a node stopped
            with SIGTERM asks not to be declared down (s).
        commit_retry_s: ``FORKYARD_COMMIT_RETRY_S`` (30): how often paused images a
            failed commit left staged are committed again (s).
        mass_silence_fraction: ``FORKYARD_MASS_SILENCE_FRACTION`` (0.5), read by the
            scheduler: more nodes than this fraction silent at once are not declared down
            (:mod:`forkyard.cluster.liveness`).
        beat_stream: ``FORKYARD_BEAT_STREAM`` (``off``; ``on``): heartbeats over one
            WebSocket to the scheduler instead of one HTTP request each
            (:mod:`forkyard.cluster.beatstream`); also 1/0, true/false, yes/no; any other value is refused.
    """

    scheduler_url: str | None = field(default_factory=lambda: _env("FORKYARD_SCHEDULER_URL") or None)
    node_id: str | None = field(default_factory=lambda: _env("FORKYARD_NODE_ID") or None)
    advertise_url: str | None = field(default_factory=lambda: _env("FORKYARD_ADVERTISE_URL") or None)
    repo: str = field(default_factory=lambda: _env("FORKYARD_REPO").strip())
    allow_local_repo: bool = field(default_factory=lambda: _env("FORKYARD_ALLOW_LOCAL_REPO") == "1")
    restart_grace_s: float = field(default_factory=lambda: float(_env("FORKYARD_NODE_RESTART_GRACE_S", "120")))
    commit_retry_s: float = field(default_factory=lambda: float(_env("FORKYARD_COMMIT_RETRY_S", "30")))
    mass_silence_fraction: float = field(
        default_factory=lambda: float(_env("FORKYARD_MASS_SILENCE_FRACTION", "0.5")))
    beat_stream: bool = field(default_factory=lambda: _env_on("FORKYARD_BEAT_STREAM"))


@dataclass(frozen=True)
class P2PSettings:
    """The peer-to-peer read path for committed chunks between cluster nodes
    (:mod:`forkyard.repository.p2p`; off by default: then nothing of it runs).

    Attributes:
        enabled: ``FORKYARD_P2P`` (``on``/``off``, default off): a cluster node runs an
            iroh endpoint, serves the chunks its cache holds to the other members and
            reads chunks from them before the repository.
        bind: ``FORKYARD_P2P_BIND`` (``0.0.0.0:0``): the UDP address the endpoint binds
            (``host:port``; port 0 picks one); its direct addresses are advertised in the
            node's heartbeat (no relay, no discovery service).
        timeout_s: ``FORKYARD_P2P_TIMEOUT_S`` (5): longest wait for the answer to one
            request (of up to 16 chunks) to one peer, from the moment it is sent (s);
            past it those chunks are read from the repository and the peer is skipped
            for 30 s. Eight answers in a row slower than half of it skip the peer too.
        slot_wait_s: ``FORKYARD_P2P_SLOT_WAIT_S`` (5): longest wait of a request for one
            of the ``per_peer`` slots to a peer before it is sent (s); past it its chunks
            go to the next peer or the repository (the peer is not skipped for it).
        max_serving: ``FORKYARD_P2P_MAX_SERVING`` (16): chunk transfers this node serves
            at once (all peers together); more are answered "busy" at once.
        max_serving_per_peer: ``FORKYARD_P2P_MAX_SERVING_PER_PEER`` (4): of those, at most
            this many to one member (by endpoint id, all its connections together), so a
            member flooding this node cannot take every slot from the others.
        per_peer: ``FORKYARD_P2P_PER_PEER`` (4): chunk requests this node has in flight to
            one peer at once.
        peer_mbit: ``FORKYARD_P2P_PEER_MBIT`` (1000): what this node sends to one member,
            at most (Mbit/s of stored chunk bytes, a leaky bucket per member; 0: no
            bound). 1000 is the network the seed recommends as a minimum between nodes,
            so one member fetching cannot fill a 1 Gbit/s uplink beyond that.
    """

    enabled: bool = field(default_factory=lambda: _env_on("FORKYARD_P2P"))
    bind: str = field(default_factory=lambda: _env("FORKYARD_P2P_BIND", "0.0.0.0:0").strip())
    timeout_s: float = field(default_factory=lambda: float(_env("FORKYARD_P2P_TIMEOUT_S", "5")))
    max_serving: int = field(default_factory=lambda: int(_env("FORKYARD_P2P_MAX_SERVING", "16")))
    max_serving_per_peer: int = field(
        default_factory=lambda: int(_env("FORKYARD_P2P_MAX_SERVING_PER_PEER", "4")))
    slot_wait_s: float = field(default_factory=lambda: float(_env("FORKYARD_P2P_SLOT_WAIT_S", "5")))
    per_peer: int = field(default_factory=lambda: int(_env("FORKYARD_P2P_PER_PEER", "4")))
    peer_mbit: float = field(default_factory=lambda: float(_env("FORKYARD_P2P_PEER_MBIT", "1000")))


@dataclass(frozen=True)
class ControlPlaneSettings:
    """Timings and sizes the control plane and the node agent share, read once at import
    by :mod:`forkyard.cluster.types`, :mod:`forkyard.cluster.scheduler` and
    :mod:`forkyard.cluster.agent` (a process reads its environment once).

    Attributes:
        heartbeat_timeout_s: ``FORKYARD_HEARTBEAT_TIMEOUT_S`` (5): a node silent this long
            gets no new placements, and is declared down when the control plane was
            healthy meanwhile (:mod:`forkyard.cluster.liveness`) (s).
        orphan_move_s: ``FORKYARD_ORPHAN_MOVE_S`` (300): a node silent this long has its
            committed paused sandboxes moved to live nodes without waiting for a call (s).
        volume_takeover_s: ``FORKYARD_VOLUME_TAKEOVER_S`` (300): how long after a node was
            declared down its volume leases go to other nodes (s;
            :mod:`forkyard.cluster.volumes`). A node process that died leaves its
            sandboxes running on its host, still writing to the volumes they mount, until
            the node is back (it stops them then) or the host is gone: restart or fence a
            dead node within this time. 0: at once (a host that dies takes its sandboxes
            with it).
        node_max_sandboxes: ``FORKYARD_NODE_MAX_SANDBOXES`` (unset: what the node's
            admission lets run of the default size): what a node reports as its capacity.
        redis_max_connections: ``FORKYARD_REDIS_MAX_CONNECTIONS`` (64): Redis connections
            one scheduler or gateway process opens at most. Each request holds one at a
            time (a pipeline or script is one command), so 64 covers 300 nodes' 1 Hz
            heartbeats plus hundreds of placements per second at a few ms each; more
            requests at once wait for a connection (back-pressure) instead of failing.
        redis_pool_wait_s: ``FORKYARD_REDIS_POOL_WAIT_S`` (5): longest wait for a free
            connection (s); past it the call fails as "Redis unavailable" (503).
    """

    heartbeat_timeout_s: float = field(default_factory=lambda: float(_env("FORKYARD_HEARTBEAT_TIMEOUT_S", "5")))
    orphan_move_s: float = field(default_factory=lambda: float(_env("FORKYARD_ORPHAN_MOVE_S", "300")))
    volume_takeover_s: float = field(default_factory=lambda: float(_env("FORKYARD_VOLUME_TAKEOVER_S", "300")))
    node_max_sandboxes: int | None = field(
        default_factory=lambda: max(1, int(v)) if (v := _env("FORKYARD_NODE_MAX_SANDBOXES")) else None)
    redis_max_connections: int = field(
        default_factory=lambda: max(1, int(_env("FORKYARD_REDIS_MAX_CONNECTIONS", "64"))))
    redis_pool_wait_s: float = field(default_factory=lambda: float(_env("FORKYARD_REDIS_POOL_WAIT_S", "5")))


@dataclass(frozen=True)
class ControlPlaneEnv:
    """The control plane's credentials and addresses as the environment gives them, each
    variable's text ("" when unset); :mod:`forkyard.cluster.config` checks them (private
    files, lengths, URLs) and says what to fix. Read from ``env`` when given (tests,
    the CLI's options), else the process environment.

    Attributes:
        cluster_secret / cluster_secret_file: ``FORKYARD_CLUSTER_SECRET`` / ``…_FILE``.
        node_key / node_key_file: ``FORKYARD_NODE_KEY`` / ``…_FILE``.
        redis_url: ``FORKYARD_REDIS_URL``; redis_password_file: ``FORKYARD_REDIS_PASSWORD_FILE``.
        scheduler_url: ``FORKYARD_SCHEDULER_URL`` (one or several, comma-separated).
    """

    cluster_secret: str = field(default="", repr=False)
    cluster_secret_file: str = ""
    node_key: str = field(default="", repr=False)
    node_key_file: str = ""
    redis_url: str = field(default="", repr=False)
    redis_password_file: str = ""
    scheduler_url: str = ""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> "ControlPlaneEnv":
        """The values in ``env`` (default: the process environment), stripped."""
        env = os.environ if env is None else env
        get = lambda name: (env.get(name) or "").strip()  # noqa: E731
        return cls(cluster_secret=get("FORKYARD_CLUSTER_SECRET"), cluster_secret_file=get("FORKYARD_CLUSTER_SECRET_FILE"),
                   node_key=get("FORKYARD_NODE_KEY"), node_key_file=get("FORKYARD_NODE_KEY_FILE"),
                   redis_url=get("FORKYARD_REDIS_URL"), redis_password_file=get("FORKYARD_REDIS_PASSWORD_FILE"),
                   scheduler_url=get("FORKYARD_SCHEDULER_URL"))

