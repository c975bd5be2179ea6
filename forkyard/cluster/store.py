"""Cluster state in Redis: nodes, sandbox → node bindings, tombstones, placements.

Keys (prefix ``fy:``; every multi-key change is one Lua script, so two schedulers or
gateways acting at once never see half a change):

=============================  ==========================================================
``fy:nodes``                   set of node ids
``fy:node:<id>``               hash: ``url``, ``tag`` (HMAC binding id and url,
                               :mod:`.nodekeys`), ``status`` (up/draining: the operator's),
                               ``last_seen`` (Redis time), ``boot``, ``report`` (JSON
                               :class:`~.types.NodeReport`; ``p2ptag`` tags its P2P id),
                               ``down_at`` while declared down (:mod:`.liveness`; cleared
                               by its next heartbeat), ``grace_until`` after a restart notice
``fy:sbx:<id>``                hash: ``node``, ``state``, ``record`` (JSON), ``updated``,
                               ``committed`` (0 while a paused sandbox's image is not
                               in the shared repository yet: it cannot move)
``fy:epoch``                   Redis time the state was first written: a missing or young
                               one means Redis lost its data (no AOF) and nodes are still
                               publishing theirs again
``fy:sandboxes``               set of every bound sandbox id
``fy:seen``                    sorted set: node id by its last heartbeat (Redis time), so a
                               sweep finds silent nodes without reading every node
``fy:sweeper``                 the scheduler replica that sweeps (a lease, :meth:`ClusterStore.sweep_lease`)
``fy:nodesbx:<node>``          set of the sandbox ids bound to that node
``fy:gone:<id>``               tombstone (7 days) of a sandbox reported gone with its node;
                               the node is told to destroy it if it comes back
``fy:dead:<id>``               why a sandbox died by itself (OOM kill, …) as its node words
                               it (:data:`DEATH_KEEP_S`), for the gateway's 404/502
``fy:placing:<node>``          sorted set of placement ids by time, and
``fy:placingn:<node>``         hash placement id → sandbox count: counted against the node
                               until its heartbeat acknowledges them (the node acks a
                               placement once the request that carried it has ended, so its
                               rows are in that heartbeat's report) or after
                               :data:`PLACING_TTL_S`
``fy:vlease:<volume id>``      the node that holds the volume's lease (mounts it,
                               :mod:`.volumes`); valid while that node is registered and
                               not declared down, and :data:`VOLUME_TAKEOVER_S` after
``fy:vname:<volume name>``     the volume id of that name last leased (placement looks
                               names up)
``fy:p2powners``               hash P2P endpoint id → the node it is vouched for: the
                               first live node that reported it, while it beats
                               (:class:`~.p2p.PeerTable`)
=============================  ==========================================================

Durability is Redis's: run it with ``appendonly yes`` (deploy/ does) so a Redis restart
loses nothing; without it nodes publish everything again at their next heartbeat (the
node is the source of truth). Times are Redis's clock (``TIME``), so host clocks may
disagree. Every method raises :class:`ClusterStoreUnavailable` when Redis cannot be
reached; the HTTP faces answer 503 with that message.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import redis.asyncio as aioredis
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from forkyard.cluster.config import redacted_url
from forkyard.cluster import scripts
from forkyard.cluster.batching import ScriptBatcher
from forkyard.cluster.listing import INDEX_EXISTING, candidate_indexes, choose_index, read_page
from forkyard.cluster.nodekeys import NodeKeys
from forkyard.cluster.rooms import CANDIDATES, RELEASE, RESERVE
from forkyard.config import ControlPlaneSettings
from forkyard.cluster.types import (HEARTBEAT_TIMEOUT_S, NODE_DOWN, NODE_DRAINING, NODE_UP, Binding, NodeInfo,
                                    NodeReport)

log = logging.getLogger("forkyard.cluster.store")

P = "fy:"
TOMBSTONE_S = 7 * 24 * 3600
#: How long the cause of a sandbox's death is kept (s), as on the node
#: (:data:`forkyard.orchestrator.tombstones.KEEP_S`).
DEATH_KEEP_S = 3600
#: Longest cause kept (characters).
DEATH_MAX_CHARS = 300
#: A placement no heartbeat acknowledged stops counting after this long (s): the
#: request never reached the node (gateway died) or was a move, whose adopt is not acked.
PLACING_TTL_S = 30.0
#: How long a node declared down keeps its volume leases (s, ``FORKYARD_VOLUME_TAKEOVER_S``).
VOLUME_TAKEOVER_S = ControlPlaneSettings().volume_takeover_s

class ClusterStoreUnavailable(Exception):
    """Redis did not answer (down, unreachable, or refused the command)."""


def _s(v) -> str:
    return v.decode() if isinstance(v, bytes) else v


#: The fields of a node's hash that :meth:`ClusterStore.nodes` reads without reports.
_LIVENESS_FIELDS = ("url", "status", "down_at", "grace_until", "last_seen", "tag")


def _node_info(node_id: str, row: dict, now: float) -> NodeInfo | None:
    """A node's hash as a :class:`NodeInfo` (``age`` on Redis's clock ``now``); None
    for an empty hash."""
    if not row:
        return None
    row = {_s(k): _s(v) for k, v in row.items()}
    last = float(row.get("last_seen", 0))
    return NodeInfo(node_id=node_id, url=row.get("url", ""),
                    status=NODE_DOWN if "down_at" in row else row.get("status", NODE_UP),
                    last_seen=last, age=now - last, grace_until=float(row.get("grace_until", 0)),
                    report=NodeReport.from_dict(json.loads(row.get("report", "{}"))))


class ClusterStore:
    """Async access to the cluster state in Redis at ``url`` (``redis://host:port/db``).

    Args:
        url: Redis URL (``FORKYARD_REDIS_URL``; a password in it is never shown).
        keys: the control plane's :class:`~.nodekeys.NodeKeys`: node records carry and
            need their binding tag (None: unchecked, for tools and tests of the store).
        timeout_s: socket connect/read timeout (s) for every command.
        max_connections: connections opened at most (default
            ``FORKYARD_REDIS_MAX_CONNECTIONS``, :class:`~forkyard.config.ControlPlaneSettings`);
            a call finding them all busy waits for one, at most ``pool_wait_s`` (default
            ``FORKYARD_REDIS_POOL_WAIT_S``), then raises :class:`ClusterStoreUnavailable`.
    """

    def __init__(self, url: str, timeout_s: float = 2.0, max_connections: int | None = None,
                 pool_wait_s: float | None = None, keys: NodeKeys | None = None):
        self.url = redacted_url(url)  # for messages: never the password
        cfg = ControlPlaneSettings()
        # A bounded pool that makes callers wait (redis-py's default pool raises "Too many
        # connections" past 100). Retry on a dropped connection (a restarted Redis closes
        # every pooled one): up to 3 tries, 50-500 ms apart.
        pool = BlockingConnectionPool.from_url(
            url, max_connections=max_connections or cfg.redis_max_connections,
            timeout=cfg.redis_pool_wait_s if pool_wait_s is None else pool_wait_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s, health_check_interval=5,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
            retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._r = aioredis.Redis.from_pool(pool)
        self._upsert = self._r.register_script(scripts.UPSERT)
        self._delete = self._r.register_script(scripts.DELETE)
        self._rebind = self._r.register_script(scripts.REBIND)
        self._mark_down = self._r.register_script(scripts.MARK_DOWN)
        self._heartbeat = ScriptBatcher(self._r, self._r.register_script(scripts.HEARTBEAT))
        self._pending = self._r.register_script(scripts.PENDING)
        self._reserve = self._r.register_script(RESERVE)
        self._index_existing = self._r.register_script(INDEX_EXISTING)
        self._redigest = self._r.register_script(scripts.REDIGEST)
        self._sweep_lease = self._r.register_script(scripts.SWEEP_LEASE)
        self._indexed = False
        self._release = self._r.register_script(RELEASE)
        self._vacquire = self._r.register_script(scripts.VOLUME_ACQUIRE)
        self._vrelease = self._r.register_script(scripts.VOLUME_RELEASE)
        self._vholders = self._r.register_script(scripts.VOLUME_HOLDERS)
        self._p2p_owner = self._r.register_script(scripts.P2P_OWNER)
        #: set by the scheduler and gateway (the master): node records are then written
        #: with their binding tag and read only when it checks (:mod:`.nodekeys`)
        self.keys: NodeKeys | None = keys
        self._untrusted_logged: dict[str, float] = {}

    def _untrusted(self, node_id: str, url: str) -> None:
        """A node record whose binding tag does not check (written by someone without
        the master): ignored; logged once a minute per node."""
        if time.monotonic() - self._untrusted_logged.get(node_id, -60.0) >= 60:
            self._untrusted_logged[node_id] = time.monotonic()
            log.warning("ignoring node record %s -> %s in Redis: its binding tag does not check (not written by "
                        "a scheduler for a heartbeat signed with that node's key)", node_id, url[:200])

    def _info(self, node_id: str, row: dict, now: float) -> NodeInfo | None:
        """:func:`_node_info`, and None for a record whose binding tag does not check
        when this store holds the :attr:`keys` (:meth:`_untrusted`)."""
        n = _node_info(node_id, row, now)
        if n is not None and self.keys is not None and not self.keys.tag_ok(node_id, n.url, _s(row.get(b"tag"))):
            self._untrusted(node_id, n.url)
            return None
        if n is not None and self.keys is not None and isinstance(p2p := n.report.p2p, dict) and not \
                self.keys.p2p_tag_ok(node_id, str(p2p.get("id")), _s(row.get(b"p2ptag"))):
            n.report.p2p = None  # an endpoint id no scheduler wrote for this node: not vouched for
        return n

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._r.aclose()

    async def _call(self, coro):
        try:
            return await coro
        except (RedisError, OSError) as e:
            raise ClusterStoreUnavailable(f"cluster state store (Redis at {self.url}) unavailable: {e}") from e

    async def ping(self) -> bool:
        """True when Redis answers."""
        try:
            return bool(await self._r.ping())
        except (RedisError, OSError):
            return False

    # ---- P2P endpoint ids (.p2p) -----------------------------------------------------
    async def p2p_owners(self) -> dict[str, str]:
        """``{endpoint id: node id}``: the node each P2P endpoint id is vouched for (one
        entry per id a live P2P node reports: bounded by the fleet)."""
        raw = await self._call(self._r.hgetall(f"{P}p2powners"))
        return {_s(k): _s(v) for k, v in raw.items()}

    async def set_p2p_owner(self, endpoint_id: str, expected: str, new: str) -> str:
        """Vouch ``endpoint_id`` for node ``new`` ("": for none) if it is still vouched for
        ``expected`` ("": none); returns the owner after (another scheduler may have
        changed it first)."""
        return _s(await self._call(self._p2p_owner(keys=[f"{P}p2powners"], args=[endpoint_id, expected, new])))

    # ---- nodes ----------------------------------------------------------------------
    async def now(self) -> float:
        """Redis's clock (UNIX s): the one clock every liveness judgement uses."""
        sec, usec = await self._call(self._r.time())
        return int(sec) + int(usec) / 1e6

    async def heartbeat(self, node_id: str, url: str, report: NodeReport, now: float | None = None,
                        own_status: str = NODE_UP, acked: list[str] = (), digests: dict | None = None) -> str:
        """Record a heartbeat, stamped with Redis's clock (``now`` overrides it: tests).
        The node is heard, so it is no longer declared down; its status (``up`` or
        ``draining``) is the operator's, or ``own_status`` (the node's own view) when
        the node is not registered (new, or Redis lost its data). The placements in
        ``acked`` stop counting (the report shows their sandboxes) and the node's room is
        indexed again (:mod:`.rooms`), all in one script (pipelined with other nodes'
        heartbeats that arrive within a few ms: :mod:`.batching`). Returns the status;
        ``digests[node_id]`` (a dict given) is set to the node's binding-set digest."""
        p2p = report.p2p  # its endpoint id is tagged too (nodekeys.NodeKeys.p2p_tag), checked by _info
        p2ptag = self.keys.p2p_tag(node_id, str(p2p.get("id"))) if self.keys and isinstance(p2p, dict) else ""
        status, was_down, digest = await self._call(self._heartbeat.call(
            keys=[f"{P}nodes", f"{P}node:{node_id}"],
            args=[node_id, url, json.dumps(report.to_dict()), report.boot,
                  own_status if own_status in (NODE_UP, NODE_DRAINING) else NODE_UP,
                  "" if now is None else repr(now), repr(HEARTBEAT_TIMEOUT_S), repr(PLACING_TTL_S),
                  self.keys.tag(node_id, url) if self.keys else "", p2ptag, *acked]))
        if int(was_down):
            log.warning("node %s is heard again after it was declared down", node_id)
        if digests is not None:
            digests[node_id] = _s(digest)
        return _s(status)

    async def sweep_lease(self, replica: str, ttl_s: float) -> tuple[bool, float, bool]:
        """Take or renew the sweeper lease for ``replica`` (held ``ttl_s`` s past this
        call; another replica takes it over once it lapses), and record the epoch
        (:meth:`ensure_epoch`'s key) — one script (:data:`.scripts.SWEEP_LEASE`).

        Returns:
            ``(held, Redis time s, full)``: ``full`` (only when held) is whether some
            node has been silent past the heartbeat timeout or is not in the silence
            index, i.e. whether the sweep must read the nodes at all.

        Raises:
            ClusterStoreUnavailable: Redis failed.
        """
        held, sec, usec, full = await self._call(self._sweep_lease(
            keys=[f"{P}sweeper", f"{P}epoch", f"{P}seen", f"{P}nodes"],
            args=[replica, str(max(1, int(ttl_s * 1000))), repr(HEARTBEAT_TIMEOUT_S)]))
        return bool(int(held)), int(sec) + int(usec) / 1e6, bool(int(full))

    @property
    def indexed(self) -> bool:
        """Whether :meth:`ensure_epoch` has indexed old bindings in this process."""
        return self._indexed

    async def redigest(self, node_id: str) -> str:
        """Recompute the digest of ``node_id``'s binding set from the set itself
        (O(its sandboxes); after a full reconcile). Returns it."""
        return _s(await self._call(self._redigest(keys=[f"{P}nodesbx:{node_id}"], args=[node_id])))

    async def nodes(self, reports: bool = True) -> list[NodeInfo]:
        """Every registered node, sorted by id, each with its heartbeat age on Redis's
        clock; ``status`` is ``down`` while declared down (:meth:`mark_down`). Without
        ``reports`` each node's :attr:`~.types.NodeInfo.report` is left empty (its
        liveness fields and binding tag only: what the sweep needs, without reading and
        decoding every report)."""
        ids = sorted(_s(x) for x in await self._call(self._r.smembers(f"{P}nodes")))
        async with self._r.pipeline(transaction=False) as p:
            p.time()
            for nid in ids:
                if reports:
                    p.hgetall(f"{P}node:{nid}")
                else:
                    p.hmget(f"{P}node:{nid}", *_LIVENESS_FIELDS)
            rows = await self._call(p.execute())
        sec, usec = rows[0]
        now = int(sec) + int(usec) / 1e6
        if not reports:
            rows[1:] = [{k.encode(): v for k, v in zip(_LIVENESS_FIELDS, row) if v is not None} for row in rows[1:]]
        return [n for n in (self._info(nid, row, now) for nid, row in zip(ids, rows[1:])) if n is not None]

    async def node(self, node_id: str) -> NodeInfo | None:
        """One node or None (two reads, whatever the fleet's size)."""
        async with self._r.pipeline(transaction=False) as p:
            p.time()
            p.hgetall(f"{P}node:{node_id}")
            (sec, usec), row = await self._call(p.execute())
        return self._info(node_id, row, int(sec) + int(usec) / 1e6)

    async def candidates(self, k: int = CANDIDATES, snapshot_id: str | None = None, also: list[str] = ()
                         ) -> tuple[list[NodeInfo], dict[str, int], float, int]:
        """The ``k`` best-scored nodes that can take a sandbox (the ``fy:place`` index,
        :mod:`.rooms`), up to ``k`` nodes whose cache holds ``snapshot_id``, and the
        nodes in ``also`` (a fork's source): a constant number of reads whatever the
        fleet's size. Returns ``(nodes, placing by node id, Redis time, nodes indexed)``;
        the nodes may be full or silent by now (the reservation checks again)."""
        async with self._r.pipeline(transaction=False) as p:
            p.time()
            p.zrange(f"{P}place", 0, k - 1)
            p.zcard(f"{P}place")
            if snapshot_id:
                p.srandmember(f"{P}snapnodes:{snapshot_id}", k)
            got = await self._call(p.execute())
        (sec, usec), best, total = got[0], got[1], int(got[2])
        ids = list(dict.fromkeys([_s(x) for x in best] + [_s(x) for x in (got[3] if snapshot_id else [])]
                                 + [x for x in also if x]))
        async with self._r.pipeline(transaction=False) as p:
            for nid in ids:
                p.hgetall(f"{P}node:{nid}")
            rows = await self._call(p.execute())
        now = int(sec) + int(usec) / 1e6
        nodes, placing = [], {}
        for nid, row in zip(ids, rows):
            if (n := self._info(nid, row, now)) is not None:
                nodes.append(n)
                placing[nid] = int(_s(row.get(b"placing") or b"0"))
        return nodes, placing, now, total

    async def reserve(self, plan: list[tuple[str, int]], placement_id: str | None = None,
                      force: bool = False, now: float | None = None) -> tuple[str | None, str, int]:
        """Take room for ``plan`` (``[(node id, sandboxes), …]``) atomically: only if
        every node in it is up, heard within the heartbeat timeout and has room for its
        count (``max_sandboxes − running − placing``), on all of them at once (one Lua
        script, :data:`.rooms.RESERVE`). ``force`` skips the checks and ``now`` stamps
        the placement at that time (tests). Returns ``(placement id, "", 0)`` (16 hex
        chars; the requests to the nodes carry it and each node acknowledges it in a
        heartbeat) or ``(None, node id, its free room)`` for the first node without room."""
        pid = placement_id or secrets.token_hex(8)
        args = [repr(HEARTBEAT_TIMEOUT_S), repr(PLACING_TTL_S), pid, "" if now is None else repr(now),
                "1" if force else "0"]
        for nid, n in plan:
            args += [nid, int(n)]
        res = await self._call(self._reserve(args=args))
        if int(res[0]):
            return pid, "", 0
        return None, _s(res[1]), int(res[2])

    async def release(self, node_id: str, placement_ids: list[str] = ()) -> int:
        """Stop counting ``placement_ids`` on ``node_id`` (acknowledged, or a placement
        given back) and index its room again. Returns its free room (-1: the node cannot
        take sandboxes now)."""
        return int(await self._call(self._release(
            args=[repr(HEARTBEAT_TIMEOUT_S), repr(PLACING_TTL_S), node_id, *placement_ids])))

    async def announce_restart(self, node_id: str, grace_s: float) -> bool:
        """The node is restarting (stopped with SIGTERM; its sandboxes keep running): it
        is not declared down for ``grace_s`` s from now (Redis time) — cleared by its next
        heartbeat. False when the node is not registered."""
        if not await self._call(self._r.sismember(f"{P}nodes", node_id)):
            return False
        await self._call(self._r.hset(f"{P}node:{node_id}", "grace_until", repr(await self.now() + grace_s)))
        return True

    async def set_status(self, node_id: str, status: str) -> bool:
        """Set a registered node's status (``draining`` or ``up``); False when unknown."""
        if not await self._call(self._r.sismember(f"{P}nodes", node_id)):
            return False
        await self._call(self._r.hset(f"{P}node:{node_id}", "status", status))
        await self.release(node_id)  # in or out of the placement index at once
        return True

    async def mark_down(self, node_id: str, healthy_since: float, timeout_s: float) -> list[str] | None:
        """Declare ``node_id`` down if it has been silent for more than ``timeout_s``
        counted from the later of its last heartbeat and ``healthy_since`` (Redis time;
        :class:`~.liveness.Liveness`), checked atomically on Redis's clock; the bindings
        of its sandboxes that are not paused become tombstones. Returns their ids, or
        None when the node was heard meanwhile (nothing changed)."""
        why = (f"its node {node_id} stopped sending heartbeats and was declared down at "
               f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}")
        res = [_s(x) for x in await self._call(self._mark_down(
            keys=[f"{P}node:{node_id}", f"{P}nodesbx:{node_id}", f"{P}sandboxes"],
            args=[P, repr(healthy_since), repr(timeout_s), TOMBSTONE_S, DEATH_KEEP_S, why]))]
        return None if res[0] == "heard" else res[1:]

    async def ensure_epoch(self) -> None:
        """Record when this state began (``fy:epoch``, Redis time) unless already set;
        the first time in this process, also index bindings written before the list
        indexes existed (:mod:`.listing`; O(bindings) once, nothing for indexed ones)."""
        await self._call(self._r.set(f"{P}epoch", repr(await self.now()), nx=True))
        if not self._indexed:
            cursor, n = 0, 0
            while True:
                cursor, ids = await self._call(self._r.sscan(f"{P}sandboxes", cursor, count=500))
                if ids:
                    n += int(await self._call(self._index_existing(args=[_s(x) for x in ids])))
                if not int(cursor):
                    break
            if n:
                log.info("indexed %d sandbox binding(s) written before the list indexes", n)
            self._indexed = True

    async def state_age(self) -> float | None:
        """Seconds since the state began (:meth:`ensure_epoch`); None when unknown (Redis
        lost its data and no scheduler has written since)."""
        async with self._r.pipeline(transaction=False) as p:
            p.time()
            p.get(f"{P}epoch")
            (sec, usec), epoch = await self._call(p.execute())
        if epoch is None:
            return None
        return int(sec) + int(usec) / 1e6 - float(_s(epoch))

    async def add_placing(self, node_id: str, n: int = 1, now: float | None = None) -> str:
        """Count ``n`` sandboxes placed onto ``node_id`` without checking its room (a
        move, tests; placements use :meth:`reserve`) until the node acknowledges the
        placement (:meth:`ack_placing`) or :data:`PLACING_TTL_S` passes. Returns the
        placement id (16 hex chars) the request to the node carries."""
        pid, _, _ = await self.reserve([(node_id, n)], force=True, now=now)
        return pid

    async def ack_placing(self, node_id: str, placement_ids: list[str]) -> None:
        """Stop counting placements the node has acknowledged (their rows are in the
        report it just sent; :meth:`heartbeat` does this itself with ``acked``)."""
        if placement_ids:
            await self.release(node_id, placement_ids)

    async def pending_placements(self, node_ids: list[str], now: float | None = None) -> dict[str, int]:
        """Sandboxes placed onto each node that its reports may not show yet."""
        now = await self.now() if now is None else now
        cutoff = repr(now - PLACING_TTL_S)
        out = {}
        for nid in node_ids:
            out[nid] = int(await self._call(self._pending(keys=[f"{P}placing:{nid}", f"{P}placingn:{nid}"],
                                                          args=[cutoff])))
        return out

    # ---- bindings -------------------------------------------------------------------
    async def binding(self, sandbox_id: str) -> Binding | None:
        """The binding of ``sandbox_id`` or None."""
        row = await self._call(self._r.hgetall(f"{P}sbx:{sandbox_id}"))
        return self._binding(sandbox_id, row)

    @staticmethod
    def _binding(sandbox_id: str, row) -> Binding | None:
        if not row:
            return None
        row = {_s(k): _s(v) for k, v in row.items()}
        return Binding(sandbox_id=sandbox_id, node_id=row.get("node", ""), state=row.get("state", ""),
                       record=json.loads(row.get("record", "{}")), updated=float(row.get("updated", 0)),
                       committed=row.get("committed") != "0")

    async def bindings(self) -> list[Binding]:
        """Every binding (one pipelined read)."""
        ids = [_s(x) for x in await self._call(self._r.smembers(f"{P}sandboxes"))]
        async with self._r.pipeline(transaction=False) as p:
            for sid in ids:
                p.hgetall(f"{P}sbx:{sid}")
            rows = await self._call(p.execute())
        return [b for b in (self._binding(sid, row) for sid, row in zip(ids, rows)) if b is not None]

    async def page(self, states: set[str], want: dict[str, str], template: str | None, after: float | None,
                   before: float | None, desc: bool, cursor: tuple[float, str] | None, limit: int, accept
                   ) -> tuple[list[tuple[float, str, dict]], bool]:
        """One page of bindings from the list indexes (:mod:`.listing`): the most
        selective index the filters name (``states`` ⊆ {running, paused}, metadata pairs
        ``want``, ``template``), walked from ``cursor`` on within the start-time bounds;
        ``accept(row)`` checks each binding's hash against every filter. Returns
        ``([(started_at, id, row), …], more)`` (:func:`.listing.read_page`)."""
        keys = candidate_indexes(states, want, template)
        async with self._r.pipeline(transaction=False) as p:
            for k in keys:
                p.zcard(k)
            sizes = dict(zip(keys, await self._call(p.execute())))
        return await self._call(read_page(self._r, choose_index(states, want, template, sizes), desc, after,
                                          before, cursor, limit, accept))

    async def counts(self) -> dict[str, int]:
        """Bound sandboxes by visible state (``running``, ``paused``): two ``ZCARD``s."""
        async with self._r.pipeline(transaction=False) as p:
            p.zcard(f"{P}ix:s:running")
            p.zcard(f"{P}ix:s:paused")
            running, paused = await self._call(p.execute())
        return {"running": int(running), "paused": int(paused)}

    async def node_sandboxes(self, node_id: str) -> set[str]:
        """Ids bound to ``node_id``."""
        return {_s(x) for x in await self._call(self._r.smembers(f"{P}nodesbx:{node_id}"))}

    async def publish(self, node_id: str, records: list[dict], deleted: list[str],
                      now: float | None = None, deaths: dict[str, str] | None = None) -> list[str]:
        """Apply a node's changes: upsert the bindings of ``records`` (node records as
        dicts, ``id`` and ``state`` keys; ``committed: false`` on a paused one whose
        image is not in the repository yet) and drop those of ``deleted`` — each only if
        the sandbox is not bound to another node or tombstoned — keeping the causes in
        ``deaths`` (``{id: "it was killed: …"}``, see :meth:`death`). Returns the ids the
        node must drop (bound elsewhere, or reported gone)."""
        now = time.time() if now is None else now
        if deaths:
            async with self._r.pipeline(transaction=False) as p:
                for sid, why in deaths.items():
                    p.set(f"{P}dead:{sid}", why[:DEATH_MAX_CHARS], ex=DEATH_KEEP_S)
                await self._call(p.execute())
        if not records and not deleted:
            return []
        # One round trip: each change is its own script (atomic), pipelined.
        async with self._r.pipeline(transaction=False) as p:
            for rec in records:
                sid = rec["id"]
                await self._upsert(keys=[f"{P}sbx:{sid}", f"{P}gone:{sid}", f"{P}nodesbx:{node_id}", f"{P}sandboxes"],
                                   args=[node_id, rec["state"], json.dumps(rec), repr(now), sid,
                                         "0" if rec.get("committed") is False else "1"], client=p)
            for sid in deleted:
                await self._delete(keys=[f"{P}sbx:{sid}", f"{P}nodesbx:{node_id}", f"{P}sandboxes"],
                                   args=[node_id, sid], client=p)
            res = await self._call(p.execute())
        return [rec["id"] for rec, ok in zip(records, res) if not ok]

    async def reconcile(self, node_id: str, held: set[str], paused: set[str] = frozenset()
                        ) -> tuple[list[str], list[str], list[dict]]:
        """Compare what the node holds (``paused``: those of ``held`` it holds paused)
        with its bindings. Returns ``(foreign, missing, adopt)``: held ids bound
        elsewhere or tombstoned (the node drops them: a running one is stopped), held ids
        with no binding at all (the node publishes them again), and the records of
        paused sandboxes moved to this node (:meth:`rebind`) that it has not adopted yet
        (it adopts them: a move whose adopt never came must not lose the sandbox).
        A tombstoned sandbox the node holds *paused* (it was paused while the node was
        cut off, after it had been reported gone) is kept: its tombstone goes and the node
        publishes it again — dropping it would destroy a paused sandbox, which nothing
        requires. Other bindings of this node that it no longer holds are removed."""
        bound = await self.node_sandboxes(node_id)
        adopt: list[dict] = []
        for sid in sorted(bound - held):
            moved, record = await self._call(self._r.hmget(f"{P}sbx:{sid}", "moved", "record"))
            if moved is not None and record is not None:
                adopt.append(json.loads(_s(record)))
                continue
            await self._call(self._delete(keys=[f"{P}sbx:{sid}", f"{P}nodesbx:{node_id}", f"{P}sandboxes"],
                                          args=[node_id, sid]))
        unknown = sorted(held - bound)
        foreign, missing = [], []
        if unknown:
            async with self._r.pipeline(transaction=False) as p:
                for sid in unknown:
                    p.exists(f"{P}gone:{sid}")
                    p.hget(f"{P}sbx:{sid}", "node")
                res = await self._call(p.execute())
            for i, sid in enumerate(unknown):
                gone, owner = res[2 * i], res[2 * i + 1]
                if gone and not owner and sid in paused:
                    await self._call(self._r.delete(f"{P}gone:{sid}", f"{P}dead:{sid}"))
                    log.warning("sandbox %s was reported gone with node %s, which holds it paused: kept", sid, node_id)
                    gone = 0
                (foreign if gone or (owner and _s(owner) != node_id) else missing).append(sid)
        return foreign, missing, adopt

    async def rebind(self, sandbox_id: str, from_node: str, to_node: str, now: float | None = None) -> bool:
        """Move a *paused* sandbox's binding from ``from_node`` to ``to_node``
        atomically; False when it is no longer paused on ``from_node`` (someone else
        moved or resumed it first)."""
        now = time.time() if now is None else now
        return bool(await self._call(self._rebind(
            keys=[f"{P}sbx:{sandbox_id}", f"{P}nodesbx:{from_node}", f"{P}nodesbx:{to_node}"],
            args=[from_node, to_node, sandbox_id, repr(now)])))

    async def death(self, sandbox_id: str) -> str | None:
        """Why ``sandbox_id`` died by itself (``"it was killed: out of memory (limit 512
        MiB), at …"``), if its node said so within :data:`DEATH_KEEP_S`; else None."""
        got = await self._call(self._r.get(f"{P}dead:{sandbox_id}"))
        return _s(got) if got is not None else None

    async def is_gone(self, sandbox_id: str) -> bool:
        """True when the sandbox was reported gone with its node (tombstone)."""
        return bool(await self._call(self._r.exists(f"{P}gone:{sandbox_id}")))

    # ---- volume leases (:mod:`.volumes`) ---------------------------------------------
    async def volume_acquire(self, node_id: str, volume_id: str, name: str) -> tuple[bool, str]:
        """Grant ``node_id`` the lease of ``volume_id`` (named ``name``) unless another
        node holds it (a node declared down holds its leases for
        :attr:`~forkyard.config.ControlPlaneSettings.volume_takeover_s` more), atomically.
        Returns ``(True, node_id)``, ``(False, holder)``, or ``(False, "")`` when
        ``node_id`` is not registered or is declared down."""
        status, holder = await self._call(self._vacquire(
            keys=[f"{P}vlease:{volume_id}", f"{P}node:{node_id}"],
            args=[P, node_id, volume_id, name, repr(VOLUME_TAKEOVER_S)]))
        return _s(status) == "ok", _s(holder)

    async def volume_release(self, node_id: str, volume_id: str) -> bool:
        """Drop ``volume_id``'s lease if ``node_id`` holds it; True if it did."""
        return bool(await self._call(self._vrelease(keys=[f"{P}vlease:{volume_id}"], args=[node_id])))

    async def volume_holders(self, ids: list[str] = (), names: list[str] = ()) -> list[str]:
        """The holder of each volume of ``ids``, then of each of ``names`` (``""``: none;
        as :meth:`volume_acquire` judges it), one atomic read."""
        items = [f"i:{v}" for v in ids] + [f"n:{v}" for v in names]
        if not items:
            return []
        return [_s(x) for x in await self._call(self._vholders(args=[P, repr(VOLUME_TAKEOVER_S), *items]))]
