"""A whole cluster on one host for tests and benchmarks: a real ``redis-server`` (AOF
on), ``forkyard scheduler``, ``forkyard gateway`` and N ``forkyard node`` processes,
each node with its own data dir, netns prefix and outer range, all sharing one
posix_fs snapshot repository and the templates directory.

Every process is a real subprocess started with the same command lines the deploy
units use; :meth:`Cluster.close` stops them, destroys every sandbox the nodes left and
removes their host network chains.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from conftest import TEST_ROOT, free_port

from _slot import LETTER as _LETTER, SLOT as _N  # noqa: E402 — this session's slot


class Proc:
    """One subprocess with a log file and a health URL."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, health: str | None):
        self.name, self.argv, self.env, self.log, self.health = name, argv, env, log, health
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 120) -> None:
        logf = os.fdopen(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        os.fchmod(logf.fileno(), 0o600)  # an older log may predate this
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=logf, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + wait_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}:\n"
                                   + self.log.read_text()[-3000:])
            if self.health is None:
                return
            try:
                if httpx.get(self.health, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} did not become healthy in {wait_s} s; see {self.log}")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig_kill: bool = False) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGKILL if sig_kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Cluster:
    """Redis + scheduler + gateway + ``nodes`` nodes under ``root``.

    Attributes:
        gateway_url, scheduler_url, api_key, secret: what clients and tests use.
        sdk: keyword arguments for the e2b SDK (``api_url``, ``sandbox_url``, ``api_key``).
    """

    def __init__(self, root: Path, nodes: int = 3, max_sandboxes: dict[int, int] | None = None):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        os.chmod(root, 0o700)
        self.api_key = "e2b_" + secrets.token_hex(20)
        self.secret = secrets.token_hex(24)
        self.redis_port, self.sched_port, self.gw_port = free_port(), free_port(), free_port()
        self.scheduler_url = f"http://127.0.0.1:{self.sched_port}"
        self.gateway_url = f"http://127.0.0.1:{self.gw_port}"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.sdk = {"api_url": self.gateway_url, "sandbox_url": self.gateway_url, "api_key": self.api_key}
        base = dict(os.environ)
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
            base.pop(k, None)
        base.update(FORKYARD_CLUSTER_SECRET=self.secret, FORKYARD_API_KEY=self.api_key,
                    FORKYARD_REDIS_URL=self.redis_url, FORKYARD_SCHEDULER_URL=self.scheduler_url,
                    FORKYARD_REPO=str(root / "repository"), FORKYARD_TEMPLATES_DIR=str(TEST_ROOT / "templates"),
                    PYTHONUNBUFFERED="1")
        self.env = base
        (root / "redis").mkdir()
        self.redis = Proc("redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                                    "--dir", str(root / "redis"), "--appendonly", "yes", "--appendfsync", "always",
                                    "--save", ""], base, root / "redis.log", None)
        cli = [sys.executable, "-m", "forkyard.cli.main"]
        self.scheduler = Proc("scheduler", cli + ["scheduler", "--port", str(self.sched_port)], base,
                              root / "scheduler.log", f"{self.scheduler_url}/health")
        self.gateway = Proc("gateway", cli + ["gateway", "--port", str(self.gw_port)], base,
                            root / "gateway.log", f"{self.gateway_url}/health")
        self.nodes: list[Proc] = []
        self.node_urls: list[str] = []
        for i in range(nodes):
            port = free_port()
            env = dict(base, FORKYARD_DATA_DIR=str(root / f"node{i}"), FORKYARD_PORT=str(port),
                       FORKYARD_NET_PREFIX=f"n{'abcdefgh'[i]}{_LETTER}",
                       FORKYARD_OUTER_NET=f"10.{240 + _N}.{i * 64}.0/18", FORKYARD_NODE_ID=f"node{i}",
                       FORKYARD_NODE_MAX_SANDBOXES=str((max_sandboxes or {}).get(i, 40)))
            self.nodes.append(Proc(f"node{i}", cli + ["node", "--no-build-base", "--log-level", os.environ.get("FORKYARD_TEST_NODE_LOG", "info")], env,
                                   root / f"node{i}.log", f"http://127.0.0.1:{port}/health"))
            self.node_urls.append(f"http://127.0.0.1:{port}")

    def start(self) -> Cluster:
        """Start everything and wait until every node has registered."""
        self.redis.start()
        self._wait_redis()
        self.scheduler.start()
        self.gateway.start()
        for n in self.nodes:
            n.start()
        self.wait_nodes({f"node{i}" for i in range(len(self.nodes))})
        return self

    def _wait_redis(self, timeout_s: float = 20) -> None:
        import redis

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                if redis.Redis.from_url(self.redis_url).ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not answer")

    def restart_redis(self) -> None:
        """Stop Redis (SIGTERM) and start it again on the same port and data."""
        self.redis.stop()
        self.redis.start()
        self._wait_redis()

    def sched(self) -> httpx.Client:
        """A client for the scheduler's API (cluster secret set)."""
        return httpx.Client(base_url=self.scheduler_url, headers={"x-forkyard-cluster-secret": self.secret},
                            timeout=30, trust_env=False)

    def api(self) -> httpx.Client:
        """A client for the gateway's REST API (users' key set)."""
        return httpx.Client(base_url=self.gateway_url, headers={"X-API-Key": self.api_key}, timeout=120,
                            trust_env=False)

    def node_states(self) -> dict[str, str]:
        """``{node id: status}`` as the scheduler reports them."""
        with self.sched() as c:
            return {n["nodeID"]: n["status"] for n in c.get("/v1/nodes").json()}

    def wait_nodes(self, up: set[str], timeout_s: float = 30, status: str = "up") -> None:
        """Wait until every node in ``up`` has ``status``."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            states = self.node_states()
            if all(states.get(n) == status for n in up):
                return
            time.sleep(0.2)
        raise AssertionError(f"nodes {sorted(up)} not {status}: {self.node_states()}")

    def owner(self, sandbox_id: str) -> str | None:
        """Node id the sandbox is bound to, or None."""
        with self.sched() as c:
            r = c.get(f"/v1/sandboxes/{sandbox_id}")
            return r.json()["nodeID"] if r.status_code == 200 else None

    def close(self) -> None:
        """Stop every process; destroy what the nodes left (sandboxes, netns, chains)."""
        for n in self.nodes:
            n.stop()
        self.gateway.stop()
        self.scheduler.stop()
        self.redis.stop()
        for n in self.nodes:
            _wipe_node(Path(n.env["FORKYARD_DATA_DIR"]), n.env["FORKYARD_NET_PREFIX"], n.env["FORKYARD_OUTER_NET"])
        # keep the logs (*.log) for a failed run; drop the state
        for d in [Path(n.env["FORKYARD_DATA_DIR"]) for n in self.nodes] + [self.root / "repository", self.root / "redis"]:
            shutil.rmtree(d, ignore_errors=True)


def _wipe_node(data_dir: Path, prefix: str, outer_net: str) -> None:
    """Destroy every runsc sandbox under ``data_dir`` and the node's network slots."""
    from forkyard.config import Settings
    from forkyard.network.slots import NetnsNetwork

    runsc_root = data_dir / "runsc"
    if runsc_root.is_dir():
        out = subprocess.run([Settings().runsc, f"--root={runsc_root}", "list", "-quiet"], capture_output=True, text=True)
        for cid in out.stdout.split():
            subprocess.run([Settings().runsc, f"--root={runsc_root}", "kill", cid, "KILL"], capture_output=True)
            subprocess.run([Settings().runsc, f"--root={runsc_root}", "delete", "-force", cid], capture_output=True)
    procs = subprocess.run(["pgrep", "-f", f"--root={runsc_root}"], capture_output=True, text=True).stdout.split()
    for pid in procs:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    from conftest import stop_reaper

    stop_reaper(runsc_root)  # the node's reaper daemon outlives the node by design
    nm = NetnsNetwork(Settings(data_dir=data_dir), outer_net=outer_net, prefix=prefix)
    for idx in nm.existing_indexes():
        nm.release(idx)
    nm.teardown_host()
    for line in Path("/proc/self/mounts").read_text().splitlines():
        mnt = line.split()[1]
        if mnt.startswith(str(data_dir)):
            subprocess.run(["umount", "-l", mnt], capture_output=True)
