"""Control-plane benchmark with a simulated fleet (issue 26): N nodes, B sandboxes.

A real ``redis-server`` (AOF on, ``appendfsync everysec`` as deploy/ runs it), real
``forkyard scheduler`` replicas and a real ``forkyard gateway`` (subprocesses), and N
simulated nodes in this process (``tests/_fleet.py``) that heartbeat every second and
publish their rows through the node agent's own message builders
(:mod:`forkyard.cluster.messages`) — a protocol change breaks this bench, not silently
its numbers. No runsc needed.

Prints, with the ratio to a raw Redis round trip (``HGET`` of a node's hash from this
process) measured in the same run:

* placement p50/p95 with 1 client and with ``--clients`` clients (spread over the
  replicas; each placed create reaches its node, which acknowledges it), placements/s
  and the schedulers' CPU per placement; the clients run in processes of their own
  (``_placer.py``), off this process's event loop, which the fleet keeps busy;
* the schedulers' CPU (% of one core, all replicas together) with heartbeats only, the
  heartbeats answered per second and the CPU per heartbeat (ms: what compares runs on a
  loaded host, where the fleet sends fewer than N a second);
* gateway ``GET /v2/sandboxes`` p50/p95 (first page, a later page, a metadata filter,
  ``state=paused``) and ``GET /metrics/cluster`` p50 at each of ``--list-sizes``;
* with ``--bare-http``, first: the same fleet against a bare ASGI app on uvicorn
  (``_bare_beat_server.py``, the scheduler's server options, no forkyard code), its CPU
  per request — the HTTP floor under every heartbeat, measured in the same run;
* with ``--beat-stream``: the fleet's heartbeats go over one WebSocket a node, as a
  node's with ``FORKYARD_BEAT_STREAM=on`` (:mod:`forkyard.cluster.beatstream`);
* ``over-granted``: sandboxes a node was given beyond its room (the nodes' capacities
  add up to exactly what the run places, and a last fill takes every place left: must
  be 0).

Usage: ``python bench/bench_control_plane.py --nodes 100 --sandboxes 10000
[--placements 400] [--clients 8] [--schedulers 2] [--list-sizes 1000,10000] [--redis-unix] [--bare-http]
[--beat-stream]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from _common import pct  # noqa: E402

import redis.asyncio as aioredis  # noqa: E402

from _fleet import ControlPlane, Fleet, cpu_seconds  # noqa: E402


def line(name: str, xs: list[float], raw: float) -> str:
    """``name``: p50/p95 (ms) and p50 / raw Redis p50."""
    return f"{name:<58} p50 {pct(xs, 50):8.2f} ms  p95 {pct(xs, 95):8.2f} ms  ({pct(xs, 50) / raw:6.1f}x raw Redis)"


async def raw_redis_ms(url: str, node_id: str, n: int = 300) -> list[float]:
    """Round trips (ms) of ``HGET fy:node:<id> last_seen`` from this process."""
    r = aioredis.from_url(url)
    out = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await r.hget(f"fy:node:{node_id}", "last_seen")
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        await r.aclose()
    return out


class Placer:
    """Placement clients in processes of their own (``_placer.py``: the fleet's event loop
    here would otherwise delay them), ``per_process`` clients each: ``POST /v1/placements``
    to a replica, then the create "reaches" the chosen node here (rows appear there,
    acknowledged in its next heartbeat)."""

    def __init__(self, cp: ControlPlane, fleet: Fleet, per_process: int = 4):
        self.cp, self.fleet, self.per_process = cp, fleet, per_process
        self.refused = 0

    async def _worker(self, urls: list[str], total: int, clients: int, lat: list[float], times: list[float]) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(ROOT / "bench" / "_placer.py"), ",".join(urls), str(total), str(clients),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        proc.stdin.write(self.cp.secret.encode() + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        async for raw in proc.stdout:
            msg = json.loads(raw)
            if "start" in msg:
                times.append(msg["start"])
                continue
            if msg.get("refused"):
                self.refused += 1
                continue
            lat.append(msg["ms"])
            times.append(msg["t"])
            for p in msg["placements"]:
                self.fleet.by_id[p["nodeID"]].start(p["count"], p.get("placementID"))
        if await proc.wait() != 0:
            raise RuntimeError("a placement client failed (its error is above)")

    async def run(self, total: int, clients: int, until_full: bool = False) -> tuple[list[float], float]:
        """``total`` placements by ``clients`` concurrent clients (``until_full``: until
        every one is refused for capacity). Returns (latencies ms, wall s: from the first
        client's start to the last answer, the processes' start-up left out)."""
        lat: list[float] = []
        times: list[float] = []
        urls = self.cp.scheduler_urls
        procs = max(1, math.ceil(clients / self.per_process))
        jobs = []
        for i in range(procs):
            n = min(self.per_process, clients - i * self.per_process)
            share = 0 if until_full else total // procs + (1 if i < total % procs else 0)
            if until_full or share:
                # client k of this process uses urls[k % len]: offset so replicas take turns overall
                rot = urls[(i * self.per_process) % len(urls):] + urls[:(i * self.per_process) % len(urls)]
                jobs.append(self._worker(rot, share, n, lat, times))
        await asyncio.gather(*jobs)
        return lat, (max(times) - min(times)) if len(times) > 1 else 0.0


async def timed_gets(cp: ControlPlane, path: str, n: int, **params) -> tuple[list[float], dict[str, str]]:
    """``n`` sequential GETs of the gateway's ``path``, from a process of their own
    (``_getter.py``: off this process's event loop, which the fleet keeps busy);
    (latencies ms, the last answer's headers)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "bench" / "_getter.py"), cp.gateway_url, path, str(n), json.dumps(params),
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    got, _ = await proc.communicate(cp.api_key.encode() + b"\n")
    if proc.returncode != 0:
        raise RuntimeError(f"GET {path} failed (its error is above)")
    res = json.loads(got)
    return res["ms"], res["headers"]


async def bare_http_floor(n: int, seconds: float) -> tuple[float, float]:
    """``n`` simulated nodes heartbeating a bare ASGI app on uvicorn
    (``_bare_beat_server.py``: the scheduler's server options, no forkyard code) for
    ``seconds``. Returns (that server's CPU per request in ms, requests per second)."""
    import subprocess

    from conftest import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "_bare_beat_server.py"), str(port)])
    fleet = Fleet(n, 1, [f"http://127.0.0.1:{port}"], "unused")
    try:
        for _ in range(200):
            try:
                await fleet.nodes[0].beat()
                break
            except Exception:  # noqa: BLE001 — not listening yet
                await asyncio.sleep(0.05)
        fleet.run()
        await asyncio.sleep(2)
        c0, t0, b0 = cpu_seconds(proc.pid), time.perf_counter(), sum(x.beats for x in fleet.nodes)
        await asyncio.sleep(seconds)
        wall = time.perf_counter() - t0
        cpu_s, beats = cpu_seconds(proc.pid) - c0, sum(x.beats for x in fleet.nodes) - b0
        return cpu_s / max(beats, 1) * 1000, beats / wall
    finally:
        await fleet.stop()
        proc.terminate()
        proc.wait(10)


