"""Lifecycle benchmark: forkyard (real e2b SDK) vs raw runsc, same rootfs, same run.

Prints p50/p95 (ms) of pause, resume, snapshot of an idle sandbox and of one that has
just written 100 MB, fork ×1/×4/×16 (until every child's envd answers) — and the raw
``runsc checkpoint --leave-running`` / ``runsc restore --detach`` of a sandbox of the same
template, plus raw checkpoint + N parallel restores, with ratios.

Usage: ``python bench/bench_lifecycle.py [-n 10] [--forks 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings  # noqa: E402
from forkyard.network.slots import NetworkManager  # noqa: E402
from forkyard.runtime.base import SandboxSpec  # noqa: E402
from forkyard.runtime.gvisor.driver import GVisorDriver  # noqa: E402


async def _healthy(ip: str) -> None:
    async with httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for _ in range(2000):
            try:
                if (await c.get(f"http://{ip}:49983/health", timeout=1)).status_code < 300:
                    return
            except httpx.HTTPError:
                await asyncio.sleep(0.005)
    raise RuntimeError(f"envd at {ip} never answered")


async def raw(rootfs: Path, n: int, forks: int, fan: list[int]) -> dict[str, list[float]]:
    """Raw runsc timings (ms) on an envd sandbox: checkpoint, restore (until
    ``runsc restore --detach`` returns), and checkpoint + k parallel restores for each
    k in ``fan``."""
    settings = Settings(data_dir=DATA / "raw")
    net = NetworkManager(settings, outer_net="10.241.0.0/16", prefix="fbr")
    net.setup_host()
    drv = GVisorDriver(settings)
    ids = ["src", "kid", *(f"k{j:02d}x" for j in range(max(fan)))]
    for sid in ids:  # leftovers of an interrupted earlier run
        await drv.destroy(sid, settings.sandboxes_dir / sid)
    slots = [net.allocate(i) for i in range(max(fan) + 1)]

    def spec(sid: str, i: int) -> SandboxSpec:
        return SandboxSpec(sandbox_id=sid, rootfs=rootfs, netns_path=slots[i].netns_path, vcpus=2,
                           memory_mb=512, hostname="raw", workdir=settings.sandboxes_dir / sid)

    out: dict[str, list[float]] = {"ckpt": [], "restore": []}
    img = settings.data_dir / "img"
    try:
        await drv.create(spec("src", 0))
        await _healthy(slots[0].outer_ip)
        for i in range(n):
            shutil.rmtree(img, ignore_errors=True)
            t = time.perf_counter()
            await drv.checkpoint("src", img, leave_running=True)
            out["ckpt"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            await drv.restore(spec("kid", 1), img)
            out["restore"].append((time.perf_counter() - t) * 1000)
            await drv.destroy("kid", settings.sandboxes_dir / "kid")
        for k in fan:
            out[f"fork{k}"] = []
            for _ in range(forks):
                shutil.rmtree(img, ignore_errors=True)
                t = time.perf_counter()
                await drv.checkpoint("src", img, leave_running=True)

                async def one(j: int) -> None:
                    await drv.restore(spec(f"k{j:02d}x", j + 1), img)

                await asyncio.gather(*(one(j) for j in range(k)))
                out[f"fork{k}"].append((time.perf_counter() - t) * 1000)
                await asyncio.gather(*(drv.destroy(f"k{j:02d}x", settings.sandboxes_dir / f"k{j:02d}x") for j in range(k)))
    finally:
        for sid in ids:
            await drv.destroy(sid, settings.sandboxes_dir / sid)
        for s in slots:
            net.release(s.index)
        net.teardown_host()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=10, help="iterations for pause/resume/snapshot")
    ap.add_argument("--forks", type=int, default=5, help="iterations per fork size")
    args = ap.parse_args()
    fan = [1, 4, 16]
    templates = templates_dir()
    rawt = asyncio.run(raw(templates / "base" / "rootfs", args.n, args.forks, fan))

    proc, url, key = start_server(templates)
    from e2b import Sandbox

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120)
    res: dict[str, list[float]] = {k: [] for k in ("pause", "resume", "snap_idle", "snap_100mb", *(f"fork{k}" for k in fan))}
    try:
        sbx = Sandbox.create("base", timeout=3600)
        for _ in range(args.n):
            t = time.perf_counter()
            sbx.pause()
            res["pause"].append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={"timeout": 3600})
            res["resume"].append((time.perf_counter() - t) * 1000)
            assert r.status_code == 201, r.text
        sbx = Sandbox.connect(sbx.sandbox_id)
        for i in range(args.n):
            t = time.perf_counter()
            info = sbx.create_snapshot()
            res["snap_idle"].append((time.perf_counter() - t) * 1000)
            Sandbox.delete_snapshot(info.snapshot_id)
            sbx.commands.run(f"head -c 100M /dev/urandom > /tmp/blob{i % 2}")
            t = time.perf_counter()
            info = sbx.create_snapshot()
            res["snap_100mb"].append((time.perf_counter() - t) * 1000)
            Sandbox.delete_snapshot(info.snapshot_id)
        sbx.commands.run("rm -f /tmp/blob*")
        for k in fan:
            for _ in range(args.forks):
                t = time.perf_counter()
                kids = sbx.fork(count=k, timeout=120)
                res[f"fork{k}"].append((time.perf_counter() - t) * 1000)
                bad = [x for x in kids if isinstance(x, Exception)]
                assert not bad, bad
                for kid in kids:
                    kid.kill()
        sbx.kill()
    finally:
        stop_server(proc)

    print(f"\nforkyard lifecycle benchmark, n={args.n}, forks n={args.forks}")
    print(row("raw runsc checkpoint --leave-running", rawt["ckpt"]))
    print(row("raw runsc restore --detach", rawt["restore"]))
    for k in fan:
        print(row(f"raw checkpoint + {k} parallel restores", rawt[f"fork{k}"]))
    print(row("pause", res["pause"], rawt["ckpt"]))
    print(row("resume", res["resume"], rawt["restore"]))
    print(row("snapshot (idle)", res["snap_idle"], rawt["ckpt"]))
    print(row("snapshot (after 100 MB write)", res["snap_100mb"], rawt["ckpt"]))
    for k in fan:
        print(row(f"fork x{k} (all children answer)", res[f"fork{k}"], rawt[f"fork{k}"]))


if __name__ == "__main__":
    main()
