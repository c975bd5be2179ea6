"""Timed GETs in a process of their own (``bench_control_plane.py``'s list figures).

The bench's process runs the simulated fleet; a GET timed on its event loop waited for
the fleet's heartbeats as well (as the placement clients did: ``_placer.py``). Here one
keep-alive client sends ``N`` sequential ``GET PATH`` with the query ``PARAMS`` (a JSON
object) and prints one JSON line: ``{"ms": [latency of each], "headers": {the last
answer's headers}}``; an answer other than 200 exits 1 with it on stderr. The API key
comes on stdin, never on the command line.

Usage: ``python bench/_getter.py BASE_URL PATH N PARAMS_JSON < api-key``.
"""

from __future__ import annotations

import json
import sys
import time

import httpx


def main(base: str, path: str, n: int, params: dict, key: str) -> int:
    """Run the GETs; returns the exit status."""
    out, r = [], None
    with httpx.Client(base_url=base, headers={"X-API-Key": key}, timeout=300, trust_env=False) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            r = c.get(path, params=params or None)
            out.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 200:
                print(f"GET {path}: {r.status_code} {r.text[:300]}", file=sys.stderr)
                return 1
    print(json.dumps({"ms": out, "headers": dict(r.headers) if r is not None else {}}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.stdin.readline().strip()))
