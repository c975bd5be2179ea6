"""The node's side of the cluster (``forkyard node --scheduler URL``).

:class:`NodeAgent` attaches to a node app built by :func:`forkyard.api.app.create_app`:

* **heartbeat** every :data:`~.types.HEARTBEAT_INTERVAL_S`: a :class:`~.types.NodeReport`
  plus the ids it holds; the scheduler answers with the node's status (``draining``
  starts :meth:`NodeAgent.drain`) and the ids it must drop (moved to another node, or
  reported gone while it was declared down) — dropped with ``Orchestrator.forget``,
  which stops a running one: only the node itself destroys its sandboxes. While the
  scheduler (or Redis) is away nothing changes here: sandboxes keep running and being
  served, changes queue and are published once it answers again;
* **publish**: every row the orchestrator's store writes is mirrored to the scheduler
  (the binding and the record another node needs to resume it). Mutating REST calls
  answer only after their changes are published (:meth:`NodeAgent.wrap`), so the client
  never holds an id the gateway cannot route yet; background changes (expiry, reaping)
  follow within a heartbeat;
* **drain**: pauses every running sandbox to the shared repository; while draining a
  ``connect``/``resume`` is never served here: the sandbox is paused first and the call
  answered 409 with :data:`~.config.DRAINING_HEADER`, so the gateway resumes it on
  another node;
* **P2P** (``FORKYARD_P2P=on``, :mod:`.p2p`): runs the node's iroh chunk service,
  reports its address in every heartbeat and installs the members the scheduler answers
  with as the only endpoints it serves and asks;
* **internal routes** under ``/cluster`` (:mod:`.node_routes`; this node's own key only, :mod:`.nodekeys`): ``adopt`` a paused
  sandbox from a dead or draining node, fork with an exported image, start fork
  children from another node's image, delete an exported fork image.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import time

from fastapi.responses import JSONResponse

from forkyard.api.auth import cluster_secret_ok
from forkyard.cluster import p2p
from forkyard.cluster.beatstream import BeatRefused, BeatStream, StreamLost
from forkyard.cluster.config import DRAINING_HEADER
from forkyard.cluster.messages import (HIDDEN, HeldSync, heartbeat_path, node_report, publish_body, publish_path,
                                       published_record)
from forkyard.cluster.node_routes import PlacementAck, internal_router, record_from_published
from forkyard.cluster.nodekeys import NODE_URL_HEADER, normal_url
from forkyard.cluster.schedclient import SchedulerClient
from forkyard.cluster.types import HEARTBEAT_INTERVAL_S, NODE_DRAINING, NODE_UP, NodeReport
from forkyard.cluster.volumes import SchedulerLeases
from forkyard.config import ClusterSettings, ControlPlaneSettings
from forkyard.ids import SANDBOX_ID
from forkyard.orchestrator.errors import OrchestratorError
from forkyard.routing import route_of

log = logging.getLogger("forkyard.node")

_HIDDEN = HIDDEN
#: How long a mutating reply waits for its changes to reach the scheduler (s); not at all
#: while the scheduler is unreachable (they are published once it is back).
PUBLISH_WAIT_S = 3.0
#: Timeouts of a heartbeat and of a publish (s): well under the heartbeat timeout, so a
#: stopped scheduler replica costs one try before the next replica is asked.
HEARTBEAT_CALL_S = 2.0
PUBLISH_CALL_S = 5.0
#: While the scheduler stays unreachable, the warning is repeated this often (s).
LINK_LOG_S = 30.0
#: ``connect``/``resume`` on a draining node: longest wait for the sandbox's pause (s).
DRAIN_WAKE_WAIT_S = 120.0
#: Placement ids waiting for their acknowledgement, at most (beyond: they expire in Redis).
_MAX_ACKED = 10_000
_WAKE = re.compile(rf"^/(?:v2/)?sandboxes/({SANDBOX_ID})/(?:connect|resume)$")


def default_max_sandboxes() -> int:
    """``FORKYARD_NODE_MAX_SANDBOXES``, else as many sandboxes of the default size
    (512 MiB, :class:`~forkyard.config.Settings`) as the node's admission lets run at
    once (:class:`~forkyard.orchestrator.admission.Capacity`), at least 1 — so placement
    never counts on room the node would refuse."""
    given = ControlPlaneSettings().node_max_sandboxes
    if given is not None:
        return given
    from forkyard.config import Settings
    from forkyard.orchestrator.admission import Capacity

    return max(1, Capacity.from_env().memory_mb // Settings().default_memory_mb)


def _memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


class NodeAgent:
    """Registers a node with the scheduler and keeps its bindings current.

    Args:
        proxy_app: the node app from ``create_app`` (its FastAPI instance at ``.fastapi``).
        node_id: this node's name; url: where gateways reach it.
        scheduler_url: the scheduler's base URL; secret: this node's own key
            (:mod:`.nodekeys`, bound to ``node_id`` and ``url``): sent to the scheduler, and
            the only credential the node's internal routes accept.
        max_sandboxes: sandboxes this node runs at once (reported for placement, and
            enforced by the node's admission beside ``FORKYARD_MAX_SANDBOXES``).
    """

    def __init__(self, proxy_app, node_id: str, url: str, scheduler_url: str, secret: str, max_sandboxes: int):
        self.app = proxy_app.fastapi
        self.orch = self.app.state.orchestrator
        self.node_id, self.url, self.max_sandboxes = node_id, normal_url(url), max_sandboxes
        # The node enforces the count it reports: a placement computed on a stale report
        # is refused here (503, and the caller retries elsewhere) rather than overfilling.
        cap = self.orch.capacity
        cap.max_sandboxes = max_sandboxes if cap.max_sandboxes is None else min(cap.max_sandboxes, max_sandboxes)
        self.secret = secret
        self.status = NODE_UP
        #: Set once a drain has paused what it could (reported: ``forkyard node drain --wait``).
        self.drain_done = False
        self.boot = secrets.token_hex(6)
        self.settings = ClusterSettings()
        self._http = SchedulerClient(scheduler_url, secret, timeout_s=HEARTBEAT_CALL_S,
                                     headers={NODE_URL_HEADER: self.url})
        #: heartbeats over one WebSocket (FORKYARD_BEAT_STREAM=on; .beatstream), else None
        self._stream = BeatStream(self._http, node_id) if self.settings.beat_stream else None
        #: Whether the last scheduler call succeeded (None before the first).
        self.linked: bool | None = None
        #: When a scheduler call last succeeded (monotonic s).
        self.last_ok = 0.0
        self._link_since = time.monotonic()
        self._link_logged = 0.0
        self._commit_task: asyncio.Task | None = None
        self._next_commit_retry = 0.0
        self._dirty: set[str] = set()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()
        self._runtime = self.orch.runtime_build or "unknown"
        #: placement ids whose calls have ended here, acked in the next heartbeat
        self._acked: set[str] = set()
        #: whether heartbeats list the held ids or only their digest
        self._held = HeldSync()
        self.app.add_middleware(PlacementAck, secret=secret, on_ended=self._placement_ended)
        self.app.state.cluster_secret = secret
        self.app.state.on_start.append(self.start)
        self.app.state.on_stop.insert(0, self.stop)
        self.app.include_router(internal_router(self.orch))
        self.orch.on_record_change(self._changed)
        # E2B volumes are mounted here only while this node holds their leases (.volumes)
        self.orch.volumes.leases = SchedulerLeases(scheduler_url, secret, node_id, self.url)
        self._volume_task: asyncio.Task | None = None
        #: the P2P chunk service (FORKYARD_P2P=on, started with the agent), else None
        self.p2p = None

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Mark every local row for publishing and start the heartbeat loop (the first
        heartbeat is sent before returning; a scheduler that is down is retried)."""
        self._loop = asyncio.get_running_loop()
        self.p2p = await asyncio.to_thread(p2p.start_service, self.orch.snapshots)
        self._dirty |= {r.id for r in self.orch.records()}
        try:
            await self._beat()
        except Exception as e:  # noqa: BLE001 — keep serving; the loop retries
            log.error("first heartbeat to the scheduler failed (retrying every %.0f s): %s", HEARTBEAT_INTERVAL_S, e)
        self._task = asyncio.create_task(self._run(), name="cluster-agent")

    async def stop(self) -> None:
        """Stop heartbeats. The node's sandboxes keep running (they are re-adopted at
        the next start), so the scheduler is told this is a restart: the node is not
        declared down for ``FORKYARD_NODE_RESTART_GRACE_S`` (a crash says nothing and is
        declared after the heartbeat timeout)."""
        for t in (self._task, self._drain_task, self._commit_task, self._volume_task):
            if t is not None:
                t.cancel()
                try:
                    await t
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        if self.linked is not False:
            try:
                await asyncio.wait_for(self.publish(), timeout=PUBLISH_CALL_S)
                await self._post(f"/v1/nodes/{self.node_id}/restarting", {"graceS": self.settings.restart_grace_s})
            except Exception as e:  # noqa: BLE001
                log.warning("telling the scheduler about this restart failed: %s", e)
        if self._stream is not None:
            await self._stream.close()
        await self._http.aclose()
        await asyncio.to_thread(p2p.stop_service, self.orch.snapshots, self.p2p)

    def _changed(self, sandbox_id: str) -> None:
        self._dirty.add(sandbox_id)

    def _placement_ended(self, placement_id: str) -> None:
        """A call placed by the scheduler has ended here: acknowledge it in a heartbeat
        sent now, so the placement is not counted twice for long (:class:`.node_routes.PlacementAck`)."""
        if len(self._acked) < _MAX_ACKED:  # beyond: they expire in Redis
            self._acked.add(placement_id)
            self._wake.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        next_beat = 0.0
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=HEARTBEAT_INTERVAL_S / 4)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                if self._loop.time() >= next_beat or self._acked:  # acks go out at once
                    next_beat = self._loop.time() + HEARTBEAT_INTERVAL_S
                    await self._beat()
                elif self._dirty and self.linked is not False:  # else the next heartbeat retries
                    await self.publish()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 — retried on the next tick
                self._link(False, e)
            self._retry_commits()
            self._release_volumes()

    def _link(self, ok: bool, err: Exception | None = None) -> None:
        """Track whether the scheduler answers; say so once per change (and every
        :data:`LINK_LOG_S` while it does not)."""
        now = time.monotonic()
        if ok:
            self.last_ok = now
            if self.linked is False:
                log.warning("scheduler at %s answers again after %.1f s; queued changes are being published",
                            self._http.url, now - self._link_since)
            if self.linked is not True:
                self._link_since = now
            self.linked = True
            return
        if self.linked is not False:
            self._link_since = self._link_logged = now
            self.linked = False
            log.warning("scheduler unreachable (%s): sandboxes here keep running and are served; changes are "
                        "published when it is back", err, exc_info=log.isEnabledFor(logging.DEBUG))
        elif now - self._link_logged >= LINK_LOG_S:
            self._link_logged = now
            log.warning("scheduler still unreachable after %.0f s (%s)", now - self._link_since, err)

    def _release_volumes(self) -> None:
        """Unmount the volumes no sandbox here mounts (running or paused) and no content
        call used for ``FORKYARD_VOLUME_IDLE_S`` (at once while draining) and give their
        leases back (:meth:`~forkyard.orchestrator.volumes.store.Volumes.release_idle`),
        in the background; one sweep at a time."""
        vols = self.orch.volumes
        if not vols.leased() or (self._volume_task and not self._volume_task.done()):
            return
        used = {m["id"] for r in self.orch.records() for m in r.volume_mounts}
        idle = 0.0 if self.status == NODE_DRAINING else self.orch.settings.volume_idle_s
        self._volume_task = asyncio.create_task(asyncio.to_thread(vols.release_idle, used, idle),
                                                name="volume-release")

    def _retry_commits(self) -> None:
        """Every ``FORKYARD_COMMIT_RETRY_S``, commit again paused images a failed commit
        left staged here (the repository was down during their pause), in the background."""
        if self._loop.time() < self._next_commit_retry or (self._commit_task and not self._commit_task.done()):
            return
        self._next_commit_retry = self._loop.time() + self.settings.commit_retry_s
        if any(r.state == "paused" and not self.orch.pause_committed(r) for r in self.orch.records()):
            self._commit_task = asyncio.create_task(self.orch.commit_staged_pauses(), name="commit-staged")

    # ---- scheduler calls --------------------------------------------------------------
    def _report(self) -> NodeReport:
        return node_report(
            self.orch.records(), vcpus=os.cpu_count() or 1, memory_mb=_memory_mb(), max_sandboxes=self.max_sandboxes,
            free_slots=len(self.orch.node_metrics()["spareSlots"]),
            cache_bytes=self.orch.cache_bytes, load1=os.getloadavg()[0],
            runtime=self._runtime, cached_snapshots=self.orch.cached_snapshots(),
            boot=self.boot, drain_done=self.drain_done, p2p=self.p2p.address() if self.p2p else None,
        )

    async def _post(self, path: str, body: dict, timeout_s: float = HEARTBEAT_CALL_S) -> dict:
        try:
            r = await self._http.post(path, json=body, timeout=timeout_s)
        except Exception as e:
            self._link(False, e)
            raise
        if r.status_code != 200:
            err = RuntimeError(f"scheduler answered {r.status_code} to {path}: {r.text[:300]}")
            self._link(False, err)
            raise err
        self._link(True)
        return r.json()

    async def _send_beat(self, body: dict) -> dict:
        """Heartbeat ``body`` on the stream when there is one (:mod:`.beatstream`), else
        (or when it failed) over HTTP; the scheduler's answer."""
        if self._stream is None:
            return await self._post(heartbeat_path(self.node_id), body)
        try:
            out, streamed = await self._stream.beat(
                body, HEARTBEAT_CALL_S, lambda left_s: self._post(heartbeat_path(self.node_id), body, timeout_s=left_s))
        except (BeatRefused, StreamLost) as e:
            self._link(False, e)
            raise
        if streamed:
            self._link(True)
        return out

    async def _beat(self) -> None:
        async with self._lock:
            await self._publish_locked()
            acked = set(self._acked)  # taken before the report: their rows are in it
            body = self._held.body(self.url, self._report(), self.orch.records(), acked,
                                   self.status == NODE_DRAINING)
            out = await self._send_beat(body)
            self._held.answered(body, out)
            self._acked -= acked
            self._dirty |= set(out.get("missing", []))
            if self.p2p is not None and "peers" in out:
                self.p2p.set_peers(p2p.parse_peers(out["peers"]))
        await self._drop(out.get("foreign", []))
        for body in out.get("adopt", []):  # moved here, but the adopt call never came
            await self._adopt_quietly(body)
        if out.get("status") == NODE_DRAINING and self.status != NODE_DRAINING:
            self.status, self.drain_done = NODE_DRAINING, False
            self._drain_task = asyncio.create_task(self.drain(), name="drain")
        elif out.get("status") != NODE_DRAINING:
            if self.status == NODE_DRAINING:
                log.warning("undrained: this node takes sandboxes again")
            self.status, self.drain_done = out.get("status", NODE_UP), False

    async def _adopt_quietly(self, body: dict) -> None:
        """Adopt a paused sandbox the scheduler moved here (heartbeat answer); errors are
        logged (the next heartbeat asks again while the move stands)."""
        try:
            rec = await self.orch.adopt(record_from_published(body))
            self._dirty.add(rec.id)  # publishing it clears the binding's "moved" mark
        except Exception as e:  # noqa: BLE001
            log.warning("adopting moved sandbox %s failed: %s", body.get("id"), e)

    async def publish(self) -> None:
        """Send every changed row to the scheduler now (rows in hidden states are
        unbound). Ids the scheduler refuses (bound elsewhere) are dropped here.

        Raises:
            httpx.HTTPError / RuntimeError: the scheduler did not take them (they stay
                queued for the next try).
        """
        async with self._lock:
            foreign = await self._publish_locked()
        await self._drop(foreign)

    async def _publish_locked(self) -> list[str]:
        if not self._dirty:
            return []
        ids, self._dirty = self._dirty, set()
        records, deleted, deaths = [], [], {}
        for sid in ids:
            rec = self.orch.record(sid)
            if rec is None or rec.state in _HIDDEN:
                if rec is None or rec.state == "killing":
                    deleted.append(sid)
                    if (tomb := self.orch.tombstones.get(sid)) is not None:  # died by itself: say why
                        deaths[sid] = tomb.describe()
                continue
            # committed: false keeps a paused sandbox on this node until its image is in
            # the shared repository (another node could not resume it).
            records.append(published_record(rec, self.orch.pause_committed(rec)))
        try:
            out = await self._post(publish_path(self.node_id), publish_body(records, deleted, deaths),
                                   timeout_s=PUBLISH_CALL_S)
        except BaseException:
            self._dirty |= ids
            raise
        return out.get("foreign", [])

    async def _drop(self, ids: list[str]) -> None:
        """Drop sandboxes the cluster no longer routes here (moved elsewhere, or
        reported gone while this node was declared down): running ones are stopped."""
        for sid in ids:
            try:
                await self.orch.forget(sid)
            except Exception as e:  # noqa: BLE001
                log.error("dropping sandbox %s failed: %s", sid, e)

    async def drain(self) -> None:
        """Pause every running sandbox to the shared repository (each answers once its
        image is committed), so they can resume on other nodes; new placements have
        already stopped (the scheduler marked this node draining). Sets
        :attr:`drain_done` at the end (the next heartbeat reports it)."""
        running = [r.id for r in self.orch.list() if r.state == "running"]
        log.warning("draining: pausing %d running sandbox(es)", len(running))
        failed = 0
        for sid in running:
            if not self._still_running(sid):
                continue  # paused meanwhile (a connect during the drain pauses its sandbox at once)
            try:
                await self.orch.pause(sid)
            except Exception as e:  # noqa: BLE001 — report and go on with the others
                if self._still_running(sid):
                    failed += 1
                    log.error("drain: pause of %s failed (it keeps running here): %s", sid, e)
        try:
            await self.publish()
        except Exception as e:  # noqa: BLE001 — the heartbeat loop publishes later
            log.warning("drain: publishing failed (retried): %s", e)
        self.drain_done = True
        self._wake.set()
        if failed:
            log.warning("drain finished: %d paused, %d still running (their pause failed)", len(running) - failed, failed)
        else:
            log.info("drain finished: %d paused", len(running))

    async def _may_resume(self, sandbox_id: str) -> bool:
        """Whether a connect/resume may go on here: always for a running sandbox; for a
        paused one only if the scheduler can be told (a heartbeat is tried first unless
        one succeeded within the last :data:`~.types.HEARTBEAT_INTERVAL_S` × 2). A node
        cut off from the control plane does not resume: if it were declared down
        meanwhile, the paused binding would move and the sandbox would run twice."""
        rec = self.orch.record(sandbox_id)
        if rec is None or rec.state == "running" or time.monotonic() - self.last_ok < 2 * HEARTBEAT_INTERVAL_S:
            return True
        try:
            await asyncio.wait_for(self._beat(), timeout=HEARTBEAT_CALL_S + 0.5)
        except Exception:  # noqa: BLE001 — still cut off
            return False
        return True

    async def _drains_for(self, scope) -> bool:
        """Whether a connect/resume is refused because this node drains. The gateway
        sends the node's status as it read it from the cluster store a moment ago
        (:data:`~.config.DRAINING_HEADER` ``1``/``0``, with the cluster secret): ``1``
        is a drain this node has not heard of yet (its next heartbeat tells it); ``0``
        while this node believes it drains is an undrain it has not heard of — a
        heartbeat is sent now (at most :data:`HEARTBEAT_CALL_S` + 0.5 s) and its
        answer decides, so a wake is never refused on a stale view, nor served on the
        gateway's word alone."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        told = headers.get(DRAINING_HEADER) if cluster_secret_ok(headers, self.secret) else None
        if told == "1":
            return True
        if told == "0" and self.status == NODE_DRAINING:
            try:
                await asyncio.wait_for(self._beat(), timeout=HEARTBEAT_CALL_S + 0.5)
            except Exception as e:  # noqa: BLE001 — keep this node's own view
                log.warning("heartbeat to check an undrain the gateway saw failed: %r", e)
        return self.status == NODE_DRAINING

    def _still_running(self, sandbox_id: str) -> bool:
        rec = self.orch.record(sandbox_id)
        return rec is not None and rec.state == "running"

    async def _refuse_wake(self, sandbox_id: str, scope, receive, send, app) -> None:
        """A ``connect``/``resume`` while this node drains: the sandbox is paused here
        first (at once, not in drain order) and the call answered 409 with
        :data:`~.config.DRAINING_HEADER`, after publishing, so the gateway moves it
        and resumes it on another node. A sandbox whose pause failed keeps running and
        the call is served here; an unknown one gets the node's own 404."""
        deadline = time.monotonic() + DRAIN_WAKE_WAIT_S
        while True:
            rec = self.orch.record(sandbox_id)
            if rec is None or rec.state in _HIDDEN:
                return await app(scope, receive, send)
            if rec.state == "paused":
                break
            if rec.state == "running":
                try:
                    await self.orch.pause(sandbox_id)
                except OrchestratorError as e:
                    if self._still_running(sandbox_id):
                        log.error("draining: pause of %s for a connect failed; served here: %s", sandbox_id, e)
                        return await app(scope, receive, send)
                continue
            if time.monotonic() > deadline:  # stuck in a transient state: let the node answer
                return await app(scope, receive, send)
            await asyncio.sleep(0.05)  # pausing, snapshotting, forking…: wait for it
        try:
            await asyncio.wait_for(self.publish(), timeout=PUBLISH_WAIT_S)
        except Exception as e:  # noqa: BLE001 — the gateway waits for the binding anyway
            log.warning("publishing before refusing a wake during the drain failed: %r", e)
        body = {"code": 409, "message": f"node {self.node_id} is draining: sandbox {sandbox_id} is paused and "
                                        "resumes on another node (ask the cluster's gateway)"}
        await JSONResponse(body, status_code=409, headers={DRAINING_HEADER: "1"})(scope, receive, send)

    # ---- the node app -------------------------------------------------------------------
    def wrap(self, app):
        """ASGI middleware for the node app: ``/cluster/*`` needs this node's key
        (checked from headers, before the body); a mutating REST call (POST/PUT/DELETE,
        not sandbox traffic) answers only after its changes are published — waiting at
        most :data:`PUBLISH_WAIT_S`; after that they follow in the background."""
        agent = self

        async def middleware(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            try:
                routed = route_of(scope) is not None
            except ValueError:
                routed = True
            if routed:
                return await app(scope, receive, send)
            if scope["path"].startswith("/cluster/"):
                headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
                if not cluster_secret_ok(headers, agent.secret):
                    return await JSONResponse({"code": 401, "message": "this node's key required (x-forkyard-cluster-secret)"},
                                              status_code=401)(scope, receive, send)
            if scope["method"] not in ("POST", "PUT", "DELETE", "PATCH"):
                return await app(scope, receive, send)
            if scope["method"] == "POST" and (m := _WAKE.match(scope["path"])):
                if await agent._drains_for(scope):
                    return await agent._refuse_wake(m.group(1), scope, receive, send, app)
                if not await agent._may_resume(m.group(1)):
                    body = {"code": 503, "message": f"node {agent.node_id} cannot reach the cluster's scheduler (or the scheduler its Redis), so it "
                                                    f"cannot record that sandbox {m.group(1)} resumes: retry shortly "
                                                    "(running sandboxes are not affected)"}
                    return await JSONResponse(body, status_code=503)(scope, receive, send)

            async def send_after_publish(message):
                if message["type"] == "http.response.start" and agent.linked is not False:
                    try:
                        await asyncio.wait_for(agent.publish(), timeout=PUBLISH_WAIT_S)
                    except Exception as e:  # noqa: BLE001 — published later by the loop
                        log.warning("publishing before the reply failed (retried in the background): %r", e)
                await send(message)

            return await app(scope, receive, send_after_publish)

        middleware.fastapi = getattr(app, "fastapi", None)
        return middleware
