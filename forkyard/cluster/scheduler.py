"""``forkyard scheduler`` (:9090): node registry, placement and sandbox bindings.

Stateless itself — everything lives in Redis (:class:`~.store.ClusterStore`), so a
restart loses nothing and two replicas can run at once: bindings change only through
atomic scripts (a paused sandbox is moved to one node, never two), and placements are
counted in Redis until the chosen node acknowledges them in a heartbeat whose report
shows their sandboxes (a placement made while a report was in flight is never lost).
Nodes are declared down only on evidence about them (:mod:`.liveness`): never because
Redis or the scheduler itself was away.

HTTP API (JSON; every route but ``/health`` needs the cluster secret header, except a
node's own calls (heartbeat and its stream, publish, restarting, volume leases), which need its key and the URL
it is bound to instead, :mod:`.nodekeys`):

* ``POST /v1/nodes/{id}/heartbeat`` ``{url, status, report, digest, [held, paused,] placements}`` → ``{status, foreign, missing, adopt[, resend][, peers]}``
  (without ``held``: nothing changed on the node since its last full heartbeat; ``resend``:
  the bindings differ from its digest, send the ids; ``peers``: only to a node reporting a
  P2P address, the other P2P members, :mod:`.p2p`)
* ``POST /v1/nodes/{id}/publish`` ``{records, deleted, deaths}`` → ``{foreign}``
* ``POST /v1/nodes/{id}/restarting`` ``{graceS}``: the node stops for a restart
* ``POST /v1/nodes/{id}/volumes/{volumeID}/lease`` ``{name}`` → ``{granted, holder, message}``
  and ``…/release`` → ``{released}``: the node's volume leases (:mod:`.volumes`)
* ``GET /v1/nodes`` → node list; ``POST /v1/nodes/{id}/drain`` | ``/undrain``
* ``POST /v1/placements`` ``{kind: create|fork|resume, …}`` → ``{placements: [{nodeID, url, count, placementID}]}``
* ``GET /v1/sandboxes/{id}`` → the binding
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from typing import Annotated
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

import httpx

from forkyard.cluster.beats import LeanHeartbeats, refuse_upgrade
from forkyard.cluster.p2p import PeerTable
from forkyard.cluster.config import SECRET_HEADER, secret_ok
from forkyard.cluster.nodekeys import NODE_KEY_PREFIX, NODE_URL_HEADER, NodeKeys
from forkyard.cluster.leanroute import LeanRoute, error_response
from forkyard.cluster.liveness import PROBE_TIMEOUT_S, Liveness
from forkyard.cluster.placement import NoCapacity, place
from forkyard.cluster.rooms import CANDIDATES
from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable
from forkyard.cluster.types import NODE_DOWN, NODE_DRAINING, NODE_UP, NodeInfo
from forkyard.cluster.view import CandidateView
from forkyard.config import ControlPlaneSettings
from forkyard.ids import is_name
from forkyard.obs import metrics
from forkyard.relay.paths import path_problem

log = logging.getLogger("forkyard.scheduler")

#: Largest request body the scheduler reads (bytes): a heartbeat of a node holding many
#: thousands of sandboxes fits.
MAX_BODY = 8 << 20
#: A node's own calls, authenticated with its key (:mod:`.nodekeys`): node id, call.
_NODE_ROUTE = re.compile(r"^/v1/nodes/([^/]+)/(heartbeat|beats|publish|restarting|volumes/[^/]+/(?:lease|release))$")


class Publish(BaseModel):
    records: list[dict] = Field(default_factory=list, max_length=10_000)
    deleted: list[str] = Field(default_factory=list, max_length=10_000)
    #: why deleted sandboxes died by themselves (``{id: "it was killed: …"}``)
    deaths: dict[str, str] = Field(default_factory=dict, max_length=10_000)


class Restarting(BaseModel):
    #: how long (s) the node may take to be back before it is declared down
    grace_s: float = Field(alias="graceS", ge=0, le=3600)


class PlacementRequest(BaseModel):
    kind: str = Field(pattern="^(create|fork|resume)$")
    count: int = Field(default=1, ge=1, le=100)
    vcpus: int = Field(default=2, ge=1, le=64)
    snapshot: str | None = Field(default=None, max_length=128)
    sandbox_id: str | None = Field(default=None, alias="sandboxID", max_length=64)
    #: Nodes not to place on (a create that these nodes refused for capacity).
    exclude: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=64)
    #: resume: the caller could not reach the sandbox's node; the scheduler checks that
    #: itself (the node's /health) before moving a paused sandbox off a node that is
    #: not declared down
    unreachable: bool = False
    #: create: names of the volumes the sandbox mounts (it goes where they are held)
    volumes: list[Annotated[str, Field(max_length=64)]] = Field(default_factory=list, max_length=16)


class LeaseBody(BaseModel):
    name: str = Field(min_length=1, max_length=64)


class _Guard:
    """ASGI middleware: a path the gateway and nodes would refuse is refused here too
    (:func:`forkyard.relay.paths.path_problem`, 400: one rule on every hop, issue 25), the
    credential is checked from the headers before any body is read (``/health``
    excepted: the cluster secret; a node's own calls: that node's key for the URL it sends,
    :mod:`.nodekeys`), and bodies over :data:`MAX_BODY` are refused. Refused node calls
    are logged once a minute per node id."""

    def __init__(self, app, secret: str):
        self.app, self.secret, self.keys = app, secret, NodeKeys(secret)
        self._logged: dict[str, float] = {}

    def _log_refused(self, node_id: str, call: str, why: str) -> None:
        now = time.monotonic()
        if now - self._logged.get(node_id, -60.0) < 60:
            return
        if len(self._logged) > 1000:  # ids come from the caller: keep the table bounded
            self._logged.clear()
        self._logged[node_id] = now
        log.warning("refused %s for node %s: %s", call, node_id[:100], why)

    def refusal(self, scope, headers: dict[str, str]) -> JSONResponse | None:
        """The answer refusing an HTTP request (path, credential, announced length), or
        None to let it in; ``headers``: the request's, names lower-case."""
        if problem := path_problem(scope):
            return error_response(400, problem)
        if scope["path"] == "/health":
            return None
        if m := _NODE_ROUTE.match(scope["path"]):  # a node's own calls: its key, never the master
            if bad := self.keys.check(m.group(1), headers.get(NODE_URL_HEADER), headers.get(SECRET_HEADER)):
                self._log_refused(m.group(1), m.group(2), bad[1])
                return error_response(*bad)
        elif not secret_ok(headers, self.secret):
            got = headers.get(SECRET_HEADER, "")
            if got.startswith(NODE_KEY_PREFIX):
                return error_response(403, "a node key is accepted only on that node's own calls (heartbeat, "
                                      "heartbeat stream, publish, restarting, volume lease and release)")
            return error_response(401, "missing or wrong cluster secret (x-forkyard-cluster-secret)")
        length = headers.get("content-length", "0")
        if not length.isdigit() or int(length) > MAX_BODY:
            return error_response(413, f"body over {MAX_BODY} bytes or without Content-Length")
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (bad := self.refusal(scope, headers)) is not None:
            if scope["type"] == "websocket":  # (a WebSocket route behind the guard is guarded too)
                if (await receive())["type"] == "websocket.connect":
                    await refuse_upgrade(scope, send, bad)
                return None
            return await bad(scope, receive, send)
        return await self.app(scope, receive, send)


