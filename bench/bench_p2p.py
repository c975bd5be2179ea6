"""P2P read path benchmark (issue 24): repository bytes read and restore latency for a
fan-out of one snapshot over the nodes of a 3-node cluster, P2P off vs on.

For each mode a fresh cluster (``tests/_cluster.py``: real redis, scheduler, gateway,
3 node processes, a shared posix_fs repository on this host) with ``FORKYARD_P2P`` off /
on: a sandbox on node0 takes a snapshot (committed to the repository; node0's cache
keeps the image), then one sandbox is created from that snapshot on every other node in
turn (the others drained), and a paused sandbox of node0 is resumed on node1 (node0
drained). Printed per mode: create/resume latency (ms, through the gateway, until envd
answers) and, summed over the restoring nodes, the stored bytes read from the repository
and from peers (``/metrics/repository``).

Not measured here: the repository slowed to 1 Gbit/s by traffic shaping (the posix_fs
repository is this host's disk, so "from the repository" is about as fast as a peer);
the figure that matters is the bytes.

Usage: ``python bench/bench_p2p.py [-n 3]`` (root; data under ``$FORKYARD_TEST_DATA_DIR``
or ``/var/lib/forkyard-test``, ``base`` built there if missing).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from _common import row  # noqa: E402

import httpx  # noqa: E402
from e2b import Sandbox  # noqa: E402


def only_on(c, node: str):
    """Context: every node but ``node`` drained (undrained after)."""

    class _Ctx:
        def __enter__(self):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    if f"node{i}" != node:
                        s.post(f"/v1/nodes/node{i}/drain")
            time.sleep(0.6)  # the gateway reuses its node list for 0.5 s

        def __exit__(self, *exc):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    s.post(f"/v1/nodes/node{i}/undrain")

    return _Ctx()


def reads(c) -> tuple[int, int]:
    """``(repository bytes, peer bytes)`` the nodes read for restores so far (stored bytes)."""
    repo = peers = 0
    for url in c.node_urls:
        m = httpx.get(f"{url}/metrics/repository", headers={"X-API-Key": c.api_key}, timeout=10).json()
        repo += m["restore"]["bytes_fetched"]
        peers += m.get("p2p", {}).get("bytes_from_peers", 0)
    return repo, peers


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1000, out


def one_mode(p2p: bool, n: int) -> dict:
    from _cluster import Cluster
    from conftest import TEST_ROOT

    env = {"FORKYARD_P2P": "on", "FORKYARD_P2P_BIND": "127.0.0.1:0"} if p2p else None
    c = Cluster(TEST_ROOT / f"bench-p2p-{'on' if p2p else 'off'}", nodes=3, env=env)
    out = {"create": [], "resume": [], "image": 0, "fan_repo": [], "fan_peers": [], "res_repo": [], "res_peers": []}
    try:
        c.start()
        time.sleep(2.5)  # every node has heard of its peers
        for _ in range(n):
            with only_on(c, "node0"):
                src = Sandbox.create("base", timeout=300, **c.sdk)
                src.commands.run("head -c 32M /dev/urandom > /dev/shm/blob", timeout=60)
                snap = src.create_snapshot()
            before = reads(c)
            for node in ("node1", "node2"):
                with only_on(c, node):
                    ms, child = timed(lambda: Sandbox.create(snap.snapshot_id, timeout=300, **c.sdk))
                out["create"].append(ms)
                child.kill()
            after = reads(c)
            out["fan_repo"].append(after[0] - before[0])
            out["fan_peers"].append(after[1] - before[1])
            src.pause()
            before = reads(c)
            with only_on(c, "node1"):
                time.sleep(1.2)  # node1's peer table lists node0's new image
                ms, moved = timed(lambda: Sandbox.connect(src.sandbox_id, timeout=300, **c.sdk))
            out["resume"].append(ms)
            after = reads(c)
            out["res_repo"].append(after[0] - before[0])
            out["res_peers"].append(after[1] - before[1])
            moved.kill()
            Sandbox.delete_snapshot(snap.snapshot_id, **c.sdk)
    finally:
        c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=3, help="rounds per mode (default 3)")
    args = ap.parse_args()
    from conftest import TEST_ROOT
    from forkyard.config import Settings
    from forkyard.templates.base import build_base

    build_base(Settings(data_dir=TEST_ROOT), progress=lambda line: None)
    results = {mode: one_mode(mode == "on", args.n) for mode in ("off", "on")}
    mb = 1 << 20
    for mode, r in results.items():
        print(f"\n== P2P {mode} ({args.n} rounds) ==")
        print(row("create from node0's snapshot on node1, node2", r["create"]))
        print(row("resume node0's paused sandbox on node1", r["resume"]))
        print(f"fan-out to 2 nodes, per round: repository {[round(x / mb, 1) for x in r['fan_repo']]} MB, "
              f"peers {[round(x / mb, 1) for x in r['fan_peers']]} MB")
        print(f"resume elsewhere, per round: repository {[round(x / mb, 1) for x in r['res_repo']]} MB, "
              f"peers {[round(x / mb, 1) for x in r['res_peers']]} MB")
    print(f"\n(stored = compressed bytes; p50/p95 nearest rank; {os.cpu_count()} CPUs shared by every node; "
          f"load {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
