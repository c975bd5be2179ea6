"""CPU per ``GET /metrics/cluster`` of the gateway's REST app (issue 26).

A real ``redis-server`` holding ``--nodes`` node records (written by the scheduler's own
heartbeat script, each report listing 20 cached snapshots) and the gateway's REST app
(:func:`forkyard.cluster.gateway_rest.rest_app`, over a view whose ``nodes()`` reads them
as :class:`~forkyard.cluster.gateway.Gateway` does) called in a loop through httpx's ASGI
transport for ``--seconds``. Prints the CPU time of this process per request (p50, max)
and the wall time: CPU, unlike latency, hardly depends on what else the host runs.

Usage: ``python bench/bench_cluster_metrics.py [--nodes 300] [--seconds 5]``; to compare
two trees, run it with ``PYTHONPATH=<tree>`` for each.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import tempfile
import time

import httpx

from forkyard.cluster.gateway_rest import rest_app
from forkyard.cluster.store import ClusterStore
from forkyard.cluster.types import NodeReport


class _View:
    """What ``rest_app`` uses of the gateway: the store and its node list."""

    def __init__(self, store: ClusterStore):
        self.store = store

    async def nodes(self, fresh: bool = False, stale_ok: bool = True) -> dict:
        return {n.node_id: n for n in await self.store.nodes()}

    async def aclose(self) -> None:
        pass


async def main(a) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="fy-metricsbench-")
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", d, "--save", ""],
                             stdout=subprocess.DEVNULL)
    store = ClusterStore(f"redis://127.0.0.1:{port}/0")
    try:
        while not await store.ping():
            await asyncio.sleep(0.05)
        rep = NodeReport(vcpus=16, memory_mb=65536, max_sandboxes=168, running=150, paused=16, free_slots=8,
                         runtime="simulated", cached_snapshots=[f"snap{i}" for i in range(20)], boot="b")
        for i in range(a.nodes):
            await store.heartbeat(f"sim{i:04d}", f"http://127.0.0.1:9/sim{i:04d}", rep)
        app = rest_app(_View(store))
        cpu, wall = [], []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            end = time.monotonic() + a.seconds
            while time.monotonic() < end:
                c0, w0 = time.process_time(), time.perf_counter()
                r = await c.get("/metrics/cluster")
                cpu.append((time.process_time() - c0) * 1000)
                wall.append((time.perf_counter() - w0) * 1000)
                assert r.status_code == 200 and len(r.json()["nodes"]) == a.nodes, r.text[:200]
                await asyncio.sleep(0.05)
        cpu.sort(), wall.sort()
        print(f"GET /metrics/cluster over {a.nodes} nodes: {len(cpu)} requests in {a.seconds:.0f} s; CPU p50 "
              f"{cpu[len(cpu) // 2]:.2f} ms, max {cpu[-1]:.2f} ms; wall p50 {wall[len(wall) // 2]:.2f} ms "
              f"(load {os.getloadavg()[0]:.1f})")
    finally:
        await store.aclose()
        redis.terminate()
        redis.wait()
        subprocess.run(["rm", "-rf", d], check=False)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    asyncio.run(main(ap.parse_args()))
