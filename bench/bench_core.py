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
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from forkyard.config import Settings
from forkyard.network.slots import NetworkManager
from forkyard.runtime.base import SandboxSpec
from forkyard.runtime.gvisor.driver import GVisorDriver
from forkyard.templates.base import build_base

DATA = Path("/var/lib/forkyard-bench")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def row(name: str, xs: list[float], raw: list[float] | None = None) -> str:
    s = f"{name:<34} p50 {pct(xs, 50):8.1f} ms   p95 {pct(xs, 95):8.1f} ms"
    if raw:
        s += f"   ratio p50 {pct(xs, 50) / pct(raw, 50):5.2f}x  p95 {pct(xs, 95) / pct(raw, 95):5.2f}x"
    return s


def start_server(templates: Path) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "e2b_" + secrets.token_hex(20)
    shutil.rmtree(DATA / "server", ignore_errors=True)
    env = dict(os.environ, FORKYARD_DATA_DIR=str(DATA / "server"), FORKYARD_TEMPLATES_DIR=str(templates),
               FORKYARD_API_KEY=key, FORKYARD_PORT=str(port))
    proc = subprocess.Popen([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base",
                             "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, key
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")


async def raw_runsc(settings: Settings, rootfs: Path, n: int) -> tuple[list[float], list[float]]:
    """Raw ``runsc run --detach`` (sleep as init) and ``runsc exec true`` timings, ms."""
    net = NetworkManager(settings)
    net.setup_host()
    driver = GVisorDriver(settings, init_argv=["/bin/sleep", "infinity"])
    slot = net.allocate(16000)
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
        net.release(16000)
    return runs, execs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=20, help="iterations per measurement")
    args = ap.parse_args()
    templates = Path(os.environ.get("FORKYARD_TEMPLATES_DIR", "/var/lib/forkyard/templates"))
    tsettings = Settings(data_dir=templates.parent)
    tsettings.templates_override = str(templates)
    build_base(tsettings, progress=lambda line: None)
    rootfs = templates / "base" / "rootfs"

    raw_settings = Settings(data_dir=DATA / "raw")
    raw_run, raw_exec = asyncio.run(raw_runsc(raw_settings, rootfs, args.n))

    proc, url, key = start_server(templates)
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
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
        proc.terminate()
        proc.wait(30)

    print(f"\nforkyard core benchmark, n={args.n}, runsc {subprocess.run(['runsc', '--version'], capture_output=True, text=True).stdout.split()[2]}")
    print(row("raw runsc run --detach", raw_run))
    print(row("raw runsc exec true", raw_exec))
    print(row("Sandbox.create('base')", create, raw_run))
    print(row("commands.run('true')", run_true, raw_exec))
    print(row("1 MiB files.write + read", files))


if __name__ == "__main__":
    main()
