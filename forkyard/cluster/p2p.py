"""The cluster's part of the P2P read path (issue 24): who vouches for whom.

A node with ``FORKYARD_P2P=on`` reports its iroh address in every heartbeat
(``report.p2p = {"id": endpoint id, "addrs": ["ip:port", …]}``,
:meth:`forkyard.repository.p2p.ChunkService.address`). The scheduler takes a heartbeat
only with that node's own key (:mod:`.nodekeys`), so the endpoint ids in its node
records are the members'. It answers each P2P node's heartbeat with ``peers``: the
other live members that run P2P, their address and the snapshots whose image they cache
(:func:`peers_of`), each endpoint id for one node only — the first that reported it,
while it beats (:func:`one_per_id`) — and only the addresses :func:`dial_address`
accepts. The node installs that list (:func:`parse_peers`) as the only endpoints it
serves and the ones it asks — the scheduler's word is the membership; no discovery
service, no relay.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import time

from forkyard.cluster.types import NODE_DOWN, NodeInfo
from forkyard.ids import is_name

log = logging.getLogger("forkyard.cluster.p2p")

_ENDPOINT_ID = re.compile(r"[0-9a-f]{64}")
_ADDR = re.compile(r"(\d{1,3}(?:\.\d{1,3}){3}|\[[0-9a-fA-F:.]{2,45}\]):(\d{1,5})")
#: Direct addresses looked at and kept per node; peers listed per answer; snapshots listed per peer.
MAX_ADDRS, MAX_PEERS, MAX_SNAPSHOTS = 16, 256, 1000
_THIS_NET = ipaddress.ip_network("0.0.0.0/8")


def dial_address(a) -> str | None:
    """``a`` in canonical form (``ip:port``, ``[ipv6]:port``) when it is an address a
    member may be dialled at, else None: a port 1-65535 and a unicast IP — not
    multicast, unspecified (``0.0.0.0``, ``::``), "this network" (``0/8``), link-local
    (``169.254/16`` — the cloud metadata address — and ``fe80::/10``; no zone ids),
    broadcast or otherwise reserved (``240/4``, IPv4-mapped IPv6). Loopback passes here;
    a node dials it only when its own endpoint is bound to loopback
    (:meth:`forkyard.repository.p2p.ChunkService.set_peers`)."""
    m = _ADDR.fullmatch(a) if isinstance(a, str) and len(a) <= 64 else None
    if m is None or not 0 < int(m.group(2)) <= 65535:
        return None
    try:
        ip = ipaddress.ip_address(m.group(1).strip("[]"))
    except ValueError:
        return None
    if (ip.version == 6) != m.group(1).startswith("["):
        return None
    if not ip.is_loopback and (ip.is_multicast or ip.is_unspecified or ip.is_link_local or ip.is_reserved
                               or ip in _THIS_NET):
        return None
    return f"[{ip}]:{int(m.group(2))}" if ip.version == 6 else f"{ip}:{int(m.group(2))}"
#: How long the scheduler reuses the peer table it built (s): one Redis read of every
#: node per second per replica at most, whatever the number of P2P nodes.
PEERS_TTL_S = 1.0


def valid_address(p2p) -> dict | None:
    """``report.p2p`` as a node sent it, checked: ``{"id", "addrs"}`` or None when it is
    absent or malformed (a node without P2P, or an unusable report). Of ``addrs`` the
    first :data:`MAX_ADDRS` are looked at and those :func:`dial_address` accepts kept
    (canonical, once each); none left: None."""
    if not isinstance(p2p, dict) or not isinstance(p2p.get("id"), str) or not _ENDPOINT_ID.fullmatch(p2p["id"]):
        return None
    addrs = p2p.get("addrs")
    if not isinstance(addrs, list):
        return None
    addrs = list(dict.fromkeys(d for d in map(dial_address, addrs[:MAX_ADDRS]) if d is not None))
    return {"id": p2p["id"], "addrs": addrs} if addrs else None


def peers_of(nodes: list[NodeInfo], now: float | None = None, limit: int | None = MAX_PEERS) -> list[dict]:
    """The P2P members among ``nodes`` (as the scheduler read them: binding tags
    checked): alive, not declared down, with a valid address. Each ``{"node", "id",
    "addrs", "snapshots"}``, at most ``limit`` (None: all)."""
    now = time.time() if now is None else now
    out = []
    for n in nodes:
        addr = valid_address(n.report.p2p)
        if addr is None or n.status == NODE_DOWN or not n.alive(now):
            continue
        out.append({"node": n.node_id, **addr, "snapshots": list(n.report.cached_snapshots[:MAX_SNAPSHOTS])})
    return out[:limit]


def one_per_id(peers: list[dict], owners: dict[str, str]) -> tuple[list[dict], dict[str, tuple[str, str]]]:
    """``peers`` (:func:`peers_of`) with each endpoint id listed for one node only, and
    the owner changes that takes: ``(kept, {endpoint id: (owner before, owner after)})``
    ("" for none).

    An id stays with the node ``owners`` names while that node still reports it and
    beats (another node claiming it is left out); an id no owner reports goes to its only
    claimant, or to none while several claim it at once; an id nobody reports any more
    is forgotten. A member's endpoint key is made at its start and first shown in its
    own heartbeat, so a claim copied from a peer list always comes second."""
    by_id: dict[str, list[dict]] = {}
    for p in peers:
        by_id.setdefault(p["id"], []).append(p)
    kept, changes = [], {}
    for eid, claims in by_id.items():
        owner = owners.get(eid, "")
        mine = [p for p in claims if p["node"] == owner]
        if mine:
            kept.append(mine[0])
        elif len(claims) == 1:
            kept.append(claims[0])
            changes[eid] = (owner, claims[0]["node"])
        elif owner:
            changes[eid] = (owner, "")
    changes.update({eid: (owner, "") for eid, owner in owners.items() if eid not in by_id})
    return kept, changes


class PeerTable:
    """The scheduler's memo of :func:`peers_of` (rebuilt at most every ``ttl_s``,
    :data:`PEERS_TTL_S`), so heartbeats of P2P nodes cost one node listing per second,
    with each endpoint id vouched for one node only (:func:`one_per_id`; the owners are
    kept in Redis, ``fy:p2powners``, so every scheduler replica vouches alike)."""

    def __init__(self, ttl_s: float = PEERS_TTL_S):
        self.ttl_s = ttl_s
        self._at = -1e9
        self._peers: list[dict] = []
        self._warned: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()

    async def answer(self, store, node_id: str) -> list[dict]:
        """The peers to send ``node_id`` (every P2P member but itself). Heartbeats that
        find the memo old at once wait for one rebuild.

        Raises:
            ClusterStoreUnavailable: Redis failed (the heartbeat answers 503).
        """
        if time.monotonic() - self._at > self.ttl_s:
            async with self._lock:
                if time.monotonic() - self._at > self.ttl_s:
                    self._peers = await self._rebuild(store)
                    self._at = time.monotonic()
        return [p for p in self._peers if p["node"] != node_id]

    async def _rebuild(self, store) -> list[dict]:
        claims = peers_of(await store.nodes(), limit=None)
        kept, changes = one_per_id(claims, await store.p2p_owners())
        for eid, (before, after) in changes.items():
            now = await store.set_p2p_owner(eid, before, after)
            if now != after:  # another scheduler changed it first: its choice stands
                kept = [p for p in kept if p["id"] != eid]
                kept += [p for p in claims if p["id"] == eid and p["node"] == now][:1]
        vouched = {(p["id"], p["node"]) for p in kept}
        for p in claims:
            if (p["id"], p["node"]) not in vouched and (p["id"], p["node"]) not in self._warned:
                if len(self._warned) >= 4096:
                    self._warned.clear()
                self._warned.add((p["id"], p["node"]))
                log.warning("P2P: node %s reports endpoint id %s, which is vouched for another node or claimed "
                            "by several at once: not listed", p["node"], p["id"][:16])
        return kept[:MAX_PEERS]


def parse_peers(raw) -> list:
    """The ``peers`` of a heartbeat answer as :class:`forkyard.repository.p2p.Peer`s
    (malformed entries skipped)."""
    from forkyard.repository.p2p import Peer

    out = []
    for p in raw if isinstance(raw, list) else []:
        addr = valid_address(p) if isinstance(p, dict) else None
        if addr is None or not isinstance(p.get("node"), str):
            continue
        snaps = p.get("snapshots") if isinstance(p.get("snapshots"), list) else []
        out.append(Peer(p["node"][:128], addr["id"], tuple(addr["addrs"]),
                        frozenset(s for s in snaps[:MAX_SNAPSHOTS] if isinstance(s, str) and is_name(s))))
    return out[:MAX_PEERS]


def start_service(snapshots):
    """With ``FORKYARD_P2P=on``: a :class:`forkyard.repository.p2p.ChunkService` over the
    node's snapshot store (its cache and repository), installed as the store's peer
    source; None when P2P is off (nothing is started, nothing imported). Blocking (binds
    the endpoint).

    Raises:
        ValueError: a malformed ``FORKYARD_P2P*`` setting.
        RuntimeError: the endpoint could not be bound.
    """
    from forkyard.config import P2PSettings

    cfg = P2PSettings()
    if not cfg.enabled:
        return None
    if not (0 < cfg.timeout_s <= 600 and 0 < cfg.slot_wait_s <= 600):
        raise ValueError("FORKYARD_P2P_TIMEOUT_S and FORKYARD_P2P_SLOT_WAIT_S must be > 0 and <= 600 (s)")
    if min(cfg.max_serving, cfg.max_serving_per_peer, cfg.per_peer) < 1:
        raise ValueError("FORKYARD_P2P_MAX_SERVING, FORKYARD_P2P_MAX_SERVING_PER_PEER and FORKYARD_P2P_PER_PEER "
                         "must be >= 1")
    if not 0 <= cfg.peer_mbit <= 1_000_000:
        raise ValueError("FORKYARD_P2P_PEER_MBIT must be >= 0 (0: no bound) and <= 1000000 (Mbit/s)")
    from forkyard.repository.p2p import ChunkService

    svc = ChunkService(snapshots.cache, snapshots.repo, bind=cfg.bind, timeout_s=cfg.timeout_s,
                       max_serving=cfg.max_serving, per_peer=cfg.per_peer,
                       serve_per_peer=cfg.max_serving_per_peer, slot_wait_s=cfg.slot_wait_s,
                       serve_bytes_per_s=cfg.peer_mbit * 125_000 or None)
    snapshots.peers = svc
    return svc


def stop_service(snapshots, svc) -> None:
    """Undo :func:`start_service` (no-op for None): restores read the repository only."""
    if svc is not None:
        snapshots.peers = None
        svc.close()
