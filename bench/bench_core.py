"""Core benchmark: forkyard through the real e2b SDK vs raw runsc, same rootfs, same run.

Prints p50/p95 (ms) of
  * create from ``base`` (SDK ``Sandbox.create``, until envd answers) vs raw ``runsc run
    --detach`` of the same rootfs with envd as init, until envd answers ``/health`` (each
    raw run in a fresh network slot made before the timer, like the server's spare slots);
  * ``commands.run("true")`` round trip vs the same Connect ``process.Process/Start`` call
    sent straight to envd at the raw sandbox's address (no proxy, no SDK); raw
    ``runsc exec /bin/true`` is printed for reference only (a new process from the host);
  * what users feel in a loop: ``commands.run("true")`` ``--loop`` times on one warm
    ``Sandbox`` object (created a second earlier) vs the same number of direct Connect
    calls to a raw sandbox's envd. The per-create figure above is the first five calls
    after a create, which also pay for the new sandbox settling (its first ``bash -l``
    start-ups, page cache, the server's background work after a create) — that is why
    it read 80 ms while a warm loop read ~23 ms;
  * 1 MiB ``files.write`` + ``files.read``.

Usage: ``python bench/bench_core.py [-n 20]``. Starts its own server on a free loopback
port with data under ``/var/lib/forkyard-bench`` (templates shared from
``$FORKYARD_TEMPLATES_DIR`` or ``/var/lib/forkyard/templates``; ``base`` is built if missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import struct
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings
from forkyard.network.slots import NetnsNetwork
from forkyard.runtime.base import SandboxSpec
from forkyard.runtime.gvisor.driver import GVisorDriver

def connect_run(client: httpx.Client, ip: str, script: str = "true") -> None:
    """One ``process.Process/Start`` Connect server-streaming call straight to envd at
    ``ip`` (Connect protocol: 5-byte envelopes, flag 0x02 = end of stream), read to the
    end. Raises AssertionError unless the process ended with exit code 0."""
    body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", script]}}).encode()
    with client.stream("POST", f"http://{ip}:49983/process.Process/Start",
                       content=struct.pack(">BI", 0, len(body)) + body,
                       headers={"Content-Type": "application/connect+json"}) as r:
        data = r.read()
    assert r.status_code == 200, data
    events, i = [], 0
    while i < len(data):
        flags, n = struct.unpack(">BI", data[i:i + 5])
        events.append((flags, json.loads(data[i + 5:i + 5 + n] or b"{}")))
        i += 5 + n
    assert events and events[-1][0] & 2 and "error" not in events[-1][1], events[-1:]
    ends = [e["event"]["end"] for f, e in events if not f & 2 and "end" in e.get("event", {})]
    assert ends and ends[0].get("exitCode", 0) == 0, events


async def raw_runsc(settings: Settings, rootfs: Path, n: int, loop_n: int = 0
                    ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Raw ``runsc run --detach`` (envd as init) until envd answers, direct Connect
    ``Start("true")`` calls to that envd, and ``runsc exec true`` timings, ms."""
    net = NetnsNetwork(settings, outer_net="10.122.0.0/16", prefix="fbr")
    net.setup_host()
    driver = GVisorDriver(settings)
    runs, calls, execs, loop = [], [], [], []
    client = httpx.Client(trust_env=False, timeout=30)
    try:
        for i in range(n):
            sid = f"rawbench{i}"
            slot = net.allocate(i)  # fresh, made before the timer (the server keeps spares)
            spec = SandboxSpec(sandbox_id=sid, rootfs=rootfs, network=slot.attachment, vcpus=2,
                               memory_mb=512, hostname="raw", workdir=settings.sandboxes_dir / sid)
            t = time.perf_counter()
            await driver.create(spec)
            while True:
                try:
                    if client.get(f"http://{slot.outer_ip}:49983/health", timeout=1).status_code < 500:
                        break
                except httpx.HTTPError:
                    time.sleep(0.002)
            runs.append((time.perf_counter() - t) * 1000)
            connect_run(client, slot.outer_ip)  # warm, like the SDK side
            for _ in range(5):
                t = time.perf_counter()
                connect_run(client, slot.outer_ip)
                calls.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            subprocess.run([shutil.which(settings.runsc), f"--root={settings.runsc_root}", "exec", sid, "/bin/true"],
                           check=True)
            execs.append((time.perf_counter() - t) * 1000)
            if i == 0 and loop_n:  # the warm loop, on the first sandbox, a second after its create
                time.sleep(1)
                for _ in range(loop_n):
                    t = time.perf_counter()
                    connect_run(client, slot.outer_ip)
                    loop.append((time.perf_counter() - t) * 1000)
            await driver.destroy(sid, spec.workdir)
            net.release(i)
    finally:
        client.close()
        net.teardown_host()
    return runs, calls, execs, loop


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="iterations per measurement")
    ap.add_argument("--loop", type=int, default=100, help="commands.run calls in the warm loop")
    args = ap.parse_args()
    templates = templates_dir()
    rootfs = templates / "base" / "rootfs"

    raw_settings = Settings(data_dir=DATA / "raw")
    raw_run, raw_call, raw_exec, raw_loop = asyncio.run(raw_runsc(raw_settings, rootfs, args.n, args.loop))

    proc, url, key = start_server(templates)
    from e2b import Sandbox

    create, run_true, files, warm = [], [], [], []
    payload = os.urandom(1 << 20)
    try:
        sbx = Sandbox.create("base", timeout=600)  # the warm loop: what users feel
        sbx.commands.run("true")
        time.sleep(1)
        for _ in range(args.loop):
            t = time.perf_counter()
            sbx.commands.run("true")
            warm.append((time.perf_counter() - t) * 1000)
        sbx.kill()
        for _ in range(args.n):
            t = time.perf_counter()
            sbx = Sandbox.create("base", timeout=120)
            create.append((time.perf_counter() - t) * 1000)
            sbx.commands.run("true")  # warm the connection
            for _ in range(5):
                t = time.perf_counter()
                sbx.commands.run("true")
                run_true.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            sbx.files.write("/tmp/blob", payload)
            assert sbx.files.read("/tmp/blob", format="bytes") == payload
            files.append((time.perf_counter() - t) * 1000)
            sbx.kill()
    finally:
        stop_server(proc)

    print(f"\nforkyard core benchmark, n={args.n}, runsc {subprocess.run([Settings().runsc, '--version'], capture_output=True, text=True).stdout.split()[2]}")
    print(row("raw runsc run --detach until envd answers", raw_run))
    print(row("raw Connect Start('true') to envd", raw_call))
    print(row("raw runsc exec true (reference)", raw_exec))
    print(row("Sandbox.create('base')", create, raw_run))
    print(row("commands.run('true'), 5 after each create", run_true, raw_call))
    print(row(f"raw Connect Start('true'), warm loop x{args.loop}", raw_loop))
    print(row(f"commands.run('true'), warm loop x{args.loop}", warm, raw_loop))
    print(row("1 MiB files.write + read", files))


if __name__ == "__main__":
    main()
