"""Shared benchmark helpers: percentiles, table rows, a private forkyard server."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

#: Where benchmark servers keep their state, their network prefix and outer range. A
#: second benchmark on the same machine must set all three to other values
#: (``FORKYARD_BENCH_DATA``, ``FORKYARD_BENCH_NET_PREFIX``, ``FORKYARD_BENCH_OUTER_NET``):
#: a server start clears its data directory and the sandboxes left under it.
DATA = Path(os.environ.get("FORKYARD_BENCH_DATA", "/var/lib/forkyard-bench"))
NET_PREFIX = os.environ.get("FORKYARD_BENCH_NET_PREFIX", "fbn")
OUTER_NET = os.environ.get("FORKYARD_BENCH_OUTER_NET", "10.120.0.0/16")


def pct(xs: list[float], p: float) -> float:
    """``p``-th percentile (nearest rank) of ``xs``."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def row(name: str, xs: list[float], raw: list[float] | None = None) -> str:
    """One table line: p50/p95 in ms, and ratios to ``raw`` when given."""
    s = f"{name:<40} p50 {pct(xs, 50):8.1f} ms   p95 {pct(xs, 95):8.1f} ms"
    if raw:
        s += f"   ratio p50 {pct(xs, 50) / pct(raw, 50):5.2f}x  p95 {pct(xs, 95) / pct(raw, 95):5.2f}x"
    return s


def templates_dir() -> Path:
    """Where templates live (``$FORKYARD_TEMPLATES_DIR`` or the server default); ``base``
    is built there if missing."""
    from forkyard.config import Settings
    from forkyard.templates.base import build_base

    templates = Path(os.environ.get("FORKYARD_TEMPLATES_DIR", "/var/lib/forkyard/templates"))
    settings = Settings(data_dir=templates.parent)
    settings.templates_override = str(templates)
    build_base(settings, progress=lambda line: None)
    return templates


def _kill_sandboxes(url: str, key: str) -> None:
    """Kill every sandbox of the bench server (running or paused); best effort."""
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60) as c:
            ids, token = [], None
            while True:  # every page: the list answers 100 a page by default (E2B's)
                r = c.get("/v2/sandboxes", params={"limit": 100, **({"nextToken": token} if token else {})})
                ids += [s["sandboxID"] for s in r.json()]
                token = r.headers.get("x-next-token")
                if not token:
                    break
            for sid in ids:
                c.delete(f"/sandboxes/{sid}")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        print(f"warning: could not kill the bench server's sandboxes: {e}", file=sys.stderr)


def stop_server(proc: subprocess.Popen) -> None:
    """Kill the sandboxes of a server from :func:`start_server` (a server leaves running
    sandboxes running for re-adoption), stop it and remove its host iptables chains."""
    from forkyard.network.slots import NetnsNetwork

    if getattr(proc, "forkyard", None):
        _kill_sandboxes(*proc.forkyard)
    proc.terminate()
    proc.wait(30)
    NetnsNetwork(None, outer_net=OUTER_NET, prefix=NET_PREFIX).teardown_host()


def _clean_previous(data: Path) -> None:
    """Destroy runsc sandboxes an interrupted earlier run left under ``data`` (their
    state would be wiped with the directory, leaving them running unseen)."""
    import asyncio

    from forkyard.config import Settings
    from forkyard.runtime.gvisor.driver import GVisorDriver

    if not (data / "runsc").is_dir():
        return
    settings = Settings(data_dir=data)
    drv = GVisorDriver(settings)

    async def run() -> None:
        for sid in await drv.list_ids():
            await drv.destroy(sid, settings.sandboxes_dir / sid)

    asyncio.run(run())


def start_server(templates: Path) -> tuple[subprocess.Popen, str, str]:
    """Start ``forkyard serve`` on a free loopback port with state under
    ``DATA/server`` (net prefix ``NET_PREFIX``; no warm pool unless ``FORKYARD_POOL`` is set in
    the environment); returns ``(process, url, api key)`` and
    exports the E2B variables so the SDK talks to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "e2b_" + secrets.token_hex(20)
    _clean_previous(DATA / "server")
    shutil.rmtree(DATA / "server", ignore_errors=True)
    env = dict(os.environ, FORKYARD_DATA_DIR=str(DATA / "server"), FORKYARD_TEMPLATES_DIR=str(templates),
               FORKYARD_API_KEY=key, FORKYARD_PORT=str(port), FORKYARD_NET_PREFIX=NET_PREFIX,
               FORKYARD_OUTER_NET=OUTER_NET)
    # No warm pool unless the caller sets FORKYARD_POOL (bench_pool.py does): the other
    # benchmarks measure cold starts, and a pool refilling in the background would add
    # boots to every timing on these 2-core machines.
    env.setdefault("FORKYARD_POOL", "off")
    proc = subprocess.Popen([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base",
                             "--log-level", "warning"], env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
                proc.forkyard = (url, key)  # for stop_server
                return proc, url, key
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("server did not start")
