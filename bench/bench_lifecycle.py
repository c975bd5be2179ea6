"""Lifecycle benchmark: forkyard (real e2b SDK / REST) vs raw runsc on the same sandbox.

Prints p50/p95 (ms) of pause, resume, snapshot of an idle sandbox and of one that has
just written 100 MB (API latency, and how long the source was stopped — the server's
``Server-Timing`` ``checkpoint`` phase), fork ×1/×4/×16 (until every child's envd
answers) — and, interleaved in the same run, the same operations done with raw runsc,
compared like with like:

* pause vs a raw *stopping* checkpoint (no ``--leave-running``) of a raw sandbox restored
  from the API sandbox's image; the pause's full cost (until its background commit has
  finished, read from ``/metrics/node``) is reported too;
* resume — started only once the pause's commit has finished (checked, not slept) — vs
  a raw restore of that stopped checkpoint, both until envd answers ``/health``;
* snapshot vs raw ``checkpoint --leave-running`` of the same sandbox; ``sync`` runs before
  the timer on both sides;
* fork ×N vs raw checkpoint + N parallel restores, both until every envd answers.

Raw restores go into network slots made before the timer, like the server's spare slots.

Usage: ``python bench/bench_lifecycle.py [-n 10] [--forks 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
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

FAN = [1, 4, 16]


class Raw:
    """Raw runsc operations: checkpoint of a server sandbox, restores into own slots."""

    def __init__(self, rootfs: Path, fan: list[int]):
        self.rootfs = rootfs
        self.settings = Settings(data_dir=DATA / "raw")
        self.net = NetnsNetwork(self.settings, outer_net=os.environ.get("FORKYARD_BENCH_RAW_NET", "10.122.0.0/16"),
                                  prefix=os.environ.get("FORKYARD_BENCH_RAW_PREFIX", "fbr"))
        self.drv = GVisorDriver(self.settings)
        self.server_drv = GVisorDriver(Settings(data_dir=DATA / "server"))
        self.fan = fan
        self.ids = [f"k{j:03d}x" for j in range(max(fan))]
        self.img = self.settings.data_dir / "img"
        self.slots = []
        self.http: httpx.AsyncClient | None = None

    async def setup(self) -> None:
        # One client made before any timer, as the server's (no keep-alive either):
        # making one (its TLS context) took ~15 ms here, which a restore must not pay.
        self.http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self.net.setup_host()
        for sid in self.ids:  # leftovers of an interrupted earlier run
            await self.drv.destroy(sid, self.settings.sandboxes_dir / sid)
        self.slots = [self.net.allocate(i) for i in range(max(self.fan))]

    async def teardown(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        for sid in self.ids:
            await self.drv.destroy(sid, self.settings.sandboxes_dir / sid)
        for s in self.slots:
            self.net.release(s.index)
        self.net.teardown_host()
        shutil.rmtree(self.img, ignore_errors=True)

    async def checkpoint(self, sandbox_id: str) -> float:
        shutil.rmtree(self.img, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        await self.server_drv.checkpoint(sandbox_id, self.img, leave_running=True)
        return (time.perf_counter() - t) * 1000

    def _spec(self, j: int) -> SandboxSpec:
        sid = self.ids[j]
        return SandboxSpec(sandbox_id=sid, rootfs=self.rootfs, network=self.slots[j].attachment, vcpus=2,
                           memory_mb=512, hostname="raw", workdir=self.settings.sandboxes_dir / sid)

    async def _envd_answers(self, j: int) -> None:
        deadline = time.time() + 30
        while True:
            try:
                if (await self.http.get(f"http://{self.slots[j].outer_ip}:49983/health", timeout=1)).status_code < 500:
                    return
            except httpx.HTTPError:
                if time.time() > deadline:
                    raise
            await asyncio.sleep(0.002)

    async def restores(self, k: int, image: Path | None = None, phases: dict[str, float] | None = None) -> float:
        """``k`` parallel restores of ``image`` (default the last checkpoint) until every
        restored envd answers ``/health`` (ms); the restored sandboxes are destroyed.
        ``phases`` (k = 1) receives the driver's phases and ``envd`` (ms)."""
        t = time.perf_counter()
        await asyncio.gather(*(self.drv.create(self._spec(j), self.drv.image_at(image or self.img), phases=phases)
                               for j in range(k)))
        t1 = time.perf_counter()
        await asyncio.gather(*(self._envd_answers(j) for j in range(k)))
        ms = (time.perf_counter() - t) * 1000
        if phases is not None:
            phases["envd"] = (time.perf_counter() - t1) * 1000
        await asyncio.gather(*(self.drv.destroy(self.ids[j], self.settings.sandboxes_dir / self.ids[j])
                               for j in range(k)))
        self._fresh_slots(range(k))
        return ms

    def _fresh_slots(self, indexes) -> None:
        """Replace used slots by new ones (untimed): a slot reused right after its
        sandbox was destroyed did not answer (measured); the server never reuses one
        either (it takes a fresh spare)."""
        for j in indexes:
            self.net.release(self.slots[j].index)
            self.slots[j] = self.net.allocate(self.slots[j].index)

    async def pause_resume(self, phases: dict[str, float] | None = None) -> tuple[float, float]:
        """Raw pause and resume: restore the last checkpoint into a raw sandbox (untimed),
        then a stopping checkpoint of it (``pause``) and a restore of that image until
        envd answers (``resume``), ms; ``phases`` receives the resume's phases."""
        await self.drv.create(self._spec(0), self.drv.image_at(self.img))
        await self._envd_answers(0)
        stopped = self.settings.data_dir / "img-stopped"
        shutil.rmtree(stopped, ignore_errors=True)
        os.sync()
        t = time.perf_counter()
        await self.drv.checkpoint(self.ids[0], stopped, leave_running=False)
        pause = (time.perf_counter() - t) * 1000
        await self.drv.destroy(self.ids[0], self.settings.sandboxes_dir / self.ids[0])
        self._fresh_slots([0])
        os.sync()
        resume = await self.restores(1, stopped, phases)
        shutil.rmtree(stopped, ignore_errors=True)
        return pause, resume


