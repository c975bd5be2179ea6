"""README "A cluster": its setup block runs as written on a fresh host (paths moved under
a temporary root, Redis on a free port) and gives a Redis that listens on loopback only,
refuses clients without the password, keeps its append-only files private, and that
the cluster reaches through ``FORKYARD_REDIS_URL``. No runsc needed.

Before issue 19 the block's ``redis-server --dir /var/lib/forkyard-redis`` failed on a
fresh host (the directory did not exist) and listened on every address without a
password."""

from __future__ import annotations

import asyncio
import re
import stat
import subprocess
import time
from pathlib import Path

import pytest
import redis
from conftest import free_port

from forkyard.cluster.store import ClusterStore

REPO = Path(__file__).resolve().parent.parent


def readme_setup_block() -> str:
    """The README's cluster setup (the bash block after "Every command reads the same settings")."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## A cluster"):]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    block = next(b for b in blocks if "redis-server" in b)
    return block


@pytest.fixture
def setup_root(tmp_path):
    yield tmp_path
    pidfile = tmp_path / "redis.pid"
    if pidfile.exists():
        subprocess.run(["kill", pidfile.read_text().strip()], capture_output=True)


def test_readme_cluster_setup_gives_a_private_loopback_redis_with_a_password(setup_root):
    root = setup_root
    port = free_port()
    block = (readme_setup_block().replace("/etc/forkyard", str(root / "etc"))
             .replace("/var/lib/forkyard-redis", str(root / "redis")).replace("6379", str(port))
             .replace("/srv/forkyard-repo", str(root / "repo"))
             .replace("--daemonize yes", f"--daemonize yes --pidfile {root / 'redis.pid'}"))
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", block + '\necho "URL=$FORKYARD_REDIS_URL"'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    url = out.stdout.split("URL=", 1)[1].strip()
    assert re.fullmatch(rf"redis://:[0-9a-f]{{48}}@127\.0\.0\.1:{port}/0", url), url
    deadline = time.time() + 20
    while True:  # daemonized: wait until it answers
        try:
            redis.Redis(port=port).ping()
        except redis.AuthenticationError:
            break  # answers, and wants the password
        except redis.ConnectionError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
        else:
            raise AssertionError("Redis answered a client without the password")
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=port, password="wrong").ping()
    r = redis.Redis.from_url(url)
    assert r.config_get("bind")["bind"] == "127.0.0.1"
    assert r.config_get("appendonly")["appendonly"] == "yes"
    assert r.config_get("dir")["dir"] == str(root / "redis")

    async def through_the_store():
        store = ClusterStore(url)
        try:
            await store.ensure_epoch()
            return await store.ping()
        finally:
            await store.aclose()

    assert asyncio.run(through_the_store())
    # The secrets and the AOF are private.
    for p in [root / "etc" / n for n in ("cluster_secret", "api_key", "redis.conf")]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((root / "redis").stat().st_mode) == 0o700
    written = [p for p in (root / "redis").rglob("*") if p.is_file()]
    assert written and all(stat.S_IMODE(p.stat().st_mode) & 0o077 == 0 for p in written), \
        [(p.name, oct(p.stat().st_mode)) for p in written]


def test_a_cluster_node_without_a_shared_repository_is_refused(tmp_path):
    """E2B users expect a paused sandbox to resume anywhere: a node that would keep its
    snapshots to itself (no FORKYARD_REPO) is refused unless explicitly allowed (it
    joined silently before)."""
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORKYARD_", "E2B_"))}
    env["FORKYARD_DATA_DIR"] = str(tmp_path)
    argv = [sys.executable, "-m", "forkyard.cli.main", "node", "--scheduler", "http://127.0.0.1:1", "--no-build-base"]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "FORKYARD_REPO" in out.stdout + out.stderr and "FORKYARD_ALLOW_LOCAL_REPO" in \
        out.stdout + out.stderr, out.stdout + out.stderr
    # allowed: it goes on (and stops at the next missing setting, its node key), with a warning
    out = subprocess.run(argv, env=dict(env, FORKYARD_ALLOW_LOCAL_REPO="1"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "warning: FORKYARD_REPO is unset" in out.stdout, out.stdout + out.stderr
    assert "cluster node needs its own key" in out.stdout + out.stderr