#: A node silent this long (s, ``FORKYARD_ORPHAN_MOVE_S``) has its paused sandboxes moved
#: to live nodes without waiting for a call, so their retention (which runs on the owning
#: node) and GC go on; a node back sooner keeps them (a restart loses nothing).
ORPHAN_MOVE_S = ControlPlaneSettings().orphan_move_s


async def move_orphans(store: ClusterStore, node_id: str, all_nodes: list, now: float) -> list[str]:
    """Rebind every paused sandbox of down node ``node_id`` whose image is committed to a
    live node (placement as for a resume, with snapshot locality; the target adopts it
    at its next heartbeat). Returns the moved ids; those with no node to go to stay
    (retried next sweep), those whose image is only on the down node stay bound to it."""
    moved = []
    for sid in sorted(await store.node_sandboxes(node_id)):
        b = await store.binding(sid)
        if b is None or b.state != "paused" or b.node_id != node_id or not b.committed:
            continue
        try:
            target = place(all_nodes, {}, now, snapshot_id=b.record.get("image_id"), exclude={node_id})[0][0]
        except NoCapacity:
            break
        if await store.rebind(sid, node_id, target.node_id):
            moved.append(sid)
            log.info("sandbox %s moves from down node %s to node %s", sid, node_id, target.node_id)
    return moved


