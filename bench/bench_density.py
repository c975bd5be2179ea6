"""Density benchmark: how many idle ``base`` sandboxes one node holds, and what each costs.

Creates idle ``base`` sandboxes through the API in steps up to ``--max`` (default 200)
and at each step N (and N=1 first) prints:

* host memory per sandbox: ``MemAvailable`` drop since before the first create, / N,
  and the sum of PSS (``/proc/PID/smaps_rollup``) over the server's runsc processes, / N;
* create p50/p95 of the creates of that step (``POST /sandboxes``, client-side), and
  ``commands.run("true")`` p50/p95 (e2b SDK, 20 sandboxes of the step, warm, 3 calls each; 30 calls at N=1);
* the host's CPU busy share over 3 s while all N sit idle (every process on the host),
  the share of one core the sandboxes' own runsc processes used meanwhile, and the
  load average;

then runs ``python3 -c 'import sys'`` once in every sandbox and measures memory again
(a python run leaves page cache and sentry memory behind). It stops early when
``MemAvailable`` falls under ``--stop-below`` % (default 15) of ``MemTotal`` or a create
fails, and says why. The server runs without a warm pool, with memory overcommit high
enough that its admission does not stop the bench (the point is to see where the host
gives out); the admission limit that follows from the numbers is in docs/runtime.md.

Heavy: run once, alone, with ``nice``. Usage:
``nice python bench/bench_density.py [--steps 1,50,100,200] [--stop-below 15]``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, pct, start_server, stop_server, templates_dir  # noqa: E402


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in KiB."""
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, v = line.split(":", 1)
        out[k] = int(v.split()[0])
    return out


def _runsc_files(runsc_root: Path, name: str):
    """Text of ``/proc/PID/<name>`` of every runsc process of ``runsc_root`` (sandbox,
    gofer — found by their ``--root`` flag); processes that vanish are skipped."""
    flag = f"--root={runsc_root}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if flag in Path(f"/proc/{pid}/cmdline").read_bytes():
                yield Path(f"/proc/{pid}/{name}").read_text()
        except OSError:
            continue


def server_pss_kib(runsc_root: Path) -> tuple[int, int]:
    """(sum of PSS KiB, process count) over runsc processes of ``runsc_root``."""
    total = n = 0
    for text in _runsc_files(runsc_root, "smaps_rollup"):
        m = re.search(r"^Pss:\s+(\d+)", text, re.M)
        if m:
            total += int(m.group(1))
            n += 1
    return total, n


def runsc_cpu_ticks(runsc_root: Path) -> int:
    """utime + stime (clock ticks) of the runsc processes of ``runsc_root``, threads
    included (their sentries run the sandboxes, so this is the sandboxes' own CPU)."""
    total = 0
    for text in _runsc_files(runsc_root, "stat"):
        fields = text.rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return total


