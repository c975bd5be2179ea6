"""A whole cluster on one host for tests and benchmarks: a real ``redis-server`` (AOF
on), ``forkyard scheduler``, ``forkyard gateway`` and N ``forkyard node`` processes,
each node with its own data dir, netns prefix and outer range, all sharing one
posix_fs snapshot repository and the templates directory.

Every process is a real subprocess started with the same command lines the deploy
units use; :meth:`Cluster.close` stops them, destroys every sandbox the nodes left and
removes their host network chains.
"""

from __future__ import annotations

import contextlib
import os
import resource
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

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, health: str | None,
                 cgroup: Path | None = None):
        self.name, self.argv, self.env, self.log, self.health = name, argv, env, log, health
        #: a cgroup v2 directory the process starts in (so firewall rules can match its sockets)
        self.cgroup = cgroup
        self.proc: subprocess.Popen | None = None

    def start(self, wait_s: float = 120) -> None:
        logf = os.fdopen(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
        os.fchmod(logf.fileno(), 0o600)  # an older log may predate this
        procs = str(self.cgroup / "cgroup.procs") if self.cgroup else None

        def in_child():  # before exec: no core file from the SIGABRT of stop(); every socket in the group
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            if procs:
                with open(procs, "w") as f:
                    f.write(str(os.getpid()))

        # PYTHONFAULTHANDLER: a SIGABRT (stop() of a process that ignores SIGTERM) writes every
        # thread's stack to the log first.
        self.proc = subprocess.Popen(self.argv, env=dict(self.env, PYTHONFAULTHANDLER="1"), stdout=logf,
                                     stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=in_child)
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

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the process itself (not its children: SIGSTOP of a node
        freezes the node, not its sandboxes)."""
        if self.running():
            self.proc.send_signal(sig)

    def stop(self, sig_kill: bool = False) -> None:
        if self.running():
            self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self.proc.send_signal(signal.SIGKILL if sig_kill else signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:  # hung: its stacks into the log (PYTHONFAULTHANDLER), then gone
                print(f"{self.name} ignored SIGTERM for 60 s; SIGABRT (stacks in {self.log}), then SIGKILL")
                self.proc.send_signal(signal.SIGABRT)
                try:
                    self.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.proc = None


class Cluster:
    """Redis + scheduler + gateway + ``nodes`` nodes under ``root``.

    Attributes:
        gateway_url, scheduler_url, api_key, secret: what clients and tests use (``secret``:
            the control plane's; each node's env has its own ``FORKYARD_NODE_KEY``).
        sdk: keyword arguments for the e2b SDK (``api_url``, ``sandbox_url``, ``api_key``).
        schedulers: every scheduler replica (``scheduler`` is the first); nodes and the
            gateway are given all their URLs.

    Args:
        schedulers: scheduler replicas to run.
        env: settings for every process (e.g. an S3 ``FORKYARD_REPO``).
        data_fs_mb: ``{node index: MiB}``: that node's data dir is a filesystem of its own
            of this size (a loop-mounted ext4 image), so a test can fill it.
        node_cgroups: start each node process in a cgroup v2 group of its own
            (:data:`CGROUP2`), so firewall rules can match its traffic (a partition).
    """

    def __init__(self, root: Path, nodes: int = 3, max_sandboxes: dict[int, int] | None = None,
                 schedulers: int = 1, env: dict[str, str] | None = None, data_fs_mb: dict[int, int] | None = None,
                 node_cgroups: bool = False):
        self.root = root
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        os.chmod(root, 0o700)
        self.api_key = "e2b_" + secrets.token_hex(20)
        self.secret = secrets.token_hex(24)
        self.redis_port, self.sched_port, self.gw_port = free_port(), free_port(), free_port()
        self.sched_ports = [self.sched_port] + [free_port() for _ in range(schedulers - 1)]
        self.scheduler_url = f"http://127.0.0.1:{self.sched_port}"
        self.scheduler_urls = ",".join(f"http://127.0.0.1:{p}" for p in self.sched_ports)
        self.data_fs_mb = data_fs_mb or {}
        self.gateway_url = f"http://127.0.0.1:{self.gw_port}"
        self.redis_url = f"redis://127.0.0.1:{self.redis_port}/0"
        self.sdk = {"api_url": self.gateway_url, "sandbox_url": self.gateway_url, "api_key": self.api_key}
        base = dict(os.environ)
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY"):
            base.pop(k, None)
        base.update(FORKYARD_CLUSTER_SECRET=self.secret, FORKYARD_API_KEY=self.api_key,
                    FORKYARD_REDIS_URL=self.redis_url, FORKYARD_SCHEDULER_URL=self.scheduler_urls,
                    FORKYARD_REPO=str(root / "repository"), FORKYARD_TEMPLATES_DIR=str(TEST_ROOT / "templates"),
                    PYTHONUNBUFFERED="1")
        base.update(env or {})
        self.env = base
        (root / "redis").mkdir()
        self.redis = Proc("redis", self._redis_argv(aof=True), base, root / "redis.log", None)
        cli = [sys.executable, "-m", "forkyard.cli.main"]
        self.schedulers = [Proc("scheduler" if i == 0 else f"scheduler{i + 1}",
                                cli + ["scheduler", "--port", str(port)], base,
                                root / ("scheduler.log" if i == 0 else f"scheduler{i + 1}.log"),
                                f"http://127.0.0.1:{port}/health") for i, port in enumerate(self.sched_ports)]
        self.scheduler = self.schedulers[0]
        self.gateway = Proc("gateway", cli + ["gateway", "--port", str(self.gw_port)], base,
                            root / "gateway.log", f"{self.gateway_url}/health")
        self.nodes: list[Proc] = []
        self.node_urls: list[str] = []
        from forkyard.cluster.nodekeys import node_key

        node_base = {k: v for k, v in base.items() if k not in ("FORKYARD_CLUSTER_SECRET", "FORKYARD_REDIS_URL")}
        for i in range(nodes):
            port = free_port()
            # A node holds only its own key, bound to its id and URL (forkyard.cluster.nodekeys).
            env = dict(node_base, FORKYARD_NODE_KEY=node_key(self.secret, f"node{i}", f"http://127.0.0.1:{port}"),
                       FORKYARD_DATA_DIR=str(root / f"node{i}"), FORKYARD_PORT=str(port),
                       FORKYARD_NET_PREFIX=f"n{'abcdefgh'[i]}{_LETTER}",
                       FORKYARD_OUTER_NET=f"10.{240 + _N}.{i * 64}.0/18", FORKYARD_NODE_ID=f"node{i}",
                       FORKYARD_NODE_MAX_SANDBOXES=str((max_sandboxes or {}).get(i, 40)))
            self.nodes.append(Proc(f"node{i}", cli + ["node", "--no-build-base", "--log-level", os.environ.get("FORKYARD_TEST_NODE_LOG", "info")], env,
                                   root / f"node{i}.log", f"http://127.0.0.1:{port}/health",
                                   cgroup=CGROUP2 / f"fy-test-{os.getpid()}-node{i}" if node_cgroups else None))
            self.node_urls.append(f"http://127.0.0.1:{port}")

    def _redis_argv(self, aof: bool) -> list[str]:
        return ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--dir", str(self.root / "redis"),
                "--appendonly", "yes" if aof else "no", "--appendfsync", "always", "--save", ""]

    def start(self) -> Cluster:
        """Start everything and wait until every node has registered."""
        for i, mb in self.data_fs_mb.items():
            _mount_small_fs(Path(self.nodes[i].env["FORKYARD_DATA_DIR"]), mb)
        for n in self.nodes:
            if n.cgroup:
                n.cgroup.mkdir(exist_ok=True)
        self.redis.start()
        self._wait_redis()
        for s in self.schedulers:
            s.start()
        self.gateway.start()
        for n in self.nodes:
            n.start()
        self.wait_nodes({f"node{i}" for i in range(len(self.nodes))}, timeout_s=90)  # (30 s was short once under CI load)
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

    def start_redis(self, aof: bool = True) -> None:
        """Start Redis again; ``aof`` False: as a Redis without its append-only file
        (the data is gone: what a restart without persistence does)."""
        if not aof:
            shutil.rmtree(self.root / "redis", ignore_errors=True)
            (self.root / "redis").mkdir()
        self.redis.argv = self._redis_argv(aof=True)  # the cluster's Redis keeps AOF on afterwards
        self.redis.start()
        self._wait_redis()

    def sched(self) -> httpx.Client:
        """A client for the scheduler's API (cluster secret set): the first replica whose
        process runs."""
        port = next((p for s, p in zip(self.schedulers, self.sched_ports) if s.running()), self.sched_port)
        return httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"x-forkyard-cluster-secret": self.secret},
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
        for s in self.schedulers:
            s.stop()
        self.redis.stop()
        for n in self.nodes:
            _wipe_node(Path(n.env["FORKYARD_DATA_DIR"]), n.env["FORKYARD_NET_PREFIX"], n.env["FORKYARD_OUTER_NET"])
        for i in self.data_fs_mb:
            _unmount_small_fs(Path(self.nodes[i].env["FORKYARD_DATA_DIR"]))
        for n in self.nodes:
            if n.cgroup and n.cgroup.is_dir():
                _remove_cgroup(n.cgroup)
        # keep the logs (*.log) for a failed run; drop the state
        for d in [Path(n.env["FORKYARD_DATA_DIR"]) for n in self.nodes] + [self.root / "repository", self.root / "redis"]:
            shutil.rmtree(d, ignore_errors=True)


    @contextlib.contextmanager
    def running(self):
        """Start the cluster for the block; on leaving, close it and assert the host is
        clean (:func:`assert_clean`)."""
        try:
            self.start()
            yield self
        finally:
            self.close()
            assert_clean(self)


def assert_clean(c: Cluster) -> None:
    """No netns, runsc process or mount of the cluster's nodes is left on the host."""
    prefixes = [n.env["FORKYARD_NET_PREFIX"] for n in c.nodes]
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    assert not [l for l in ns if l and any(l.split()[0].startswith(p) for p in prefixes)]
    procs = subprocess.run(["pgrep", "-af", "runsc"], capture_output=True, text=True).stdout
    assert str(c.root) not in procs
    assert str(c.root) not in open("/proc/self/mounts").read()


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


#: Where cgroup v2 is mounted (a hybrid host mounts it at /sys/fs/cgroup/unified).
CGROUP2 = Path("/sys/fs/cgroup/unified") if Path("/sys/fs/cgroup/unified/cgroup.procs").exists() else Path("/sys/fs/cgroup")


def _remove_cgroup(group: Path) -> None:
    """Kill what is left in ``group`` (its node is stopped and wiped: anything there is a
    leak, say a child that would hold the node's network prefix), then remove it."""
    for pid in (group / "cgroup.procs").read_text().split():
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:150]
            print(f"left in {group.name}: pid {pid} ({cmd.decode(errors='replace')}): killed")
            os.kill(int(pid), signal.SIGKILL)
        except (OSError, ValueError):
            pass
    deadline = time.time() + 10
    while (group / "cgroup.procs").read_text().split() and time.time() < deadline:
        time.sleep(0.1)
    try:
        group.rmdir()
    except OSError:
        pass


def _mount_small_fs(path: Path, size_mb: int) -> None:
    """Make ``path`` an ext4 filesystem of ``size_mb`` MiB of its own (a sparse image next
    to it, loop-mounted), so a test can fill a node's data dir without filling the host."""
    image = path.with_name(path.name + ".img")
    path.mkdir(parents=True, exist_ok=True)
    # 0600 like the data dir it holds (state, tokens, keys); an older image may predate this
    with os.fdopen(os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        os.fchmod(f.fileno(), 0o600)
        f.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True)
    subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True, capture_output=True)


def _unmount_small_fs(path: Path) -> None:
    """Undo :func:`_mount_small_fs` (``_wipe_node`` may have detached it lazily already)."""
    def mounted() -> bool:
        return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())

    for _ in range(20):
        if not mounted() or subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            break
        time.sleep(0.5)
    else:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
    path.with_name(path.name + ".img").unlink(missing_ok=True)