#: How long a replica's sweeper lease outlives its last renewal (s): a replica that
#: died or stalled this long hands the sweep to another (each renews every sweep).
SWEEP_LEASE_S = 3.0


async def sweep_once(store: ClusterStore, live: Liveness, probe=None, replica: str | None = None) -> list[str]:
    """One sweep (:mod:`forkyard.cluster.liveness`): read Redis's clock and every node,
    declare down the nodes silent past the timeout while this replica was watching that
    do not answer ``probe`` either (``async probe(url) -> bool``: their ``/health``;
    None: not asked), tombstoning their running sandboxes (nothing is destroyed), and
    move the paused sandboxes of nodes down longer than :data:`ORPHAN_MOVE_S`. Returns
    the ids of the nodes declared down now.

    With ``replica`` (a scheduler replica's id) only the holder of the sweeper lease
    (:meth:`ClusterStore.sweep_lease`, :data:`SWEEP_LEASE_S`) sweeps; the others only
    tick ``live`` with Redis's clock, so their view is trusted at once if they take the
    lease over. The holder reads the nodes only when the silence index says some node
    is silent (or not indexed): with every node heard, a sweep is one script.

    Raises:
        ClusterStoreUnavailable: Redis failed (the caller ticks ``live`` with None).
    """
    if replica is None:
        held, redis_now, full = True, await store.now(), True
    else:
        held, redis_now, full = await store.sweep_lease(replica, SWEEP_LEASE_S)
    live.tick(redis_now)
    try:
        if not held or (not full and store.indexed):  # another replica sweeps, or nothing to read
            return []
        return await _sweep(store, live, probe, redis_now)
    finally:
        live.done()


_answering: dict[str, float] = {}  # node id -> when "silent but answers" was last logged


async def _sweep(store: ClusterStore, live: Liveness, probe, redis_now: float) -> list[str]:
    await store.ensure_epoch()
    all_nodes = await store.nodes(reports=False)  # liveness only: the reports are read when placing orphans
    verdict = live.judge(all_nodes, redis_now)
    by_id = {n.node_id: n for n in all_nodes}
    if verdict.declare and probe is not None:
        fresh = [nid for nid in verdict.declare if by_id[nid].status != NODE_DOWN]
        answers = dict(zip(fresh, await asyncio.gather(*(probe(by_id[nid].url) for nid in fresh))))
        for nid, alive in answers.items():
            if alive:
                if time.monotonic() - _answering.get(nid, 0) > 30:
                    _answering[nid] = time.monotonic()
                    log.warning("node %s sends no heartbeats (%.1f s) but answers its health check: not declared "
                                "down (overloaded, or it cannot reach the scheduler); no placements there meanwhile",
                                nid, live.silence(by_id[nid], redis_now))
        verdict.declare = [nid for nid in verdict.declare if not answers.get(nid)]
    declared = []
    for nid in verdict.declare:
        gone = await store.mark_down(nid, live.healthy_since, live.timeout_s)
        if gone is None:
            continue  # heard meanwhile
        node = next(n for n in all_nodes if n.node_id == nid)
        if node.status != NODE_DOWN:
            declared.append(nid)
            log.warning("node %s declared down: no heartbeat for %.1f s while the control plane was healthy; "
                        "%d running sandbox(es) reported gone (the node stops them itself when it is back; "
                        "its paused ones resume elsewhere)", nid, live.silence(node, redis_now), len(gone))
        elif gone:
            log.warning("node %s is down: %d more running sandbox(es) reported gone", nid, len(gone))
    for n in all_nodes:
        if n.status == NODE_UP and not n.alive() and n.node_id not in declared:
            await store.release(n.node_id)  # a silent node leaves the placement index (its heartbeat re-adds it)
    orphaned = [n for n in all_nodes
                if (n.status == NODE_DOWN or n.node_id in declared) and live.silence(n, redis_now) > ORPHAN_MOVE_S]
    if orphaned:
        full = await store.nodes()  # placing needs the reports
        for n in orphaned:
            await move_orphans(store, n.node_id, full, redis_now)
    return declared


