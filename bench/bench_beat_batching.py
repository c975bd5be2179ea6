"""What pipelining the scheduler's heartbeat script calls would save (issue 26): the CPU
a Python process spends per ``EVALSHA`` of a heartbeat-shaped script through redis-py's
asyncio client (hiredis parser, loopback TCP), one call at a time vs K calls in one
pipeline, against a real ``redis-server`` started on a free port and stopped after.

The script writes what :data:`forkyard.cluster.scripts.HEARTBEAT` writes in the common
case (the node's hash with its report, the node set) and answers a 3-element reply;
the report is a heartbeat report's size. Printed per mode: CPU ms per call (user +
system of this process, p50 over ``--rounds``) and the ratio to one call at a time.

Usage: ``python bench/bench_beat_batching.py [--calls 3000] [--rounds 3] [--batches 3,5,10]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import statistics
import subprocess
import tempfile
import time

import redis.asyncio as aioredis

LUA = """
local now = redis.call('TIME')
redis.call('HSET', KEYS[2], 'url', ARGV[2], 'report', ARGV[3], 'seen', now[1])
redis.call('SADD', KEYS[1], ARGV[1])
return {'up', 0, '0123456789abcdef'}
"""
REPORT = json.dumps({"vcpus": 2, "memoryMb": 24000, "maxSandboxes": 45, "freeSlots": 40, "cacheBytes": 1 << 30,
                     "load1": 1.2, "runtime": "runsc-0.0~20260905", "boot": "0123456789ab",
                     "cachedSnapshots": ["s" * 16] * 10, "drainDone": False})


def _cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


async def _run(port: int, calls: int, rounds: int, batches: list[int]) -> dict[str, list[float]]:
    r = aioredis.Redis(port=port, max_connections=64)
    script = r.register_script(LUA)
    await script(keys=["n", "node:0"], args=["0", "u", REPORT])
    out: dict[str, list[float]] = {}
    for _ in range(rounds):
        for k in [1, *batches]:
            c0 = _cpu()
            for b in range(0, calls, k):
                if k == 1:
                    await script(keys=["n", f"node:{b % 300}"], args=[str(b), "u", REPORT])
                    continue
                async with r.pipeline(transaction=False) as p:
                    for i in range(b, min(b + k, calls)):
                        p.evalsha(script.sha, 2, "n", f"node:{i % 300}", str(i), "u", REPORT)
                    await p.execute()
            out.setdefault("one at a time" if k == 1 else f"pipelined by {k}", []).append((_cpu() - c0) / calls * 1000)
    await r.aclose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="3,5,10")
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        srv = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", d], stdout=subprocess.DEVNULL)
        try:
            time.sleep(0.5)
            res = asyncio.run(_run(port, a.calls, a.rounds, [int(x) for x in a.batches.split(",")]))
        finally:
            srv.terminate()
            srv.wait(10)
    base = statistics.median(res["one at a time"])
    print(f"{'mode':<18} {'CPU ms per call p50':>20} {'ratio':>7}   (1-min load {open('/proc/loadavg').read().split()[0]})")
    for mode, v in res.items():
        print(f"{mode:<18} {statistics.median(v):>20.3f} {statistics.median(v) / base:>7.2f}")


if __name__ == "__main__":
    main()
