"""Shared fixtures: a real forkyard server process with real gVisor sandboxes.

Data lives under ``$FORKYARD_TEST_DATA_DIR`` (default ``/var/lib/forkyard-test``): the
``base`` template is built there once and cached across runs; the server gets its own
state directory below it, wiped per session.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from forkyard.config import Settings

TEST_ROOT = Path(os.environ.get("FORKYARD_TEST_DATA_DIR", "/var/lib/forkyard-test"))
#: Per-session network prefix, outer range and state dir, so two test sessions on one
#: host (developers, helpers) never touch each other's sandboxes.
from _slot import LETTER, SLOT  # noqa: E402 — this session's own slot (tests/_slot.py)

NET_PREFIX = "fy" + LETTER
OUTER_NET = f"10.{220 + SLOT}.0.0/16"
SERVER_DIR = TEST_ROOT / f"server-{NET_PREFIX}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



@contextlib.contextmanager
def redis_server(directory: Path):
    """A throw-away ``redis-server`` on a free loopback port (no persistence, its files
    under ``directory``) for the length of the block; yields its URL."""
    import redis

    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while True:
            try:
                if redis.Redis(port=port).ping():
                    break
            except redis.RedisError:
                if time.time() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=30)

def host_leftovers(runsc_root: Path | None = None) -> dict[str, list[str]]:
    """The test server's netns (``<prefix><N>``), veths, mounts and runsc processes (of
    ``runsc_root`` when given, else of the test server) present on the host now."""
    runsc_root = runsc_root or SERVER_DIR / "runsc"
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    ns = [l.split()[0] for l in ns if re.match(rf"^{NET_PREFIX}\d+s?$", l.split(" ")[0])]
    procs = subprocess.run(["pgrep", "-af", "runsc"], capture_output=True, text=True).stdout.split("\n")
    procs = [p for p in procs if f"--root={runsc_root}" in p]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout.split("\n")
    names = [l.split(":")[1].strip().split("@")[0] for l in links if l.count(":") > 1]
    veths = [n for n in names if re.match(rf"^{NET_PREFIX}v\d+$", n)]
    mounts = [l.split()[1] for l in Path("/proc/self/mounts").read_text().splitlines()
              if str(runsc_root.parent) in l.split()[1]]
    return {"netns": ns, "runsc": procs, "veth": veths, "mounts": mounts}


CLEAN = {"netns": [], "runsc": [], "veth": [], "mounts": []}


def stop_reaper(runsc_root: Path) -> None:
    """Stop the reaper daemon of ``runsc_root`` (forkyard.runtime.gvisor.reaper: it
    outlives its server by design and leaves by itself only after 30 s idle); for test
    teardown, once no sandbox of that root runs."""
    from forkyard.runtime.gvisor.reaper import socket_path

    sock = str(socket_path(runsc_root))
    pids = []
    for line in subprocess.run(["pgrep", "-af", "serve_daemon"], capture_output=True, text=True).stdout.splitlines():
        pid, _, cmd = line.partition(" ")
        if cmd.split()[-1:] == [sock]:
            pids.append(int(pid))
            try:
                os.kill(int(pid), 15)
            except ProcessLookupError:
                pass
    deadline = time.time() + 10
    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        except (OSError, IndexError):
            return False

    while pids and time.time() < deadline:
        pids = [p for p in pids if alive(p)]
        time.sleep(0.05)


@pytest.fixture(scope="session")
def base_template() -> Path:
    """Build (once, cached) the ``base`` template under the test data root."""
    from forkyard.templates.base import build_base

    settings = Settings(data_dir=TEST_ROOT)
    return build_base(settings, progress=lambda line: None)


class ServerProc:
    """A ``forkyard serve`` subprocess on a free loopback port."""

    def __init__(self, data_dir: Path, templates_dir: Path):
        self.data_dir = data_dir
        self.templates_dir = templates_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = "e2b_" + secrets.token_hex(20)
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"{data_dir.name}.log"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(FORKYARD_DATA_DIR=str(self.data_dir), FORKYARD_TEMPLATES_DIR=str(self.templates_dir),
                   FORKYARD_API_KEY=self.api_key, FORKYARD_PORT=str(self.port),
                   FORKYARD_NET_PREFIX=NET_PREFIX, FORKYARD_OUTER_NET=OUTER_NET,
                   FORKYARD_TEST_HOLD_DIR=str(self.hold_dir))  # tests/_holds.py
        # No warm pool unless a test asks for one (tests/test_pool.py, via restarted_with):
        # two idle sandboxes per test server and a boot after every create would cost
        # every test session CPU on these 2-core machines.
        env.setdefault("FORKYARD_POOL", "off")
        return env

    @property
    def hold_dir(self) -> Path:
        """Where this server's test-only hold points are armed (tests/_holds.py)."""
        return self.data_dir / "test-holds"

    def hold(self, phase: str, sandbox_id: str = ""):
        """Arm hold point ``phase`` (for ``sandbox_id``, or any): see tests/_holds.py."""
        from _holds import Hold

        return Hold(self.hold_dir, phase, sandbox_id)

    def start(self) -> None:
        logf = os.fdopen(os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")  # logs may hold ids and tokens
        os.fchmod(logf.fileno(), 0o600)  # an older log may predate this
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base", "--log-level", "info"],
            env=self.env(), stdout=logf, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120  # generous: the machine has 2 cores and may be busy
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server did not start in 120 s; see {self.log}")

    def stop(self, sig_kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            if sig_kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(timeout=30)
        self.proc = None

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.api_key}, timeout=60)

    def leftovers(self) -> dict[str, list[str]]:
        """:func:`host_leftovers` of this running server, its spare slots, spare disks and
        its warm pool's sandboxes (slots and runsc processes) excepted (the host is listed first:
        a spare or pooled sandbox made meanwhile is already in the server's lists)."""
        found = host_leftovers()
        with self.api() as c:
            node = c.get("/metrics/node").json()
        spare = set(node["spareSlots"]) | set(node.get("poolSlots", []))
        pooled = [f"/sandboxes/{sid}/" for sid in node.get("poolSandboxes", [])]
        found["netns"] = [n for n in found["netns"] if int(n[len(NET_PREFIX):].rstrip("s")) not in spare]
        found["veth"] = [n for n in found["veth"] if int(n[len(NET_PREFIX) + 1:]) not in spare]
        found["runsc"] = [p for p in found["runsc"] if not any(d in p for d in pooled)]
        found["mounts"] = [m for m in found["mounts"] if not any(d.rstrip("/") in m for d in pooled)]
        # Spare disks (made ahead, moved into sandboxes as they start): a spare listed on
        # the host may be in use or on its way by the time the server is asked, so all
        # of them are left out; a stopped server must have removed them (session end).
        found["mounts"] = [m for m in found["mounts"] if not m.startswith(f"{self.data_dir}/spare-disks/")]
        return found

    def wait_clean(self, timeout_s: float = 20) -> None:
        """Wait (≤ ``timeout_s``) until :meth:`leftovers` is clean — an interrupted runsc
        may still be exiting — then assert it is."""
        deadline = time.time() + timeout_s
        while self.leftovers() != CLEAN and time.time() < deadline:
            time.sleep(0.2)
        assert self.leftovers() == CLEAN

    def settle(self, timeout_s: float = 30) -> None:
        """Wait until no pause is still committing and no image GC runs in the background."""
        deadline = time.time() + timeout_s
        with self.api() as c:
            while time.time() < deadline:
                node = c.get("/metrics/node").json()
                if not node["pausesInFlight"] and not node["gcInFlight"]:
                    return
                time.sleep(0.05)

    def release_holds(self) -> None:
        """Disarm every hold point and let any parked operation go on."""
        if self.hold_dir.is_dir():
            for f in self.hold_dir.iterdir():
                if f.suffix == ".arm":
                    f.unlink(missing_ok=True)
                elif f.suffix == ".reached":
                    f.with_suffix(".release").touch()

    @contextlib.contextmanager
    def restarted_with(self, **env: str):
        """Restart the server with extra environment ``env`` (e.g. a setting under test);
        on exit the old values come back and the server restarts with them."""
        before = {k: os.environ.get(k) for k in env}
        self.stop()
        os.environ.update(env)
        try:
            self.start()
            yield self
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self.stop()
            self.start()

    def kill_all(self) -> None:
        self.release_holds()  # a test that failed while an operation was held
        with self.api() as c:
            for s in c.get("/v2/sandboxes").json():
                c.delete(f"/sandboxes/{s['sandboxID']}")


