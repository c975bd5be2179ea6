"""Core benchmark: forkyard through the real e2b SDK vs raw runsc, same rootfs, same run.

Prints p50/p95 (ms) of
  * create from ``base`` (SDK ``Sandbox.create``, until envd answers) vs raw ``runsc run --detach``;
  * ``commands.run("true")`` round trip vs raw ``runsc exec <id> /bin/true``;
  * 1 MiB ``files.write`` + ``files.read``.

Usage: ``python bench/bench_core.py [-n 20]``. Starts its own server on a free loopback
port with data under ``/var/lib/forkyard-bench`` (templates shared from
``$FORKYARD_TEMPLATES_DIR`` or ``/var/lib/forkyard/templates``; ``base`` is built if missing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402

from forkyard.config import Settings
from forkyard.network.slots import NetworkManager
from forkyard.runtime.base import SandboxSpec
from forkyard.runtime.gvisor.driver import GVisorDriver

async def raw_runsc(settings: Settings, rootfs: Path, n: int) -> tuple[list[float], list[float]]:
    """Raw ``runsc run --detach`` (sleep as init) and ``runsc exec true`` timings, ms."""
    net = NetworkManager(settings, outer_net="10.241.0.0/16", prefix="fbr")
    net.setup_host()
    driver = GVisorDriver(settings, init_argv=["/bin/sleep", "infinity"])
    slot = net.allocate(0)
    runs, execs = [], []
    try:
        for i in range(n):
            sid = f"rawbench{i}"
            spec = SandboxSpec(sandbox_id=sid, rootfs=rootfs, netns_path=slot.netns_path, vcpus=2,
                               memory_mb=512, hostname="raw", workdir=settings.sandboxes_dir / sid)
            t = time.perf_counter()
            await driver.create(spec)
            runs.append((time.perf_counter() - t) * 1000)
            t = time.perf_counter()
            subprocess.run([shutil.which(settings.runsc), f"--root={settings.runsc_root}", "exec", sid, "/bin/true"],
                           check=True)
            execs.append((time.perf_counter() - t) * 1000)
            await driver.destroy(sid, spec.workdir)
    finally:
        net.release(0)
        net.teardown_host()
    return runs, execs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="iterations per measurement")
    args = ap.parse_args()
    templates = templates_dir()
    rootfs = templates / "base" / "rootfs"

    raw_settings = Settings(data_dir=DATA / "raw")
    raw_run, raw_exec = asyncio.run(raw_runsc(raw_settings, rootfs, args.n))

    proc, url, key = start_server(templates)
    from e2b import Sandbox

    create, run_true, files = [], [], []
    payload = os.urandom(1 << 20)
    try:
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
    print(row("raw runsc run --detach", raw_run))
    print(row("raw runsc exec true", raw_exec))
    print(row("Sandbox.create('base')", create, raw_run))
    print(row("commands.run('true')", run_true, raw_exec))
    print(row("1 MiB files.write + read", files))


if __name__ == "__main__":
    main()
