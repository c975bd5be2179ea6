"""A control plane with a simulated fleet, for tests and ``bench/bench_control_plane.py``
(issue 26): a real ``redis-server`` (AOF on), real ``forkyard scheduler`` replicas and a
real ``forkyard gateway`` (subprocesses, the deploy units' command lines), and N
simulated nodes in this process.

A simulated node holds ``SandboxRecord`` rows and speaks the node ↔ scheduler protocol
through the node agent's own builders (:mod:`forkyard.cluster.messages`: the heartbeat
body and its report, published records) and client (:class:`~forkyard.cluster.schedclient.SchedulerClient`),
so a change of the protocol breaks the simulation rather than silently its numbers. It
runs no sandbox: :meth:`SimNode.start` is what a node does when a placed create reaches
it (rows appear, the placement is acknowledged in the next heartbeat). The scheduler asks
a node's ``/health`` only before declaring a silent one down: with
:meth:`Fleet.serve_health` every simulated node answers it (one uvicorn listener in this
process, ``http://127.0.0.1:PORT/<node id>``), so on a loaded host a late heartbeat
does not take a node out of the run, as it would not a real node that is alive;
without it the URLs answer nothing (a closed port), for tests that want nodes declared
down.
"""

from __future__ import annotations

import asyncio
import random
import secrets
import shutil
import sys
import time
from pathlib import Path

import redis

from _cluster import Proc
from conftest import free_port
from forkyard.cluster.beatstream import BeatStream
from forkyard.cluster.messages import (FULL_EVERY, HeldSync, heartbeat_path, node_report, publish_body, publish_path,
                                       published_record)
from forkyard.cluster.nodekeys import NODE_URL_HEADER, node_key
from forkyard.cluster.schedclient import SchedulerClient
from forkyard.cluster.types import HEARTBEAT_INTERVAL_S
from forkyard.orchestrator.store import SandboxRecord

#: Publish calls carry at most this many records (the scheduler's bound is 10,000).
PUBLISH_BATCH = 2000


class ControlPlane:
    """Redis + ``schedulers`` scheduler replicas + one gateway under ``root``.

    Attributes:
        redis_url, scheduler_urls (list), gateway_url, api_key, secret.
        procs: every subprocess (``redis``, ``scheduler``…, ``gateway``) by name.
    """

    def __init__(self, root: Path, schedulers: int = 2, env: dict[str, str] | None = None, aof: bool = True,
                 unix_socket: bool = False):
        import os

        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        (root / "redis").mkdir(parents=True)
        os.chmod(root, 0o700)
        self.api_key = "e2b_" + secrets.token_hex(20)
        self.secret = secrets.token_hex(24)
        rport, gport = free_port(), free_port()
        sports = [free_port() for _ in range(schedulers)]
        sock = root / "redis" / "redis.sock"
        # over a Unix socket (unix_socket) or loopback TCP: the bench compares the two
        self.redis_url = f"unix://{sock}?db=0" if unix_socket else f"redis://127.0.0.1:{rport}/0"
        self.scheduler_urls = [f"http://127.0.0.1:{p}" for p in sports]
        self.gateway_url = f"http://127.0.0.1:{gport}"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("FORKYARD_", "E2B_"))}
        base.update(FORKYARD_CLUSTER_SECRET=self.secret, FORKYARD_API_KEY=self.api_key,
                    FORKYARD_REDIS_URL=self.redis_url, FORKYARD_SCHEDULER_URL=",".join(self.scheduler_urls),
                    FORKYARD_LOG_FORMAT="text", PYTHONUNBUFFERED="1", **(env or {}))
        cli = [sys.executable, "-m", "forkyard.cli.main"]
        self.procs: dict[str, Proc] = {
            "redis": Proc("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--dir",
                                    str(root / "redis"), "--appendonly", "yes" if aof else "no",
                                    "--appendfsync", "everysec", "--save", "",
                                    *(["--unixsocket", str(sock), "--unixsocketperm", "700"] if unix_socket else [])],
                          base, root / "redis.log", None)}
        for i, p in enumerate(sports):
            self.procs[f"scheduler{i}"] = Proc(f"scheduler{i}", cli + ["scheduler", "--port", str(p),
                                                                       "--log-level", "warning"],
                                               base, root / f"scheduler{i}.log", f"http://127.0.0.1:{p}/health")
        self.procs["gateway"] = Proc("gateway", cli + ["gateway", "--port", str(gport), "--log-level", "warning"],
                                     base, root / "gateway.log", f"{self.gateway_url}/health")

    def start(self) -> ControlPlane:
        """Start Redis, then the schedulers and the gateway (each until healthy)."""
        self.procs["redis"].start()
        r = redis.Redis.from_url(self.redis_url)
        deadline = time.time() + 20
        while True:
            try:
                r.ping()
                break
            except redis.RedisError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        for name, p in self.procs.items():
            if name != "redis":
                p.start()
        return self

    def pids(self, prefix: str) -> list[int]:
        """Process ids of the subprocesses whose name starts with ``prefix``."""
        return [p.proc.pid for n, p in self.procs.items() if n.startswith(prefix) and p.running()]

    def close(self) -> None:
        """Stop every subprocess and remove ``root``."""
        for name in [n for n in self.procs if n != "redis"] + ["redis"]:
            self.procs[name].stop()
        shutil.rmtree(self.root, ignore_errors=True)


