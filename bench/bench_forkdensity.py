"""Fork density (issue 21): how many children of one source run on this host before the
node refuses, each still answering, with and without shared restored pages.

A source sandbox (template ``forkmem``, ``--template-mb`` of memory) runs
bench_forkmem's holder: a python process holding ``--size`` MiB of random bytes that
answers the SHA-1 of all of them on 127.0.0.1:7000. The source is forked ``--batch``
children at a time (``POST /sandboxes/{id}/fork``) until the node refuses a fork (its
admission: the host-memory floor ``FORKYARD_MIN_AVAILABLE_MEMORY_PCT``, the sandbox
cap, or the overcommitted memory limit) or ``--max`` children run. After every batch a
process in each new child asks its holder for the checksum, which must equal the
source's; printed per batch: children so far, the host's ``MemAvailable``, the PSS the
children added in total (bench_forkmem's :func:`~bench_forkmem.sandbox_pss_mib`) and
per child, and the fork's latency. At the end: how many children ran and answered, and
what stopped the fan-out (the node's answer, word for word).

``--sharing on|off`` sets ``FORKYARD_SHARE_RESTORED_PAGES`` for the server (on: runsc
patch 0020 maps restored memory copy-on-write from the image); run it once each way for
the before/after. Memory overcommit is raised (``FORKYARD_MEMORY_OVERCOMMIT``, default
here 20) so the limits do not stop the fan-out before the host's memory does.

Heavy: it fills the host's memory down to the node's floor. Run it alone, with ``nice``.

Usage: ``nice python bench/bench_forkdensity.py [--sharing on] [--size 384] [--batch 8]
[--max 240] [--template-mb 1024]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_server, stop_server, templates_dir  # noqa: E402
from bench_forkmem import TEMPLATE, ask_sum, meminfo_kib, pss_total_mib, sandbox_pss_mib, start_holder  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sharing", choices=("on", "off"), default="on")
    ap.add_argument("--size", type=int, default=384, help="MiB the source's holder keeps")
    ap.add_argument("--batch", type=int, default=8, help="children per fork")
    ap.add_argument("--max", type=int, default=240, help="stop after this many children")
    ap.add_argument("--template-mb", type=int, default=1024)
    ap.add_argument("--overcommit", default="20")
    a = ap.parse_args()
    os.environ["FORKYARD_HOT_PAUSE_S"] = "0"
    os.environ["FORKYARD_POOL"] = "off"
    os.environ["FORKYARD_SHARE_RESTORED_PAGES"] = "1" if a.sharing == "on" else "0"
    os.environ["FORKYARD_MEMORY_OVERCOMMIT"] = a.overcommit
    proc, url, key = start_server(templates_dir())
    from e2b import Template

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=900)
    kids: list[str] = []
    stopped = f"--max {a.max} reached"
    try:
        t = time.perf_counter()
        Template.build(Template().from_template("base").run_cmd("true"), TEMPLATE, memory_mb=a.template_mb)
        print(f"template {TEMPLATE} ({a.template_mb} MiB) built in {time.perf_counter() - t:.1f} s; sharing "
              f"{a.sharing}; load {os.getloadavg()[0]:.1f}", flush=True)
        sbx, want = start_holder(a.size)
        sid = sbx.sandbox_id

        time.sleep(1)
        src = sandbox_pss_mib(sid)
        avail0 = meminfo_kib("MemAvailable") / 1024
        print(f"source {sid}: holder {a.size} MiB, PSS {src:.0f} MiB; host MemAvailable {avail0:.0f} MiB", flush=True)
        print(f"{'children':>8} {'fork ms':>8} {'MemAvail MiB':>12} {'kids PSS MiB':>12} {'per kid':>8} "
              f"{'answer ok':>9}", flush=True)
        bad_total = 0
        while len(kids) < a.max:
            k = min(a.batch, a.max - len(kids))
            t = time.perf_counter()
            r = api.post(f"/sandboxes/{sid}/fork", json={"count": k, "timeout": 3600})
            ms = (time.perf_counter() - t) * 1000
            made = [e["sandbox"]["sandboxID"] for e in r.json() if "sandbox" in e] \
                if r.status_code == 201 and isinstance(r.json(), list) else []
            kids += made
            if len(made) < k:
                errs = [e.get("error") for e in r.json()] if r.status_code == 201 else [r.text[:300]]
                stopped = f"fork of {k} answered {r.status_code}: {[x for x in errs if x][:1]}"
            if made:
                with ThreadPoolExecutor(min(len(made), 8)) as ex:
                    sums = list(ex.map(ask_sum, made))
                bad = [s for s in sums if s != want]
                bad_total += len(bad)
                added = pss_total_mib([sid, *kids]) - src
                print(f"{len(kids):8d} {ms:8.0f} {meminfo_kib('MemAvailable') / 1024:12.0f} {added:12.0f} "
                      f"{added / len(kids):8.1f} {len(made) - len(bad):5d}/{len(made)}", flush=True)
                if bad:
                    print(f"   checksums that differ: {bad[:2]}", flush=True)
            if len(made) < k:
                break
        with ThreadPoolExecutor(8) as ex:
            still = sum(1 for s in ex.map(ask_sum, kids) if s == want)
        print(f"\nsharing {a.sharing}, source {a.size} MiB (PSS {src:.0f}), template {a.template_mb} MiB, "
              f"batches of {a.batch}: {len(kids)} children ran; {still} of them answered the source's checksum "
              f"at the end ({bad_total} wrong answers on the way); host MemAvailable {avail0:.0f} → "
              f"{meminfo_kib('MemAvailable') / 1024:.0f} MiB; stopped: {stopped}; load {os.getloadavg()[0]:.1f}",
              flush=True)
        return 0 if still == len(kids) and not bad_total else 1
    finally:
        stop_server(proc)  # kills the source and every child


if __name__ == "__main__":
    sys.exit(main())