@pytest.fixture(scope="session")
def server(base_template) -> ServerProc:
    """Session-wide server; sets ``E2B_API_URL``/``E2B_SANDBOX_URL``/``E2B_API_KEY`` so
    the real e2b SDK talks to it. At the end every sandbox is killed and the host is
    asserted clean."""
    data = SERVER_DIR
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    srv = ServerProc(data, TEST_ROOT / "templates")
    srv.start()
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
    os.environ.pop("E2B_DEBUG", None)
    yield srv
    try:
        if srv.proc and srv.proc.poll() is None:
            srv.kill_all()
    finally:
        srv.stop()
        stop_reaper(data / "runsc")
    # The server leaves nothing behind once its sandboxes are killed.
    assert host_leftovers() == CLEAN
    from forkyard.network.slots import NetnsNetwork

    NetnsNetwork(None, outer_net=OUTER_NET, prefix=NET_PREFIX).teardown_host()


@pytest.fixture(autouse=True)
def _server_stays_up(request):
    """A test that leaves the session server down (stopped and not started again, or
    crashed) gets an error of its own, and the server is started again so the tests
    after it are not failed by its leftovers (CI once lost 89 tests that way)."""
    yield
    if "server" not in request.fixturenames:
        return
    srv = request.getfixturevalue("server")
    if srv.proc is not None and srv.proc.poll() is None:
        return
    code = None if srv.proc is None else srv.proc.returncode
    srv.start()
    pytest.fail(f"the session server was down after this test (exit code {code}); started again")


@pytest.fixture
def sandbox(server):
    """A fresh sandbox from ``base`` through the real e2b SDK, killed afterwards."""
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=120)
    yield sbx
    try:
        sbx.kill()
    except Exception:
        pass


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory):
    """A real control plane for a module (tests/_fleet.py): redis-server, 2 scheduler
    replicas and a gateway, no node."""
    from _fleet import ControlPlane

    cp = ControlPlane(tmp_path_factory.mktemp("cp"), schedulers=2)
    try:
        cp.start()
        yield cp
    finally:
        cp.close()


@pytest.fixture
def plane(control_plane):
    """The module's control plane with an empty Redis (the schedulers carry no state).
    Flushed twice: a heartbeat the previous test's fleet sent just before it stopped may
    still be in a scheduler's batching window (cluster/batching.py, 50 ms) and would
    register its node in the flushed Redis."""
    import redis

    r = redis.Redis.from_url(control_plane.redis_url)
    r.flushall()
    time.sleep(0.5)
    r.flushall()
    return control_plane