#: Plans tried for one placement whose reservation lost a race (another placement, on
#: this replica or another, took the room first).
RESERVE_TRIES = 8


async def plan_and_reserve(store: ClusterStore, count: int = 1, vcpus: int = 2, snapshot_id: str | None = None,
                           prefer: str | None = None, exclude: set[str] = frozenset(), only: str | None = None,
                           view: CandidateView | None = None) -> tuple[list[tuple[NodeInfo, int]], str]:
    """Place ``count`` sandboxes (:func:`~.placement.place` over the best-scored nodes
    of the index, those caching ``snapshot_id`` and ``prefer``: :meth:`ClusterStore.candidates`,
    through ``view`` when given: :mod:`.view`) and take their room atomically
    (:meth:`ClusterStore.reserve`), on node ``only`` alone when given (it holds the
    sandbox's volumes); a reservation that lost a race, or a plan that found no room in
    a view, is planned again on what Redis holds then, at most :data:`RESERVE_TRIES`
    times. A constant number of Redis calls per try, whatever the fleet's size.

    Returns:
        ``(plan, placement id)``: ``plan`` as :func:`~.placement.place` returns it.

    Raises:
        NoCapacity: no room for ``count`` (nothing is reserved).
        ClusterStoreUnavailable: Redis failed.
    """
    k = max(CANDIDATES, count + len(exclude))
    also = [x for x in (prefer, only) if x]
    view = view or CandidateView(store, ttl_s=0.0)  # none given: every try reads Redis
    fresh = False
    for _ in range(RESERVE_TRIES):
        nodes, placing, now, indexed, cached = await view.candidates(k, snapshot_id, also, fresh=fresh)
        try:
            plan = place(nodes, placing, now, count=count, vcpus=vcpus, snapshot_id=snapshot_id,
                         prefer=prefer, exclude=exclude, only=only)
        except NoCapacity:
            if cached:  # the view may be older than the room freed since: read it
                fresh = True
                continue
            if indexed > k and only is None:  # more nodes have room than were read: read more
                k = min(indexed, 4 * k)
                continue
            raise
        taken = [(n.node_id, c) for n, c in plan]
        pid, _, _ = await store.reserve(taken)
        if pid is not None:
            view.taken(taken)
            return plan, pid
        fresh = True
    raise NoCapacity(f"{RESERVE_TRIES} placements of {count} sandbox(es) in a row lost the race for the last "
                     "room to concurrent ones; retry")


