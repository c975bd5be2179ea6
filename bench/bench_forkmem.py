"""Fork and restore against memory size (issue 21): latency, host memory, integrity.

A source sandbox (template ``forkmem``, built here with ``--template-mb`` of memory)
runs a python process holding N MiB of random bytes, made in user space (``--sizes``,
default 16,128,384); for each N, in one run, with the raw runsc operation measured on
the same sandbox beside every forkyard one (the ratio is taken in the same run):

* pause (API answer) vs a raw stopping checkpoint, cold resume (hot pause off) vs a raw
  restore of that checkpoint until envd answers (p50/p95, ms);
* fork ×K (``--fan``, default 4,16) until every child's envd answers vs a raw
  checkpoint + K parallel restores;
* host memory a fork ×K adds, per child: the PSS (``/proc/PID/smaps_rollup``) of the
  source's and the children's processes (each sandbox's memory cgroup: sentry, gofer,
  systrap stubs; each address space counted once, see :func:`sandbox_pss_mib`) after
  every child (and the source) has read its whole buffer, minus the source's before the
  fork, also after reading it (a page mapped but not touched since a checkpoint is in
  no page table and so not in PSS; before 2026-12-07 this undercounted the source's
  baseline by its buffer when it mapped the raw side's image); the drop
  of ``MemFree`` (includes page cache, and whatever else the host did meanwhile) and of
  ``MemAvailable``; and the total added over N;
* integrity: a process in every child (and in the resumed source) asks the holder for
  the SHA-1 of its whole buffer, which must equal the source's at checkpoint time;

and once, in its own sandbox, the freed-memory return: a python process allocates
300 MiB of random bytes and frees them; printed is how long the sandbox's PSS takes to
fall back by 90 % of that (polled every 100 ms, ≤ 30 s).

The server runs with hot pause and the warm pool off and memory overcommit high enough
for the children; ``FORKYARD_RUNSC`` picks the runsc build (both sides use it).
Heavy (fork ×16 of 384 MiB holds ~6 GiB before sharing): run alone, with ``nice``.

Usage: ``nice python bench/bench_forkmem.py [-n 3] [--forks 2] [--sizes 16,128,384]
[--fan 4,16] [--template-mb 2048]``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct, row, start_server, stop_server, templates_dir  # noqa: E402
from bench_lifecycle import Raw, server_timing  # noqa: E402

from forkyard.runtime.base import SandboxSpec  # noqa: E402

TEMPLATE = "forkmem"
#: Runs inside the sandbox: holds N MiB of random bytes and answers the SHA-1 of all of
#: them to every connection on 127.0.0.1:7000 (so a process in a fork child can check
#: that no page was lost or stale); on 7001 / 7002 it first flips a byte every 2 MiB /
#: 4 KiB (what a child's scattered / dense writes cost).
HOLDER = r"""
import hashlib, os, random, select, socket, sys, time
n = int(sys.argv[1]) << 20
buf = bytearray(n)  # filled in user space: os.urandom's getrandom leaves a buffer as large in the sentry
for i in range(0, n, 1 << 20):
    buf[i:i + (1 << 20)] = random.randbytes(1 << 20)
socks = {}
for port, step in ((7000, 0), (7001, 2 << 20), (7002, 4096)):  # sum; write a byte every 2 MiB / 4 KiB
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port)); s.listen(64)
    socks[s] = step
open("/tmp/holder.tmp", "w").write(hashlib.sha1(buf).hexdigest()); os.rename("/tmp/holder.tmp", "/tmp/holder.sum")
while True:
    for s in select.select(list(socks), [], [])[0]:
        c, _ = s.accept()
        took = 0.0
        if socks[s]:
            t = time.perf_counter()
            for i in range(0, n, socks[s]):
                buf[i] ^= 0xFF
            took = time.perf_counter() - t
        c.sendall(f"{hashlib.sha1(buf).hexdigest()} {took * 1000:.1f}\n".encode()); c.close()