async def main(a) -> int:
    if a.bare_http:
        per, rate = await bare_http_floor(a.nodes, a.cpu_seconds)
        print(f"{'bare uvicorn POST (no forkyard code): per s / CPU per request':<58} {rate:6.1f} /s  "
              f"{per:6.3f} ms  ({per * rate / 10:4.1f} % of a core)", flush=True)
    root = Path(a.root or tempfile.mkdtemp(prefix="fy-cpbench-"))
    cp = ControlPlane(root, schedulers=a.schedulers, unix_socket=a.redis_unix)
    # Capacity: the seeded sandboxes + both placement phases fill the nodes; the last fill takes the rest.
    room = math.ceil((a.sandboxes + 2 * a.placements) / a.nodes)
    fleet = Fleet(a.nodes, room, cp.scheduler_urls, cp.secret, stream=a.beat_stream)
    print(f"# {a.nodes} nodes (room {room} each), {a.sandboxes} sandboxes, {a.schedulers} scheduler replica(s), "
          f"{a.clients} clients; load before: {os.getloadavg()[0]:.1f}", flush=True)
    try:
        cp.start()
        await fleet.serve_health()  # a late heartbeat on a loaded host must not take a node out
        await fleet.register()
        fleet.run()
        raw = await raw_redis_ms(cp.redis_url, fleet.nodes[0].node_id)
        raw50 = pct(raw, 50)
        print(f"{'raw Redis round trip (HGET)':<58} p50 {raw50:8.3f} ms  p95 {pct(raw, 95):8.3f} ms", flush=True)
        seeded = 0
        sizes = sorted({int(s) for s in a.list_sizes.split(",") if s} | {a.sandboxes})
        # (the list figures' GETs run in processes of their own: timed_gets)
        for size in sizes:
            if size > a.sandboxes:
                continue
            t0 = time.perf_counter()
            await fleet.seed(size - seeded, metadata=lambda i, base=seeded: {"user": f"u{(base + i) % 100}",
                                                                              "run": "bench"}, paused_every=10)
            seeded = size
            print(f"# seeded {seeded} sandboxes in {time.perf_counter() - t0:.1f} s", flush=True)
            if str(size) not in a.list_sizes.split(","):
                continue
            await fleet.settle()  # not while the seed's full heartbeats are reconciled
            first, h = await timed_gets(cp, "/v2/sandboxes", a.reps, limit=100)
            token = h.get("x-next-token")
            later, _ = await timed_gets(cp, "/v2/sandboxes", a.reps, limit=100, nextToken=token) \
                if token else ([0.0], None)
            meta, _ = await timed_gets(cp, "/v2/sandboxes", a.reps, limit=100, metadata="user=u7")
            paused, _ = await timed_gets(cp, "/v2/sandboxes", a.reps, limit=100, state="paused")
            metrics, _ = await timed_gets(cp, "/metrics/cluster", a.reps)
            print(line(f"gateway GET /v2/sandboxes first page at {size}", first, raw50))
            print(line(f"gateway GET /v2/sandboxes later page at {size}", later, raw50))
            print(line(f"gateway GET /v2/sandboxes metadata=user=u7 at {size}", meta, raw50))
            print(line(f"gateway GET /v2/sandboxes state=paused at {size}", paused, raw50))
            print(line(f"gateway GET /metrics/cluster at {size}", metrics, raw50), flush=True)
        # Every node sends its full set after the seed and the scheduler reconciles it (and a
        # node the seed's publishing starved of heartbeats — they share this process — may
        # have been declared down and is adopted again): measure the steady state after.
        waited = await fleet.settle()
        print(f"# steady after {waited:.0f} s (a node lists its held ids every FULL_EVERY beats)", flush=True)
        pids = cp.pids("scheduler")
        c0, t0, b0 = sum(cpu_seconds(p) for p in pids), time.perf_counter(), sum(n.beats for n in fleet.nodes)
        s0 = sum(n.streamed for n in fleet.nodes)
        await asyncio.sleep(a.cpu_seconds)
        wall = time.perf_counter() - t0
        cpu_s, beats = sum(cpu_seconds(p) for p in pids) - c0, sum(n.beats for n in fleet.nodes) - b0
        print(f"{f'scheduler CPU with heartbeats only ({seeded} sandboxes)':<58} {cpu_s / wall * 100:6.1f} % of a core "
              f"({len(pids)} replica(s) together; load {os.getloadavg()[0]:.1f})", flush=True)
        # On a loaded host the fleet sends fewer than N beats a second: CPU per beat compares runs.
        over = f"  ({(sum(n.streamed for n in fleet.nodes) - s0) / max(1, beats):.0%} over streams)" \
            if a.beat_stream else ""
        print(f"{'heartbeats answered per s / scheduler CPU per heartbeat':<58} {beats / wall:6.1f} /s  "
              f"{cpu_s / max(beats, 1) * 1000:6.3f} ms{over}", flush=True)
        placer = Placer(cp, fleet)
        # The seed publishes rows without placements (as a restarted node does), spread
        # in steps that may leave a node one over its room: what counts is what was
        # placed beyond the room the seed left.
        cap = {n.node_id: max(n.max_sandboxes, n.report().running) for n in fleet.nodes}
        one, _ = await placer.run(a.placements, 1)
        print(line(f"placement p50, 1 client ({seeded} sandboxes)", one, raw50), flush=True)
        c0 = sum(cpu_seconds(p) for p in pids)
        many, wall = await placer.run(a.placements, a.clients)
        per = (sum(cpu_seconds(p) for p in pids) - c0) / max(len(many), 1) * 1000
        print(line(f"placement p50, {a.clients} clients", many, raw50)
              + f"  {len(many) / max(wall, 1e-9):7.0f} placements/s", flush=True)
        print(f"{'scheduler CPU per placement (heartbeats in the same time included)':<58} {per:6.3f} ms", flush=True)
        # The last fill: until a round takes nothing. A round ends at each client's first
        # 503, which may come while a node's room is still held by placements it started
        # but has not acknowledged yet (they count until its next heartbeat): wait for the
        # acks and fill again.
        rest: list[float] = []
        while True:
            await asyncio.sleep(1.5)  # acks land
            more, _ = await placer.run(0, a.clients, until_full=True)
            rest += more
            if not more:
                break
        running = {n.node_id: n.report().running for n in fleet.nodes}  # paused ones take no room
        over = sum(max(0, running[nid] - cap[nid]) for nid in cap)
        held = sum(running.values())
        print(f"# filled to capacity: {held} of {sum(cap.values())} places taken ({len(rest)} in the last fill); "
              f"heartbeat errors {len(fleet.errors())}; load after {os.getloadavg()[0]:.1f}")
        print(f"over-granted: {over}", flush=True)
        for e in fleet.errors()[:3]:
            print("#   ", e)
        return 1 if over or held != sum(cap.values()) else 0
    finally:
        await fleet.stop()
        cp.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=10)
    ap.add_argument("--sandboxes", type=int, default=1000)
    ap.add_argument("--placements", type=int, default=200, help="placements per phase (1 client, N clients)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--schedulers", type=int, default=2)
    ap.add_argument("--list-sizes", default="1000", help="comma-separated sandbox counts to measure listing at")
    ap.add_argument("--reps", type=int, default=10, help="GETs per listing measurement")
    ap.add_argument("--cpu-seconds", type=float, default=10.0)
    ap.add_argument("--redis-unix", action="store_true", help="the control plane reaches Redis over a Unix socket")
    ap.add_argument("--bare-http", action="store_true",
                    help="first measure the same fleet against a bare ASGI app on uvicorn (the HTTP floor)")
    ap.add_argument("--beat-stream", action="store_true",
                    help="heartbeats over one WebSocket a node (FORKYARD_BEAT_STREAM=on)")
    ap.add_argument("--root", help="state directory (default: a new temporary one; removed at the end)")
    args = ap.parse_args()
    # SIGTERM (e.g. from `timeout`) ends the run through its `finally`, which stops the
    # control plane's processes (they run in sessions of their own and were left behind).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(asyncio.run(main(args)))
