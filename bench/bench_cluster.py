"""Cluster benchmark: the same operations through the gateway and straight to a node, in
one run, through the real e2b SDK (issue 8's goal: gateway ≤ 1.15× the node at p50).

Prints p50/p95 (ms) and the gateway/node ratio of
  * create from ``base`` (until envd answers);
  * ``commands.run("true")``;
  * 1 MiB ``files.write`` + ``files.read``;
  * fork ×4 (REST, children running);
then throughput — creates/s and commands/s through one gateway with 3 nodes up vs with
only 1 (the others drained) — and resume on another node (the paused sandbox's node
drained, so it moves and restores from the shared repository) vs resume on the same node.

All nodes share this host's CPUs, so "3 nodes vs 1" measures the control plane's
overhead and spread, not added hardware. Gateway and direct calls alternate, so drift
hits both sides alike.

Usage: ``python bench/bench_cluster.py [-n 10]`` (root; data under
``$FORKYARD_TEST_DATA_DIR`` or ``/var/lib/forkyard-test``, ``base`` built there if missing).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from _common import row  # noqa: E402

import httpx  # noqa: E402
from e2b import Sandbox  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def drained(c, keep: set[str]):
    """Context: every node not in ``keep`` drained (undrained after)."""

    class _Ctx:
        def __enter__(self):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    if f"node{i}" not in keep:
                        s.post(f"/v1/nodes/node{i}/drain")

        def __exit__(self, *exc):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    s.post(f"/v1/nodes/node{i}/undrain")

    return _Ctx()


def node_url(c, sandbox_id: str) -> str:
    return c.node_urls[int(c.owner(sandbox_id)[4:])]


def sdk(url: str, key: str) -> dict:
    return {"api_url": url, "sandbox_url": url, "api_key": key}


def latency(c, n: int) -> None:
    gw = c.sdk
    direct = sdk(c.node_urls[0], c.api_key)
    res: dict[str, dict[str, list[float]]] = {k: {"gateway": [], "node": []}
                                              for k in ("create", "commands.run(true)", "1 MiB write+read", "fork x4")}
    blob = os.urandom(1 << 20)
    with drained(c, {"node0"}):  # both sides on node0: same node, same cache
        for i in range(n):
            for side, opts in (("gateway", gw), ("node", direct)) if i % 2 else (("node", direct), ("gateway", gw)):
                box: list[Sandbox] = []
                res["create"][side].append(timed(lambda: box.append(Sandbox.create("base", timeout=120, **opts))))
                sbx = box[0]
                sbx.commands.run("true")  # warm the connection like a client in a loop
                res["commands.run(true)"][side].append(timed(lambda: sbx.commands.run("true")))

                def rw():
                    sbx.files.write("/home/user/blob", blob)
                    assert len(sbx.files.read("/home/user/blob", format="bytes")) == len(blob)

                res["1 MiB write+read"][side].append(timed(rw))
                base = opts["api_url"]
                with httpx.Client(base_url=base, headers={"X-API-Key": c.api_key}, timeout=300) as h:
                    out: list = []
                    res["fork x4"][side].append(timed(lambda: out.append(
                        h.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 4, "timeout": 60}))))
                    for x in out[0].json():
                        h.delete(f"/sandboxes/{x['sandbox']['sandboxID']}")
                sbx.kill()
    print("\n== through the gateway vs straight to the node (same node) ==")
    for name, sides in res.items():
        print(row(f"{name} node", sides["node"]))
        print(row(f"{name} gateway", sides["gateway"], sides["node"]))


def throughput(c, total: int, conc: int) -> None:
    print(f"\n== throughput through one gateway ({total} creates, then {total * 5} commands; {conc} at a time) ==")
    for label, keep in (("1 node", {"node0"}), ("3 nodes", {"node0", "node1", "node2"})):
        with drained(c, keep):
            boxes: list[Sandbox] = []
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(conc) as pool:
                boxes = list(pool.map(lambda _: Sandbox.create("base", timeout=300, **c.sdk), range(total)))
            creates = total / (time.perf_counter() - t0)
            spread = sorted({c.owner(b.sandbox_id) for b in boxes})
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(conc) as pool:
                list(pool.map(lambda i: boxes[i % total].commands.run("true"), range(total * 5)))
            cmds = total * 5 / (time.perf_counter() - t0)
            with concurrent.futures.ThreadPoolExecutor(conc) as pool:
                list(pool.map(lambda b: b.kill(), boxes))
        print(f"{label:<8} creates/s {creates:6.2f}   commands/s {cmds:7.1f}   (nodes used: {', '.join(spread)})")


def resume(c, n: int) -> None:
    same, other = [], []
    for _ in range(n):
        with drained(c, {"node1"}):
            sbx = Sandbox.create("base", timeout=300, **c.sdk)
        sbx.files.write("/home/user/x", "y")
        sbx.pause()
        same.append(timed(lambda: Sandbox.connect(sbx.sandbox_id, **c.sdk)))
        sbx.pause()
        with c.sched() as s:
            s.post("/v1/nodes/node1/drain")
        time.sleep(0.6)  # the gateway reuses its node list for 0.5 s (NODES_TTL_S)
        try:
            other.append(timed(lambda: Sandbox.connect(sbx.sandbox_id, **c.sdk)))
            assert c.owner(sbx.sandbox_id) != "node1"
        finally:
            with c.sched() as s:
                s.post("/v1/nodes/node1/undrain")
        sbx.kill()
    print("\n== resume (connect of a paused sandbox, through the gateway) ==")
    print(row("resume on the same node", same))
    print(row("resume on another node", other, same))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=10, help="iterations per latency (default 10)")
    ap.add_argument("--creates", type=int, default=12, help="sandboxes in the throughput run (default 12)")
    ap.add_argument("--concurrency", type=int, default=6, help="concurrent clients (default 6)")
    args = ap.parse_args()
    from _cluster import Cluster
    from conftest import TEST_ROOT
    from forkyard.config import Settings
    from forkyard.templates.base import build_base

    build_base(Settings(data_dir=TEST_ROOT), progress=lambda line: None)
    c = Cluster(TEST_ROOT / "bench-cluster", nodes=3)
    try:
        c.start()
        latency(c, args.n)
        throughput(c, args.creates, args.concurrency)
        resume(c, max(3, args.n // 2))
    finally:
        c.close()
    print(f"\n(p50/p95 nearest rank; {os.cpu_count()} CPUs shared by every node; logs under {c.root})")


if __name__ == "__main__":
    main()