"""
ASK = "exec 3<>/dev/tcp/127.0.0.1/{port} && head -1 <&3"
#: Allocates 300 MiB, says so, frees it once /tmp/free.go exists, says so, then idles.
FREER = r"""
import os, time
import random
b = bytearray(300 << 20)
for i in range(0, len(b), 1 << 20):
    b[i:i + (1 << 20)] = random.randbytes(1 << 20)
open("/tmp/free.ready", "w").close()
while not os.path.exists("/tmp/free.go"):
    time.sleep(0.05)
del b
open("/tmp/free.done", "w").close()
time.sleep(3600)
"""


def ask_sum(sid: str, port: int = 7000) -> str:
    """The holder's SHA-1 as a process in sandbox ``sid`` reads it (or what went
    wrong); on ports 7001/7002 the holder first writes a byte every 2 MiB / 4 KiB and
    answers ``SUM MS`` (the new sum, how long the writes took)."""
    from e2b import Sandbox

    try:
        r = Sandbox.connect(sid).commands.run(ASK.format(port=port), timeout=300)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return f"error: {type(e).__name__}: {e}"[:300]
    out = r.stdout.strip()
    return (out.split()[0] if port == 7000 else out) if out else f"empty (stderr {r.stderr.strip()[:200]!r})"


def start_holder(size_mib: int):
    """A new sandbox of :data:`TEMPLATE` whose :data:`HOLDER` keeps ``size_mib`` MiB;
    returns ``(sandbox, the SHA-1 of the buffer)`` once the holder has written it.

    Raises:
        SystemExit: the holder did not start within 120 s.
    """
    from e2b import Sandbox

    sbx = Sandbox.create(TEMPLATE, timeout=3600)
    sbx.files.write("/tmp/holder.py", HOLDER)
    sbx.commands.run(f"python3 /tmp/holder.py {size_mib}", background=True, timeout=0)
    deadline = time.time() + 120
    while not sbx.files.exists("/tmp/holder.sum"):
        if time.time() > deadline:
            raise SystemExit("holder did not start")
        time.sleep(0.2)
    return sbx, sbx.files.read("/tmp/holder.sum").strip()


def meminfo_kib(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_KCMP, _KCMP_VM = 312, 1  # x86-64 (linux/kcmp.h)


def _same_mm(a: int, b: int) -> bool:
    """True when processes ``a`` and ``b`` share one address space (``kcmp(KCMP_VM)``)."""
    return _libc.syscall(_SYS_KCMP, a, b, _KCMP_VM, 0, 0) == 0


def _pss_kib(pid: int) -> int:
    try:
        m = re.search(r"^Pss:\s+(\d+)", Path(f"/proc/{pid}/smaps_rollup").read_text(), re.M)
    except OSError:
        return 0
    return int(m.group(1)) if m else 0


def sandbox_pss_mib(sandbox_id: str) -> float:
    """PSS (MiB) of the sandbox's processes — its memory cgroup: sentry, gofer, systrap
    stubs — counting each address space once: a systrap stub's "threads" are processes
    sharing one mm, and each reports that mm's whole PSS (summing them per process
    counted application memory two or three times). A page mapped by k address spaces
    (of any sandboxes) counts 1/k in each, so sums over sandboxes count it once."""
    try:
        pids = [int(p) for p in Path(f"/sys/fs/cgroup/memory/forkyard/{sandbox_id}/cgroup.procs").read_text().split()]
    except OSError:
        return 0.0
    reps: list[int] = []
    total = 0
    for pid in pids:
        if any(_same_mm(pid, r) for r in reps):
            continue
        reps.append(pid)
        total += _pss_kib(pid)
    return total / 1024


def pss_total_mib(sandbox_ids) -> float:
    """:func:`sandbox_pss_mib` summed over ``sandbox_ids``."""
    return sum(sandbox_pss_mib(s) for s in sandbox_ids)


class BigRaw(Raw):
    """bench_lifecycle's raw side, with the template's memory limit."""

    memory_mb = 2048

    def _spec(self, j: int) -> SandboxSpec:
        spec = super()._spec(j)
        spec.memory_mb = self.memory_mb
        return spec

    def _fresh_slots(self, indexes) -> None:
        """As Raw's, retried: on the shared host a slot's devices vanished now and then
        while it was made again (something outside this bench deleted them)."""
        for j in indexes:
            for attempt in range(5):
                try:
                    super()._fresh_slots([j])
                    break
                except Exception as e:  # noqa: BLE001 - NetworkError and the like, retried
                    print(f"warning: making raw slot {j} again failed ({e}); retrying", flush=True)
                    time.sleep(1)

    async def restores(self, k: int, image: Path | None = None, phases: dict[str, float] | None = None) -> float:
        """As Raw's, after making again any raw slot whose netns vanished (seen twice on
        the shared host: something outside this bench deleted them)."""
        self._ensure_slots(range(k))
        return await super().restores(k, image, phases)

    async def pause_resume(self, phases: dict[str, float] | None = None) -> tuple[float, float]:
        self._ensure_slots([0])
        return await super().pause_resume(phases)

    def _ensure_slots(self, indexes) -> None:
        gone = [j for j in indexes if not os.path.exists(self.slots[j].attachment.netns_path)]
        if gone:
            print(f"warning: raw slots {gone} lost their netns; made again", flush=True)
            self._fresh_slots(gone)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=3, help="pause/resume iterations per size")
    ap.add_argument("--forks", type=int, default=2, help="fork iterations per size and fan")
    ap.add_argument("--sizes", default="16,128,384", help="MiB held by the source, comma-separated")
    ap.add_argument("--fan", default="4,16")
    ap.add_argument("--template-mb", type=int, default=2048)
    ap.add_argument("--skip-free", action="store_true")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    fan = [int(x) for x in args.fan.split(",")]
    os.environ["FORKYARD_HOT_PAUSE_S"] = "0"
    # every restore shares (the default shares fork children's only), so the raw side's
    # restores do as the forks do (docs/runtime.md "Memory")
    os.environ.setdefault("FORKYARD_SHARE_RESTORED_PAGES", "all")
    os.environ.setdefault("FORKYARD_MEMORY_OVERCOMMIT", str(max(fan) * args.template_mb / 16000 + 2))
    templates = templates_dir()
    loop = asyncio.new_event_loop()
    raw = BigRaw(templates / "base" / "rootfs", fan)
    raw.memory_mb = args.template_mb
    loop.run_until_complete(raw.setup())
    proc, url, key = start_server(templates)
    from e2b import Sandbox, Template

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=600)
    res: dict[str, list[float]] = {}
    notes: list[str] = []
    build = os.path.realpath(os.environ.get("FORKYARD_RUNSC", "/usr/local/lib/forkyard/runsc"))

    def add(k: str, v: float) -> None:
        res.setdefault(k, []).append(v)

    def settle() -> None:
        deadline = time.time() + 30
        while time.time() < deadline and len(api.get("/metrics/node").json()["spareSlots"]) < max(fan):
            time.sleep(0.2)
        time.sleep(1.0)

    try:
        t = time.perf_counter()
        Template.build(Template().from_template("base").run_cmd("true"), TEMPLATE, memory_mb=args.template_mb)
        print(f"template {TEMPLATE} ({args.template_mb} MiB) built in {time.perf_counter() - t:.1f} s; "
              f"runsc {build}; load {os.getloadavg()[0]:.1f}", flush=True)
        for size in sizes:
            sbx, want = start_holder(size)
            sid = sbx.sandbox_id
            got = ask_sum(sid)
            if got != want:
                raise SystemExit(f"size {size}: the holder answered {got!r}, its sum file says {want!r}")
            time.sleep(1)
            src_pss = sandbox_pss_mib(sid)
            add(f"src_pss{size}", src_pss)
            print(f"size {size} MiB: source {sid} PSS {src_pss:.0f} MiB, sha1 {want[:12]}", flush=True)
            for _ in range(args.n):
                loop.run_until_complete(raw.checkpoint(sid))
                rp, rr = loop.run_until_complete(raw.pause_resume())
                add(f"raw_pause{size}", rp)
                add(f"raw_resume{size}", rr)
                os.sync()
                t = time.perf_counter()
                sbx.pause()
                add(f"pause{size}", (time.perf_counter() - t) * 1000)
                while api.get("/metrics/node").json()["pausesInFlight"]:
                    time.sleep(0.005)
                os.sync()
                t = time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/resume", json={"timeout": 3600})
                add(f"resume{size}", (time.perf_counter() - t) * 1000)
                assert r.status_code == 201, r.text
                got = ask_sum(sid)
                if got != want:
                    notes.append(f"size {size}: resumed source sum {got!r} != {want!r}")
            for k in fan:
                for _ in range(args.forks):
                    settle()
                    ck = loop.run_until_complete(raw.checkpoint(sid))
                    add(f"raw_fork{k}_{size}", ck + loop.run_until_complete(raw.restores(k)))
                    settle()
                    # The source reads its whole buffer first: a page it maps but has not
                    # touched since its last checkpoint (it may map that image's pages, the
                    # raw side's here) is in no page table, so PSS would not count it.
                    ask_sum(sid)
                    pss0, free0 = sandbox_pss_mib(sid), meminfo_kib("MemFree") / 1024
                    avail0 = meminfo_kib("MemAvailable") / 1024
                    os.sync()
                    t = time.perf_counter()
                    r = api.post(f"/sandboxes/{sid}/fork", json={"count": k, "timeout": 600})
                    add(f"fork{k}_{size}", (time.perf_counter() - t) * 1000)
                    assert r.status_code == 201 and all("sandbox" in e for e in r.json()), r.text[:2000]
                    add(f"fork{k}_{size}_ck", server_timing(r, "checkpoint"))
                    kids = [e["sandbox"]["sandboxID"] for e in r.json()]
                    time.sleep(1)
                    add(f"fork{k}_{size}_pss_kid_early", (pss_total_mib([sid, *kids]) - pss0) / k)
                    with ThreadPoolExecutor(min(k, 8)) as ex:
                        sums = list(ex.map(ask_sum, kids))
                    bad = [s for s in sums if s != want]
                    if bad:
                        notes.append(f"size {size} fork x{k}: {len(bad)} of {k} children's sums differ: {bad[:2]}")
                    add(f"fork{k}_{size}_ok", float(not bad))
                    ask_sum(sid)  # the source reads it too: its share of the pages is counted
                    time.sleep(1)
                    added = pss_total_mib([sid, *kids]) - pss0
                    add(f"fork{k}_{size}_pss_kid", added / k)
                    add(f"fork{k}_{size}_free_kid", (free0 - meminfo_kib("MemFree") / 1024) / k)
                    add(f"fork{k}_{size}_avail_kid", (avail0 - meminfo_kib("MemAvailable") / 1024) / k)
                    add(f"fork{k}_{size}_pss_total_ratio", added / size)
                    if k == min(fan) and k >= 3:  # writes in children: what they cost, and that they stay there
                        for j, (port, name) in enumerate(((7001, "sparse"), (7002, "dense"))):
                            before = sandbox_pss_mib(kids[j])
                            got, ms = ask_sum(kids[j], port).split()
                            add(f"write_{name}_{size}_mib", sandbox_pss_mib(kids[j]) - before)
                            add(f"write_{name}_{size}_ms", float(ms))
                            if got == want:
                                notes.append(f"size {size}: a {name} write in a child did not change its sum")
                        if ask_sum(kids[2]) != want or ask_sum(sid) != want:
                            notes.append(f"size {size}: a child's writes showed in its sibling or the source")
                    with ThreadPoolExecutor(4) as ex:
                        list(ex.map(lambda c: api.delete(f"/sandboxes/{c}"), kids))
            sbx.kill()
            print(f"size {size} done; load {os.getloadavg()[0]:.1f}", flush=True)

        if not args.skip_free:
            sbx = Sandbox.create(TEMPLATE, timeout=3600)
            sid = sbx.sandbox_id
            sbx.files.write("/tmp/freer.py", FREER)
            time.sleep(1)
            base = sandbox_pss_mib(sid)
            sbx.commands.run("python3 /tmp/freer.py", background=True, timeout=0)
            while not sbx.files.exists("/tmp/free.ready"):
                time.sleep(0.1)
            time.sleep(0.5)
            held = sandbox_pss_mib(sid)
            sbx.files.write("/tmp/free.go", "")
            t = time.perf_counter()
            took = None
            while time.perf_counter() - t < 30:
                now = sandbox_pss_mib(sid)
                if held - now >= 0.9 * 300:
                    took = time.perf_counter() - t
                    break
                time.sleep(0.1)
            after = sandbox_pss_mib(sid)
            print(f"free 300 MiB: PSS {base:.0f} → {held:.0f} → {after:.0f} MiB; "
                  f"returned in {'%.2f s' % took if took is not None else 'not within 30 s'}", flush=True)
            res["free_s"] = [took if took is not None else float("nan")]
            res["free_pss"] = [base, held, after]
            sbx.kill()
    finally:
        stop_server(proc)
        loop.run_until_complete(raw.teardown())
        loop.close()
        report(args, sizes, fan, res, notes, build)


def report(args, sizes: list[int], fan: list[int], res: dict[str, list[float]], notes: list[str], build: str) -> None:
    """Print the tables of what was measured (also after a failure part-way)."""

    def pr(name: str, k: str, rawk: str | None = None) -> None:
        if res.get(k):
            print(row(name, res[k], res.get(rawk) if rawk else None))

    print(f"\nforkmem benchmark, n={args.n}, forks n={args.forks}, template {args.template_mb} MiB, "
          f"runsc {build}, FORKYARD_SHARE_RESTORED_PAGES={os.environ.get('FORKYARD_SHARE_RESTORED_PAGES')}, "
          f"load {os.getloadavg()[0]:.1f}")
    for size in sizes:
        if not res.get(f"src_pss{size}"):
            continue
        print(f"--- source holds {size} MiB (source PSS {pct(res[f'src_pss{size}'], 50):.0f} MiB)")
        pr("raw stopping checkpoint", f"raw_pause{size}")
        pr("pause (answer)", f"pause{size}", f"raw_pause{size}")
        pr("raw restore until envd answers", f"raw_resume{size}")
        pr("cold resume", f"resume{size}", f"raw_resume{size}")
        for k in fan:
            pr(f"raw checkpoint + {k} restores", f"raw_fork{k}_{size}")
            pr(f"fork x{k}", f"fork{k}_{size}", f"raw_fork{k}_{size}")
            pr("  of which the source stopped (checkpoint)", f"fork{k}_{size}_ck")
            for m, label in (("pss_kid_early", "PSS added per child, 1 s after"),
                             ("pss_kid", "PSS added per child, all read"),
                             ("free_kid", "MemFree drop per child"),
                             ("avail_kid", "MemAvailable drop per child"),
                             ("pss_total_ratio", f"PSS added in total / {size} MiB")):
                xs = res.get(f"fork{k}_{size}_{m}")
                if xs:
                    unit = "x" if m.endswith("ratio") else " MiB"
                    print(f"  {label:<38} p50 {pct(xs, 50):8.2f}{unit}  max {max(xs):8.2f}{unit}")
            for name, what in (("sparse", "1 byte every 2 MiB"), ("dense", "1 byte every 4 KiB")):
                if res.get(f"write_{name}_{size}_mib") and k == min(fan):
                    print(f"  a child writes {what} of its buffer: +{pct(res[f'write_{name}_{size}_mib'], 50):.1f} "
                          f"MiB PSS, {pct(res[f'write_{name}_{size}_ms'], 50):.1f} ms")
            ok = res.get(f"fork{k}_{size}_ok", [])
            print(f"  children's checksums equal the source's: {int(sum(ok))} of {len(ok)} forks")
    if sizes and res.get(f"resume{sizes[0]}") and res.get(f"resume{sizes[-1]}"):
        a, b = pct(res[f"resume{sizes[-1]}"], 50), pct(res[f"resume{sizes[0]}"], 50)
        print(f"cold resume {sizes[-1]} MiB / {sizes[0]} MiB p50: {a / b:.2f}x")
    if "free_s" in res:
        b, h, a = res["free_pss"]
        print(f"freed 300 MiB returned to the host in {res['free_s'][0]:.2f} s (PSS {b:.0f} → {h:.0f} → {a:.0f} MiB)")
    for n in notes:
        print("NOTE:", n)


if __name__ == "__main__":
    main()