def cpu_busy(runsc_root: Path, seconds: float = 3.0) -> tuple[float, float]:
    """Share (0-1) of all CPUs busy over ``seconds``, and the share of one CPU the
    sandboxes' own runsc processes used meanwhile (the first includes every other
    process on the host; the second only the benchmark's sandboxes)."""
    def snap():
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]
    t1, i1 = snap()
    r1 = runsc_cpu_ticks(runsc_root)
    start = time.monotonic()
    time.sleep(seconds)
    r2 = runsc_cpu_ticks(runsc_root)
    elapsed = time.monotonic() - start
    t2, i2 = snap()
    return 1 - (i2 - i1) / max(1, t2 - t1), (r2 - r1) / os.sysconf("SC_CLK_TCK") / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="1,50,100,200")
    ap.add_argument("--stop-below", type=float, default=15.0, help="stop when MemAvailable < this %% of MemTotal")
    ap.add_argument("--parallel", type=int, default=2, help="creates in flight at once")
    args = ap.parse_args()
    steps = [int(x) for x in args.steps.split(",")]
    templates = templates_dir()
    os.environ.setdefault("FORKYARD_MEMORY_OVERCOMMIT", str(max(1.0, max(steps) * 512 / 20000 + 1)))
    os.environ.setdefault("FORKYARD_POOL", "off")
    # Past the default count limit (125 per core): this bench measures beyond it.
    os.environ.setdefault("FORKYARD_MAX_SANDBOXES", str(max(steps) + 10))
    proc, url, key = start_server(templates)
    from e2b import Sandbox

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120)
    runsc_root = DATA / "server" / "runsc"
    total_kib = meminfo()["MemTotal"]
    time.sleep(2)
    base_avail = meminfo()["MemAvailable"]
    base_pss, _ = server_pss_kib(runsc_root)
    ids: list[str] = []
    rows = []
    why = f"reached N={max(steps)}"

    def create() -> float:
        t = time.perf_counter()
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 3600})
        ms = (time.perf_counter() - t) * 1000
        if r.status_code != 201:
            raise RuntimeError(f"create {r.status_code}: {r.text[:300]}")
        ids.append(r.json()["sandboxID"])
        return ms

    def run_true(sid: str, calls: int) -> list[float]:
        sbx = Sandbox.connect(sid)
        sbx.commands.run("true")
        out = []
        for _ in range(calls):
            t = time.perf_counter()
            sbx.commands.run("true")
            out.append((time.perf_counter() - t) * 1000)
        return out

    def measure(n: int, creates: list[float], label: str) -> dict:
        time.sleep(3)  # let the last boots settle
        mi = meminfo()
        pss, nproc = server_pss_kib(runsc_root)
        busy, sandboxes_cpu = cpu_busy(runsc_root)
        sample = ids[-20:] if n > 20 else ids
        runs = [x for sid in sample for x in run_true(sid, max(3, 30 // len(sample)))]
        row = {"N": n, "label": label, "avail_mib": mi["MemAvailable"] // 1024,
               "avail_pct": 100 * mi["MemAvailable"] / total_kib,
               "drop_per_sbx_mib": (base_avail - mi["MemAvailable"]) / 1024 / n,
               "pss_per_sbx_mib": (pss - base_pss) / 1024 / n, "procs": nproc,
               "create_p50": pct(creates, 50) if creates else float("nan"),
               "create_p95": pct(creates, 95) if creates else float("nan"),
               "run_p50": pct(runs, 50), "run_p95": pct(runs, 95),
               "cpu_busy_pct": 100 * busy, "sbx_cpu_pct": 100 * sandboxes_cpu, "load1": os.getloadavg()[0]}
        rows.append(row)
        print(f"N={n:4d} {label:8s} avail {row['avail_mib']:6d} MiB ({row['avail_pct']:4.1f}%)  "
              f"drop/sbx {row['drop_per_sbx_mib']:5.1f} MiB  PSS/sbx {row['pss_per_sbx_mib']:5.1f} MiB  "
              f"create p50 {row['create_p50']:6.0f} p95 {row['create_p95']:6.0f} ms  "
              f"run p50 {row['run_p50']:5.1f} p95 {row['run_p95']:6.1f} ms  "
              f"cpu {row['cpu_busy_pct']:4.1f}% (sandboxes {row['sbx_cpu_pct']:5.1f}% of a core)  "
              f"load {row['load1']:.1f}", flush=True)
        return row

    try:
        for n in steps:
            creates: list[float] = []
            stop = False
            with ThreadPoolExecutor(args.parallel) as ex:
                while len(ids) < n and not stop:
                    k = min(args.parallel, n - len(ids))
                    try:
                        creates += list(ex.map(lambda _: create(), range(k)))
                    except RuntimeError as e:
                        why, stop = f"create failed at N={len(ids)}: {e}", True
                    avail = meminfo()["MemAvailable"]
                    if 100 * avail / total_kib < args.stop_below:
                        why, stop = f"MemAvailable {avail // 1024} MiB < {args.stop_below}% at N={len(ids)}", True
            measure(len(ids), creates, "idle")
            if stop:
                break
        # One python3 run in each, then memory again.
        with ThreadPoolExecutor(args.parallel) as ex:
            list(ex.map(lambda sid: Sandbox.connect(sid).commands.run("python3 -c 'import sys'"), ids))
        measure(len(ids), [], "python3")
    finally:
        print(f"stopped: {why}", flush=True)
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda sid: api.delete(f"/sandboxes/{sid}"), ids))
        stop_server(proc)
    print("\nN, label, MemAvailable MiB (%), drop/sbx MiB, PSS/sbx MiB, create p50/p95 ms, run p50/p95 ms, "
          "CPU busy %, sandboxes' CPU % of a core, load")
    for r in rows:
        print(f"{r['N']}, {r['label']}, {r['avail_mib']} ({r['avail_pct']:.1f}), {r['drop_per_sbx_mib']:.1f}, "
              f"{r['pss_per_sbx_mib']:.1f}, {r['create_p50']:.0f}/{r['create_p95']:.0f}, "
              f"{r['run_p50']:.1f}/{r['run_p95']:.1f}, {r['cpu_busy_pct']:.0f}, {r['sbx_cpu_pct']:.0f}, {r['load1']:.1f}")


if __name__ == "__main__":
    main()
