"""Proxy throughput: a 1 MiB GET through forkyard's sandbox proxy vs the same GET straight
to the sandbox's outer address, in one run (issue 9 item 8; goal: proxy ≥ 90 % of direct).

The sandbox serves a 1 MiB file with ``python3 -m http.server``. Rounds alternate
between the two paths (each round: ``--per-round`` GETs over one keep-alive connection)
so both see the same machine load. Every body is checked for its full length.

Usage: ``python bench/bench_proxy.py [--rounds 10] [--per-round 20]``. Starts its own
server (see bench/_common.py).
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, NET_PREFIX, OUTER_NET, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings
from forkyard.network.slots import NetworkManager

SIZE = 1 << 20


def outer_address(sandbox_id: str) -> str:
    """The sandbox's outer IP (the address the proxy connects to), from the server's
    SQLite store (read-only)."""
    db = Settings(data_dir=DATA / "server").db_path
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (slot,) = c.execute("SELECT slot FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    return NetworkManager(None, outer_net=OUTER_NET, prefix=NET_PREFIX).addresses(slot)[1]


def measure(url: str, headers: dict, n: int) -> float:
    """MiB/s of ``n`` sequential GETs of ``url`` over one connection."""
    with httpx.Client(timeout=60, headers=headers) as c:
        c.get(url).raise_for_status()  # warm the connection
        t0 = time.perf_counter()
        for _ in range(n):
            r = c.get(url)
            if r.status_code != 200 or len(r.content) != SIZE:
                raise SystemExit(f"bad answer from {url}: {r.status_code}, {len(r.content)} bytes")
        return n * SIZE / (1 << 20) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=20)
    args = ap.parse_args()
    proc, url, _key = start_server(templates_dir())
    try:
        from e2b import Sandbox

        sbx = Sandbox.create("base", timeout=600)
        sbx.commands.run("mkdir -p /tmp/www && head -c 1048576 /dev/urandom > /tmp/www/big.bin")
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8000 >/dev/null 2>&1", background=True, timeout=0)
        direct = f"http://{outer_address(sbx.sandbox_id)}:8000/big.bin"
        via = (f"{url}/big.bin", {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
        deadline = time.time() + 30
        while True:
            try:
                if httpx.get(direct, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("http.server in the sandbox did not come up")
            time.sleep(0.3)
        d, p = [], []
        for _ in range(args.rounds):
            d.append(measure(direct, {}, args.per_round))
            p.append(measure(*via, args.per_round))
        ratios = sorted(b / a for a, b in zip(d, p))
        d, p = sorted(d), sorted(p)
        md, mp = d[len(d) // 2], p[len(p) // 2]
        # The paired ratio compares rounds run back to back, so it moves less with the
        # load of a shared machine than the ratio of the two medians.
        print(f"1 MiB GET, {args.rounds} rounds x {args.per_round} (median MiB/s): "
              f"direct {md:.1f}  proxy {mp:.1f}  proxy/direct {mp / md:.0%}  "
              f"(median of per-round ratios {ratios[len(ratios) // 2]:.0%})")
        sbx.kill()
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