async def _reachable(client: httpx.AsyncClient, url: str) -> bool:
    """Whether the node at ``url`` answers ``/health`` within :data:`PROBE_TIMEOUT_S`."""
    try:
        r = await client.get(f"{url.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S)
        return r.status_code < 500
    except httpx.HTTPError:
        return False





def create_scheduler_app(store: ClusterStore, secret: str, sweep_interval_s: float = 1.0):
    """The scheduler's ASGI app over ``store``; ``secret`` (the master) guards every
    route but ``/health`` and the nodes' own calls (their keys, :mod:`.nodekeys`). A background sweep every ``sweep_interval_s`` (:func:`sweep_once`)
    declares nodes down only on evidence about them and moves the paused sandboxes of
    nodes down longer than :data:`ORPHAN_MOVE_S`."""
    store.keys = NodeKeys(secret)  # node records in Redis count only with their binding tag
    probe = httpx.AsyncClient(trust_env=False)
    view = CandidateView(store)  # placements plan on it (:mod:`.view`); the reservation decides

    async def sweep():
        live = Liveness()
        replica = secrets.token_hex(8)  # this process's claim on the sweeper lease
        while True:
            await asyncio.sleep(sweep_interval_s)
            try:
                await sweep_once(store, live, probe=lambda url: _reachable(probe, url), replica=replica)
            except ClusterStoreUnavailable as e:
                live.tick(None)
                log.error("%s", e)
            except Exception as e:  # noqa: BLE001 — the sweep must keep running
                log.exception("sweep failed: %s", e)

    @asynccontextmanager
    async def lifespan(app):
        task = asyncio.create_task(sweep(), name="sweep")
        try:
            yield
        finally:
            task.cancel()
            await probe.aclose()
            await store.aclose()

    app = FastAPI(title="forkyard scheduler", lifespan=lifespan)

    @app.exception_handler(ClusterStoreUnavailable)
    async def _unavailable(request, exc):
        return error_response(503, f"{exc}; retry when Redis is back")

    @app.exception_handler(HTTPException)
    async def _http(request, exc):
        return error_response(exc.status_code, str(exc.detail))

    @app.get("/health")
    async def health():
        ok = await store.ping()
        return JSONResponse({"status": "ok" if ok else "degraded", "redis": ok}, status_code=200 if ok else 503)

    @app.post("/v1/nodes/{node_id}/publish")
    async def publish(node_id: str, body: Publish):
        for rec in body.records:
            if not isinstance(rec.get("id"), str) or not isinstance(rec.get("state"), str):
                raise HTTPException(400, "each record needs string 'id' and 'state'")
        return {"foreign": await store.publish(node_id, body.records, body.deleted, deaths=body.deaths)}

    @app.post("/v1/nodes/{node_id}/restarting")
    async def restarting(node_id: str, body: Restarting):
        if not await store.announce_restart(node_id, body.grace_s):
            raise HTTPException(404, f"node {node_id!r} is not registered")
        log.info("node %s is restarting: not declared down for %.0f s", node_id, body.grace_s)
        return {"nodeID": node_id, "graceS": body.grace_s}

    @app.post("/v1/nodes/{node_id}/volumes/{volume_id}/lease")
    async def volume_lease(node_id: str, volume_id: str, body: LeaseBody):
        if not is_name(volume_id) or not is_name(body.name):
            raise HTTPException(400, "volume id and name must be names (a-z, 0-9, '_', '-')")
        granted, holder = await store.volume_acquire(node_id, volume_id, body.name)
        message = "" if granted or holder else (f"node {node_id} is not registered or is declared down: it "
                                               "takes no volume lease until its heartbeat is heard")
        return {"granted": granted, "holder": holder, "message": message}

    @app.post("/v1/nodes/{node_id}/volumes/{volume_id}/release")
    async def volume_release(node_id: str, volume_id: str):
        if not is_name(volume_id):
            raise HTTPException(400, "volume id must be a name (a-z, 0-9, '_', '-')")
        return {"released": await store.volume_release(node_id, volume_id)}

    @app.get("/v1/nodes")
    async def nodes():
        return [n.to_dict() for n in await store.nodes()]

    @app.post("/v1/nodes/{node_id}/drain")
    async def drain(node_id: str):
        if not await store.set_status(node_id, NODE_DRAINING):
            raise HTTPException(404, f"node {node_id!r} is not registered")
        log.info("node %s is draining", node_id)
        return {"nodeID": node_id, "status": NODE_DRAINING}

    @app.post("/v1/nodes/{node_id}/undrain")
    async def undrain(node_id: str):
        if not await store.set_status(node_id, NODE_UP):
            raise HTTPException(404, f"node {node_id!r} is not registered")
        return {"nodeID": node_id, "status": NODE_UP}

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def binding(sandbox_id: str):
        b = await store.binding(sandbox_id)
        if b is None:
            raise HTTPException(404, f"sandbox {sandbox_id!r} is not bound to any node")
        return {"sandboxID": b.sandbox_id, "nodeID": b.node_id, "state": b.state, "record": b.record}

    @app.post("/v1/placements")
    async def placements(body: PlacementRequest):
        prefer, snapshot, exclude, only, why = None, body.snapshot, set(body.exclude), None, ""
        if body.kind == "create" and body.volumes:
            names = sorted(set(body.volumes))
            held = {n: h for n, h in zip(names, await store.volume_holders(names=names)) if h}
            if len(set(held.values())) > 1:
                raise HTTPException(409, "volumes " + ", ".join(f"{n!r} (node {h})" for n, h in sorted(held.items()))
                                    + " are mounted on different nodes; an ext4 volume is mounted on one node at "
                                    "a time, so one sandbox can mount them together only once all but one node "
                                    "have released theirs (no sandbox there mounts it)")
            if held:
                only = next(iter(held.values()))
                why = f"volume(s) {', '.join(map(repr, sorted(held)))} are mounted on node {only}"
        if body.kind in ("fork", "resume"):
            if not body.sandbox_id:
                raise HTTPException(400, f"a {body.kind} placement needs sandboxID")
            b = await store.binding(body.sandbox_id)
            if b is None:
                raise HTTPException(404, f"sandbox {body.sandbox_id!r} not found")
            if body.kind == "fork":
                prefer = b.node_id
                if b.record.get("volume_mounts"):  # its volumes are mounted there only
                    only, why = b.node_id, f"sandbox {body.sandbox_id} mounts volumes, mounted on node {b.node_id}"
            else:
                owner = await store.node(b.node_id)
                stays = owner is not None and owner.status == NODE_UP and owner.alive()
                if stays and body.unreachable and not await _reachable(probe, owner.url):
                    stays = False
                    log.warning("node %s does not answer (a gateway could not reach it): moving paused sandbox %s",
                                b.node_id, body.sandbox_id)
                if b.state != "paused" or stays:
                    return {"placements": [_entry(owner, 1, b.node_id)], "moved": False}
                if not b.committed:
                    raise HTTPException(503, f"sandbox {body.sandbox_id} is paused on node {b.node_id}, which is "
                                             f"{'draining' if owner and owner.status == NODE_DRAINING else 'unreachable'}, "
                                             "and its image is not in the shared repository yet: it resumes once "
                                             "that node has committed it (or is back); retry shortly")
                snapshot, exclude = b.record.get("image_id"), exclude | {b.node_id}
        try:
            plan, pid = await plan_and_reserve(store, count=body.count, vcpus=body.vcpus, snapshot_id=snapshot,
                                               prefer=prefer, exclude=exclude, only=only, view=view)
        except NoCapacity as e:
            metrics.admission_refused("no_capacity")
            if only:
                raise HTTPException(503, f"{why}, which has no room for {body.count} more sandbox(es) now (full, "
                                         "draining or silent); an ext4 volume is mounted on one node at a time: "
                                         "retry once sandboxes there end") from e
            raise HTTPException(503, str(e)) from e
        if body.kind == "resume":
            target = plan[0][0]
            if not await store.rebind(body.sandbox_id, b.node_id, target.node_id):
                await store.release(target.node_id, [pid])  # the room taken is given back
                cur = await store.binding(body.sandbox_id)  # another scheduler or gateway moved it first
                if cur is None:
                    raise HTTPException(404, f"sandbox {body.sandbox_id!r} not found")
                return {"placements": [_entry(await store.node(cur.node_id), 1, cur.node_id)], "moved": False}
            log.info("sandbox %s moves from node %s to node %s", body.sandbox_id, b.node_id, target.node_id)
            return {"placements": [_entry(target, 1, placement=pid)], "moved": True, "record": b.record}
        return {"placements": [_entry(node, n, placement=pid) for node, n in plan]}

    from forkyard.obs.collect import cluster_families
    from forkyard.obs.middleware import ObsMiddleware

    # /metrics is answered before the guard: a scrape carries the metrics token (or the
    # secret), or comes from loopback (forkyard.obs.metrics.scrape_allowed).
    # Placements are answered in front of FastAPI (.leanroute), after the guard and ObsMiddleware.
    guard = _Guard(LeanRoute(app, "POST", "/v1/placements", PlacementRequest, placements, MAX_BODY, "placement"),
                   secret)
    # Heartbeats are answered before the middlewares and FastAPI, after the same guard (.beats).
    return LeanHeartbeats(ObsMiddleware(guard, "scheduler", collect=lambda: cluster_families(store),
                                        keys=lambda: [secret]), guard, store, MAX_BODY, PeerTable())


def _entry(node, count: int, node_id: str | None = None, placement: str | None = None) -> dict:
    out = {"nodeID": node.node_id if node else node_id, "url": node.url if node else None, "count": count}
    if placement:
        out["placementID"] = placement  # the gateway sends it to the node (PLACEMENT_HEADER)
    return out