def cpu_seconds(pid: int) -> float:
    """User + system CPU (s) process ``pid`` has used (``/proc/PID/stat``)."""
    import os

    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class SimNode:
    """One simulated node (see the module docstring).

    Args:
        node_id: its name; max_sandboxes: the capacity it reports.
        scheduler_urls: the replicas, in the order this node tries them.
        secret: the cluster secret (the node's key is minted from it).
        stream: heartbeats over a WebSocket (:mod:`forkyard.cluster.beatstream`).
    """

    def __init__(self, node_id: str, max_sandboxes: int, scheduler_urls: list[str], secret: str, vcpus: int = 16,
                 base_url: str = "http://127.0.0.1:9", stream: bool = False):
        self.node_id, self.max_sandboxes, self.vcpus = node_id, max_sandboxes, vcpus
        self.url = f"{base_url}/{node_id}"  # only /health is ever called (see the module docstring)
        self.rows: dict[str, SandboxRecord] = {}
        self.dirty: set[str] = set()
        self.acked: set[str] = set()
        self.boot = secrets.token_hex(6)
        # as a node does: its own key (minted from the master, never the master itself)
        self.client = SchedulerClient(scheduler_urls, node_key(secret, node_id, self.url), timeout_s=30.0,
                                      headers={NODE_URL_HEADER: self.url})
        #: heartbeats over one WebSocket, as a node with FORKYARD_BEAT_STREAM=on (else None)
        self.stream = BeatStream(self.client, node_id) if stream else None
        self.beats = 0
        self.streamed = 0  # of those, the ones sent on the stream
        self.full_beats = 0  # of those, the ones that listed the held ids
        self.held = HeldSync()
        self.errors: list[str] = []

    def start(self, count: int, placement_id: str | None, metadata: dict[str, str] | None = None,
              state: str = "running", started_at: float | None = None) -> list[str]:
        """What a node does with a placed create of ``count`` sandboxes: rows (published
        next), the placement acknowledged in the next heartbeat. Returns the new ids."""
        ids = []
        now = time.time() if started_at is None else started_at
        for _ in range(count):
            sid = "i" + secrets.token_hex(9)
            self.rows[sid] = SandboxRecord(id=sid, template_id="base", state=state, slot=None, vcpus=2,
                                           memory_mb=512, started_at=now, end_at=now + 3600, auto_pause=False,
                                           metadata=dict(metadata or {}), envd_access_token=secrets.token_hex(16))
            self.dirty.add(sid)
            ids.append(sid)
        if placement_id:
            self.acked.add(placement_id)
        return ids

    def report(self):
        """This node's report, built by the agent's builder."""
        return node_report(list(self.rows.values()), vcpus=self.vcpus, memory_mb=65536,
                           max_sandboxes=self.max_sandboxes, free_slots=8, cache_bytes=0, load1=0.0,
                           runtime="simulated", cached_snapshots=[], boot=self.boot, drain_done=False)

    async def _post(self, path: str, body: dict) -> dict:
        r = await self.client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
        return r.json()

    async def publish(self) -> None:
        """Publish the changed rows (in batches of :data:`PUBLISH_BATCH`)."""
        while self.dirty:
            batch = [self.dirty.pop() for _ in range(min(PUBLISH_BATCH, len(self.dirty)))]
            records = [published_record(self.rows[s], True) for s in batch if s in self.rows]
            deleted = [s for s in batch if s not in self.rows]
            try:
                await self._post(publish_path(self.node_id), publish_body(records, deleted, {}))
            except BaseException:
                self.dirty.update(batch)
                raise

    async def beat(self) -> dict:
        """One heartbeat as the agent sends it (publish first, then the heartbeat).
        Returns the scheduler's answer (``full``: whether it listed the held ids)."""
        await self.publish()
        acked = set(self.acked)
        body = self.held.body(self.url, self.report(), list(self.rows.values()), acked, False)
        if self.stream is None:
            out = await self._post(heartbeat_path(self.node_id), body)
        else:
            out, streamed = await self.stream.beat(body, 30.0, lambda _: self._post(heartbeat_path(self.node_id), body))
            self.streamed += streamed
        self.held.answered(body, out)
        self.acked -= acked
        self.beats += 1
        self.full_beats += "held" in body
        return {**out, "full": "held" in body}


