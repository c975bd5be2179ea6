"""Hot pause vs cold pause: pause and resume latency through the REST API (client side,
ms), with the raw runtime operations measured in the same run on the same kind of
sandbox — ``runsc pause`` + ``runsc resume`` (what a hot pause/resume adds to the API
path) — and the same loop on a server with hot pause off (resume = restore from the
committed image).

Every resume is timed only after the pause's background commit has finished (checked
through ``GET /metrics/node``, not slept), so both modes resume a durable pause.

    .venv/bin/python bench/bench_hot_pause.py -n 10
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings  # noqa: E402


def _settled(api: httpx.Client) -> None:
    """Wait until no pause is still committing (checked, not slept)."""
    deadline = time.time() + 120
    while api.get("/metrics/node").json()["pausesInFlight"] and time.time() < deadline:
        time.sleep(0.01)


def _loop(url: str, key: str, n: int, raw: bool) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"pause": [], "resume": [], "raw_pause": [], "raw_resume": []}
    runsc = [os.path.realpath(Settings().runsc), f"--root={DATA / 'server' / 'runsc'}"]
    with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=120) as api:
        sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 3600}).json()["sandboxID"]
        try:
            for _ in range(n):
                if raw:  # the runtime's own freeze/unfreeze of the same running sandbox
                    t = time.perf_counter()
                    subprocess.run([*runsc, "pause", sid], check=True)
                    out["raw_pause"].append((time.perf_counter() - t) * 1000)
                    t = time.perf_counter()
                    subprocess.run([*runsc, "resume", sid], check=True)
                    out["raw_resume"].append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/pause")
                out["pause"].append((time.perf_counter() - t) * 1000)
                assert r.status_code == 204, r.text
                _settled(api)
                t = time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/connect", json={"timeout": 3600})
                out["resume"].append((time.perf_counter() - t) * 1000)
                assert r.status_code == 201, r.text
        finally:
            api.delete(f"/sandboxes/{sid}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=10, help="pause/resume cycles per mode")
    args = ap.parse_args()
    templates = templates_dir()
    results = {}
    for mode, hot_s in (("hot", "60"), ("cold", "0")):
        os.environ["FORKYARD_HOT_PAUSE_S"] = hot_s
        proc, url, key = start_server(templates)
        try:
            results[mode] = _loop(url, key, args.n, raw=mode == "hot")
        finally:
            stop_server(proc)
    hot, cold = results["hot"], results["cold"]
    print(f"\nforkyard hot pause benchmark, n={args.n}, runsc {Settings().runsc}")
    print(row("raw runsc pause (freeze)", hot["raw_pause"]))
    print(row("raw runsc resume (unfreeze)", hot["raw_resume"]))
    print(row("hot: pause (freeze + checkpoint)", hot["pause"]))
    print(row("hot: resume via connect (vs raw)", hot["resume"], hot["raw_resume"]))
    print(row("cold: pause (stopping checkpoint)", cold["pause"]))
    print(row("cold: resume via connect (restore)", cold["resume"]))
    print(row("hot resume vs cold resume", hot["resume"], cold["resume"]))


if __name__ == "__main__":
    main()