def settle(api: httpx.Client) -> None:
    """Wait (≤ 30 s) until the server has rebuilt its spare network slots after the
    last burst, then 0.5 s more: each fork starts from a quiet node."""
    deadline = time.time() + 30
    while time.time() < deadline:
        node = api.get("/metrics/node").json()
        if len(node["spareSlots"]) >= 16 or not node["spareSlots"] and time.time() > deadline - 25:
            break
        time.sleep(0.2)
    time.sleep(0.5)


def server_timings(r: httpx.Response) -> dict[str, float]:
    """Every phase (ms) of the response's ``Server-Timing`` header."""
    out = {}
    for part in r.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur)
    return out


def server_timing(r: httpx.Response, phase: str) -> float:
    """Duration (ms) of ``phase`` in the response's ``Server-Timing`` header."""
    for part in r.headers.get("server-timing", "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name == phase:
            return float(dur)
    raise AssertionError(f"no {phase!r} in Server-Timing: {r.headers.get('server-timing')!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=10, help="iterations for pause/resume/snapshot")
    ap.add_argument("--forks", type=int, default=5, help="iterations per fork size")
    ap.add_argument("--fan", default="1,4,16", help="fork sizes, comma-separated (E2B's maximum is 100)")
    ap.add_argument("--only-fork", action="store_true", help="skip pause/resume/snapshot")
    ap.add_argument("--only-pause", action="store_true",
                    help="pause/resume only (set FORKYARD_HOT_PAUSE_S=0 for cold resumes)")
    args = ap.parse_args()
    global FAN
    FAN = [int(x) for x in args.fan.split(",")]
    if max(FAN) > 16:  # a 512 MiB template: 100 children exceed this host's memory admission
        os.environ.setdefault("FORKYARD_MEMORY_OVERCOMMIT", "3")
    templates = templates_dir()
    loop = asyncio.new_event_loop()
    raw = Raw(templates / "base" / "rootfs", FAN)
    loop.run_until_complete(raw.setup())
    proc, url, key = start_server(templates)
    from e2b import Sandbox

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120)
    keys = ("ckpt", "restore", "pause", "resume", "snap_idle", "snap_100mb", "stop_idle", "stop_100mb",
            "raw_snap_idle", "raw_snap_100mb", *(f"fork{k}" for k in FAN), *(f"raw_fork{k}" for k in FAN),
            "raw_pause", "raw_resume", "pause_full", *(f"fork{k}_ck" for k in FAN))
    res: dict[str, list[float]] = {k: [] for k in keys}
    phase_res: dict[str, list[float]] = {}  # resume phases: the server's and the raw restore's

    def snapshot(sid: str, key: str) -> None:
        res[f"raw_{key}"].append(loop.run_until_complete(raw.checkpoint(sid)))
        os.sync()  # before the timer, as on the raw side: no write-back left to slow either
        t = time.perf_counter()
        r = api.post(f"/sandboxes/{sid}/snapshots", json={})
        res[key].append((time.perf_counter() - t) * 1000)
        assert r.status_code == 201, r.text
        res[key.replace("snap", "stop")].append(server_timing(r, "checkpoint"))
        Sandbox.delete_snapshot(r.json()["snapshotID"])

    try:
        sbx = Sandbox.create("base", timeout=3600)
        sid = sbx.sandbox_id
        for _ in range(0 if args.only_fork else args.n):
            res["ckpt"].append(loop.run_until_complete(raw.checkpoint(sid)))
            res["restore"].append(loop.run_until_complete(raw.restores(1)))
            raw_phases: dict[str, float] = {}
            rp, rr = loop.run_until_complete(raw.pause_resume(raw_phases))
            for name, ms in raw_phases.items():
                phase_res.setdefault(f"raw {name}", []).append(ms)
            res["raw_pause"].append(rp)
            res["raw_resume"].append(rr)
            os.sync()
            t = time.perf_counter()
            sbx.pause()
            res["pause"].append((time.perf_counter() - t) * 1000)
            while api.get("/metrics/node").json()["pausesInFlight"]:  # commit + teardown in the background
                time.sleep(0.005)
            res["pause_full"].append((time.perf_counter() - t) * 1000)
            os.sync()
            t = time.perf_counter()
            r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 3600})
            res["resume"].append((time.perf_counter() - t) * 1000)
            assert r.status_code == 201, r.text
            for name, ms in server_timings(r).items():
                phase_res.setdefault(name, []).append(ms)
        sbx = Sandbox.connect(sid)
        for i in range(0 if args.only_fork or args.only_pause else args.n):
            snapshot(sid, "snap_idle")
            sbx.commands.run("head -c 100M /dev/urandom > /tmp/blob")
            snapshot(sid, "snap_100mb")
            sbx.commands.run("rm -f /tmp/blob*")
        for k in ([] if args.only_pause else FAN):
            for _ in range(args.forks):
                settle(api)
                ck = loop.run_until_complete(raw.checkpoint(sid))
                res[f"raw_fork{k}"].append(ck + loop.run_until_complete(raw.restores(k)))
                os.sync()
                t = time.perf_counter()
                # REST, not sbx.fork: the e2b SDK caps one call at 20 children.
                r = api.post(f"/sandboxes/{sid}/fork", json={"count": k, "timeout": 600})
                res[f"fork{k}"].append((time.perf_counter() - t) * 1000)
                assert r.status_code == 201 and all("sandbox" in e for e in r.json()), r.text[:2000]
                res[f"fork{k}_ck"].append(server_timing(r, "checkpoint"))
                for e in r.json():
                    api.delete(f"/sandboxes/{e['sandbox']['sandboxID']}")
        sbx.kill()
    finally:
        stop_server(proc)
        loop.run_until_complete(raw.teardown())
        loop.close()

    def pr(name: str, xs: list[float], raw: list[float] | None = None) -> None:
        if xs:  # --only-fork leaves the others empty
            print(row(name, xs, raw))

    print(f"\nforkyard lifecycle benchmark, n={args.n}, forks n={args.forks} (raw ops on the same sandbox)")
    pr("raw runsc checkpoint --leave-running", res["ckpt"])
    pr("raw runsc restore until envd answers", res["restore"])
    for k in FAN:
        pr(f"raw checkpoint + {k} parallel restores", res[f"raw_fork{k}"])
    pr("raw runsc checkpoint (stopping)", res["raw_pause"])
    pr("raw runsc restore of it until envd answers", res["raw_resume"])
    pr("pause (answer)", res["pause"], res["raw_pause"])
    pr("pause incl. background commit", res["pause_full"], res["raw_pause"])
    pr("resume (after the commit finished)", res["resume"], res["raw_resume"])
    for name, xs in sorted(phase_res.items(), key=lambda kv: (kv[0].startswith("raw "), kv[0])):
        pr(f"  resume phase {name}", xs)
    pr("raw checkpoint, idle (snapshot loop)", res["raw_snap_idle"])
    pr("snapshot (idle)", res["snap_idle"], res["raw_snap_idle"])
    pr("  source stopped (Server-Timing)", res["stop_idle"], res["raw_snap_idle"])
    pr("raw checkpoint, 100 MB just written", res["raw_snap_100mb"])
    pr("snapshot (after 100 MB write)", res["snap_100mb"], res["raw_snap_100mb"])
    pr("  source stopped (Server-Timing)", res["stop_100mb"], res["raw_snap_100mb"])
    for k in FAN:
        pr(f"fork x{k} (all children answer)", res[f"fork{k}"], res[f"raw_fork{k}"])
        pr(f"  of which the source's checkpoint", res[f"fork{k}_ck"])


if __name__ == "__main__":
    main()