class Fleet:
    """``n`` simulated nodes heartbeating every second (:meth:`run`), half of them
    trying the scheduler replicas in the other order (a load balancer's spread)."""

    def __init__(self, n: int, max_sandboxes: int, scheduler_urls: list[str], secret: str, stream: bool = False):
        self.health_port = free_port()
        base_url = f"http://127.0.0.1:{self.health_port}"
        self.nodes = [SimNode(f"sim{i:04d}", max_sandboxes, scheduler_urls if i % 2 == 0 else scheduler_urls[::-1],
                              secret, base_url=base_url, stream=stream) for i in range(n)]
        self.by_id = {n.node_id: n for n in self.nodes}
        self._tasks: list[asyncio.Task] = []
        self._health = None

    async def serve_health(self) -> None:
        """Answer ``GET /<node id>/health`` (200) for every node of this fleet on
        :attr:`health_port` until :meth:`stop`; other paths 404."""
        import uvicorn

        ids = {n.node_id for n in self.nodes}

        async def app(scope, receive, send):
            if scope["type"] != "http":
                return
            parts = scope["path"].strip("/").split("/")
            ok = len(parts) == 2 and parts[0] in ids and parts[1] == "health"
            await send({"type": "http.response.start", "status": 200 if ok else 404,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}' if ok else b"{}"})

        self._health = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.health_port,
                                                     log_level="warning", lifespan="off"))
        task = asyncio.create_task(self._health.serve())
        self._tasks.append(task)
        while not self._health.started:
            if task.done():
                task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def register(self) -> None:
        """Every node's first heartbeat (a few at a time)."""
        sem = asyncio.Semaphore(16)

        async def one(node):
            async with sem:
                await node.beat()

        await asyncio.gather(*(one(n) for n in self.nodes))

    async def seed(self, total: int, metadata=None, paused_every: int = 0) -> None:
        """Spread ``total`` sandboxes over the nodes and publish them (without
        placements: as rows a restarted node publishes again). ``metadata(i)`` gives the
        i-th one's metadata; every ``paused_every``-th is paused."""
        for i in range(total):
            node = self.nodes[i % len(self.nodes)]
            state = "paused" if paused_every and i % paused_every == 0 else "running"
            node.start(1, None, metadata(i) if metadata else None, state=state, started_at=time.time() - total + i)
        sem = asyncio.Semaphore(8)

        async def one(node):
            async with sem:
                for attempt in range(5):  # a loaded host may time a connection out
                    try:
                        return await node.publish()
                    except Exception:  # noqa: BLE001
                        if attempt == 4:
                            raise
                        await asyncio.sleep(1)

        await asyncio.gather(*(one(n) for n in self.nodes))

    def run(self) -> None:
        """Start the heartbeat loops (every :data:`~forkyard.cluster.types.HEARTBEAT_INTERVAL_S`,
        phases spread at random)."""
        async def loop(node: SimNode):
            await asyncio.sleep(random.random() * HEARTBEAT_INTERVAL_S)
            while True:
                t0 = time.monotonic()
                try:
                    await node.beat()
                except Exception as e:  # noqa: BLE001 — counted, the loop goes on
                    node.errors.append(repr(e)[:200])
                await asyncio.sleep(max(0.0, HEARTBEAT_INTERVAL_S - (time.monotonic() - t0)))

        self._tasks = [asyncio.create_task(loop(n)) for n in self.nodes]

    async def stop(self) -> None:
        """Stop the loops and the health listener, and close the clients."""
        if self._health is not None:
            self._health.should_exit = True
            await asyncio.sleep(0.2)  # uvicorn's main loop looks every 0.1 s
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for n in self.nodes:
            if n.stream is not None:
                await n.stream.close()
            await n.client.aclose()

    async def settle(self, timeout_s: float = 120.0, window_s: float = 2.0) -> float:
        """Wait until the fleet is in its steady state: a window of ``window_s`` in which
        at least 90 % of the nodes' heartbeats a second were answered and no more listed
        their held ids than the periodic one in :data:`~forkyard.cluster.messages.FULL_EVERY`
        does (after a seed or a fill every node sends a full heartbeat, and the scheduler
        reconciles it; a node declared down meanwhile is adopted again). Returns
        the seconds waited; raises ``TimeoutError`` past ``timeout_s``."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            b0, f0 = sum(n.beats for n in self.nodes), sum(n.full_beats for n in self.nodes)
            await asyncio.sleep(window_s)
            beats = sum(n.beats for n in self.nodes) - b0
            full = sum(n.full_beats for n in self.nodes) - f0
            expected = len(self.nodes) * window_s / HEARTBEAT_INTERVAL_S
            if beats >= 0.9 * expected and full <= 1.5 * expected / FULL_EVERY + 1:
                return time.monotonic() - t0
        raise TimeoutError(f"the fleet did not settle within {timeout_s:.0f} s")

    def errors(self) -> list[str]:
        """Every heartbeat or publish error so far."""
        return [e for n in self.nodes for e in n.errors]
