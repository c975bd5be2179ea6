"""Warm pool benchmark: create from ``base`` served from the pool vs a cold create vs the
raw runtime operation, all in one run on the same rootfs.

Prints p50/p95 (ms) of
  * raw: ``runsc run --detach`` of the ``base`` rootfs with envd as init, until envd
    answers ``/health`` (each in a fresh network slot made before the timer) — what a
    cold create cannot avoid, measured as bench_core.py does;
  * pooled create (server with ``FORKYARD_POOL=base:2``): server-side (the answer's
    ``Server-Timing`` ``total``, and its ``pool`` hand-out phase), through REST (client
    side, ``POST /sandboxes``) and through the e2b SDK (``Sandbox.create``);
  * cold create (a server with ``FORKYARD_POOL=off``): the same three.
Ratios are to the raw operation (S-T = the answer's Server-Timing header). Every pooled
create is timed with the pool full and no refill running (checked through
``GET /metrics/node``, not slept): it measures the hand-out, not a burst larger than the
pool (which starts cold).

    .venv/bin/python bench/bench_pool.py -n 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings  # noqa: E402
from forkyard.network.slots import NetnsNetwork  # noqa: E402
from forkyard.runtime.base import SandboxSpec  # noqa: E402
from forkyard.runtime.gvisor.driver import GVisorDriver  # noqa: E402


async def raw_run(settings: Settings, rootfs: Path, n: int) -> list[float]:
    """``runsc run --detach`` until envd answers ``/health``, ms, ``n`` times."""
    net = NetnsNetwork(settings, outer_net="10.123.0.0/16", prefix="fbp")
    net.setup_host()
    driver = GVisorDriver(settings)
    out: list[float] = []
    try:
        async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
            for i in range(n):
                sid = f"rawpool{i}"
                slot = net.allocate(i)
                spec = SandboxSpec(sandbox_id=sid, rootfs=rootfs, network=slot.attachment, vcpus=2,
                                   memory_mb=512, hostname="raw", workdir=settings.sandboxes_dir / sid)
                t = time.perf_counter()
                await driver.create(spec)
                while True:
                    try:
                        if (await client.get(f"http://{slot.outer_ip}:49983/health")).status_code < 500:
                            break
                    except httpx.HTTPError:
                        await asyncio.sleep(0.002)
                out.append((time.perf_counter() - t) * 1000)
                await driver.destroy(sid, spec.workdir)
                net.release(i)
    finally:
        net.teardown_host()
    return out


def _phase(r: httpx.Response, name: str) -> float:
    for part in r.headers.get("server-timing", "").split(","):
        key, _, dur = part.strip().partition(";dur=")
        if key == name:
            return float(dur)
    raise AssertionError(f"no {name!r} in Server-Timing {r.headers.get('server-timing')!r}")


def _pool_full(api: httpx.Client) -> None:
    """Wait until every configured pool is full with no boot running (or no pool)."""
    deadline = time.time() + 120
    while time.time() < deadline:
        pool = api.get("/metrics/node").json().get("pool", {})
        if all(p["ready"] == p["target"] and not p["starting"] for p in pool.values()):
            return
        time.sleep(0.01)
    raise SystemExit(f"the pool did not fill: {pool}")


def _loop(url: str, key: str, n: int, pooled: bool) -> dict[str, list[float]]:
    from e2b import Sandbox

    out: dict[str, list[float]] = {"server": [], "handout": [], "rest": [], "sdk": []}
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as api:
        for _ in range(n):
            _pool_full(api)
            t = time.perf_counter()
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
            out["rest"].append((time.perf_counter() - t) * 1000)
            assert r.status_code == 201, r.text
            out["server"].append(_phase(r, "total"))
            if pooled:
                out["handout"].append(_phase(r, "pool"))
            else:
                _phase(r, "runtime")  # a cold start indeed
            api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        for _ in range(n):
            _pool_full(api)
            t = time.perf_counter()
            sbx = Sandbox.create("base", timeout=120)
            out["sdk"].append((time.perf_counter() - t) * 1000)
            sbx.kill()
        if pooled:
            hits = api.get("/metrics/node").json()["pool"]["base"]["hits"]
            assert hits == 2 * n, f"only {hits} of {2 * n} creates came from the pool"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="creates per measurement")
    args = ap.parse_args()
    templates = templates_dir()
    raw = asyncio.run(raw_run(Settings(data_dir=DATA / "raw-pool"), templates / "base" / "rootfs", args.n))
    results = {}
    for mode, pool in (("pooled", "base:2"), ("cold", "off")):
        os.environ["FORKYARD_POOL"] = pool
        proc, url, key = start_server(templates)
        try:
            results[mode] = _loop(url, key, args.n, pooled=mode == "pooled")
        finally:
            stop_server(proc)
    p, c = results["pooled"], results["cold"]
    print(f"\nforkyard warm pool benchmark, n={args.n}, runsc {Settings().runsc}")
    print(row("raw runsc run until envd answers", raw))
    print(row("pooled: server-side (S-T total)", p["server"], raw))
    print(row("pooled: hand-out (S-T pool)", p["handout"], raw))
    print(row("pooled: POST /sandboxes (client)", p["rest"], raw))
    print(row("pooled: SDK Sandbox.create('base')", p["sdk"], raw))
    print(row("cold: server-side (S-T total)", c["server"], raw))
    print(row("cold: POST /sandboxes (client)", c["rest"], raw))
    print(row("cold: SDK Sandbox.create('base')", c["sdk"], raw))
    print(row("pooled SDK vs cold SDK create", p["sdk"], c["sdk"]))


if __name__ == "__main__":
    main()
