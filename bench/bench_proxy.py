"""Proxy throughput: a 1 MiB GET through forkyard's sandbox proxy vs the same GET straight
to the sandbox's outer address, in one run (issue 9 item 8; goal: proxy ≥ 90 % of direct).

The sandbox serves a 1 MiB file with ``python3 -m http.server``. Three paths, measured
in rounds that alternate their order (each round: ``--per-round`` GETs over one
keep-alive client connection per path) so all see the same machine load:

* ``direct`` — straight to the sandbox's outer address (the raw operation);
* ``proxy`` — through the proxy as clients send it: a GET without a body takes the
  fast path (forkyard.relay.fastpath: the body is spliced socket to socket);
* ``proxy, general relay`` — the same GET with ``Content-Length: 0``, which sends it
  through the general relay (h11 + asyncio, bodies copied through Python): what every
  GET cost before the fast path.

Prints p50/p95 of one GET (ms), its ratio to direct, and throughput (MiB/s at the
median). Every body is checked for its full length.

Usage: ``python bench/bench_proxy.py [--rounds 10] [--per-round 20]``. Starts its own
server (see bench/_common.py).
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, NET_PREFIX, OUTER_NET, pct, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings
from forkyard.network.slots import NetnsNetwork

SIZE = 1 << 20


def outer_address(sandbox_id: str) -> str:
    """The sandbox's outer IP (the address the proxy connects to), from the server's
    SQLite store (read-only)."""
    db = Settings(data_dir=DATA / "server").db_path
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        (slot,) = c.execute("SELECT slot FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    return NetnsNetwork(None, outer_net=OUTER_NET, prefix=NET_PREFIX).addresses(slot)[1]


def server_cpu_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process ``pid`` so far (/proc/PID/stat fields 14-15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / os.sysconf("SC_CLK_TCK"), int(fields[12]) / os.sysconf("SC_CLK_TCK")


def measure(url: str, headers: dict, n: int) -> list[float]:
    """Milliseconds of each of ``n`` sequential GETs of ``url`` over one connection."""
    out = []
    with httpx.Client(timeout=60, headers=headers) as c:
        c.get(url).raise_for_status()  # warm the connection
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.get(url)
            out.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200 or len(r.content) != SIZE:
                raise SystemExit(f"bad answer from {url}: {r.status_code}, {len(r.content)} bytes")
    return out


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
        paths = {"direct": (direct, {}),
                 "proxy": via,
                 "proxy, general relay": (via[0], {**via[1], "Content-Length": "0"})}
        times: dict[str, list[float]] = {name: [] for name in paths}
        rounds: dict[str, list[float]] = {name: [] for name in paths}  # each round's median
        cpu = {name: [0.0, 0.0] for name in paths}
        names = list(paths)
        for i in range(args.rounds):
            for name in (names if i % 2 == 0 else names[::-1]):
                c0 = server_cpu_s(proc.pid)
                got = measure(*paths[name], args.per_round)
                times[name] += got
                rounds[name].append(pct(got, 50))
                c1 = server_cpu_s(proc.pid)
                cpu[name] = [cpu[name][0] + c1[0] - c0[0], cpu[name][1] + c1[1] - c0[1]]
        raw = times["direct"]
        print(f"1 MiB GET, {args.rounds} rounds x {args.per_round} per path:")
        for name, xs in times.items():
            print(row(name, xs, None if name == "direct" else raw) + f"   {1000 / pct(xs, 50):6.1f} MiB/s")
        for name in names[1:]:
            user, system = (x * 1000 / (args.rounds * (args.per_round + 1)) for x in cpu[name])
            paired = pct([d / p for d, p in zip(rounds["direct"], rounds[name])], 50)
            print(f"{name}: throughput {pct(raw, 50) / pct(times[name], 50):.0%} of direct (goal >= 90 %; "
                  f"median of per-round ratios {paired:.0%}); server CPU per GET {user:.2f} ms user + "
                  f"{system:.2f} ms system")
        sbx.kill()
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
