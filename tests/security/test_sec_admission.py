"""Issue 11 item 4: a node admits sandboxes only within its capacity: creates, resumes
and forks beyond it get 503 with a clear message and change nothing, instead of
degrading every sandbox. (The CPU quota itself is the cgroup's: see docs/security.md.)"""

from __future__ import annotations

import os
import time

import pytest
from e2b import Sandbox


@pytest.fixture
def small_node(server):
    server.kill_all()
    server.stop()
    os.environ["FORKYARD_MAX_SANDBOXES"] = "2"
    try:
        server.start()
        yield server
    finally:
        os.environ.pop("FORKYARD_MAX_SANDBOXES", None)
        server.kill_all()
        server.stop()
        server.start()


def test_creates_resumes_and_forks_beyond_capacity_are_503(small_node):
    srv = small_node
    with srv.api() as c:
        assert c.get("/metrics/node").json()["capacity"]["maxSandboxes"] == 2
        a = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
        b = c.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 503 and "capacity" in r.json()["message"], r.text
        r = c.post(f"/sandboxes/{a}/fork", json={"count": 1})
        assert r.status_code == 503 and "capacity" in r.json()["message"]
        assert c.get(f"/sandboxes/{a}").json()["state"] == "running"  # the source is untouched
        # A paused sandbox holds nothing: room for a new one, then no room to resume.
        assert c.post(f"/sandboxes/{b}/pause").status_code == 204
        d = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert d.status_code == 201
        r = c.post(f"/sandboxes/{b}/resume", json={"timeout": 60})
        assert r.status_code == 503 and "capacity" in r.json()["message"]
        assert c.get(f"/sandboxes/{b}").json()["state"] == "paused"
        # The SDK sees the same answer.
        with pytest.raises(Exception, match="capacity"):
            Sandbox.create("base", timeout=60)
        assert c.delete(f"/sandboxes/{d.json()['sandboxID']}").status_code == 204
        r = c.post(f"/sandboxes/{b}/resume", json={"timeout": 60})
        assert r.status_code == 201, r.text
        assert Sandbox.connect(b).commands.run("echo up").stdout.strip() == "up"


def test_memory_and_cpu_capacity_bounds():
    """The default bound is memory (sum of limits ≤ host memory − reserve); vCPUs only
    when an overcommit ratio is set. Paused sandboxes hold nothing."""
    from forkyard.orchestrator.admission import AtCapacity, Capacity
    from forkyard.orchestrator.store import SandboxRecord

    def rec(state, mem=512, cpu=2):
        return SandboxRecord(id=state, template_id="base", state=state, slot=None, vcpus=cpu, memory_mb=mem,
                             started_at=0, end_at=0, auto_pause=True)

    cap = Capacity(memory_mb=2048, vcpus=None, max_sandboxes=None)
    live = [rec("running"), rec("creating"), rec("paused"), rec("paused")]
    cap.check(live, 2, 1024)  # 1024 used + 1024 = 2048: fits
    with pytest.raises(AtCapacity, match="1024 of 2048 MiB"):
        cap.check(live, 2, 512, count=3)
    cpu = Capacity(memory_mb=1 << 20, vcpus=6, max_sandboxes=None)
    cpu.check(live, 2, 512)
    with pytest.raises(AtCapacity, match="vCPUs"):
        cpu.check(live, 2, 512, count=2)
    assert Capacity.from_env().memory_mb > 0


def test_cpu_quota_is_the_sandbox_vcpus(sandbox):
    """The template's vCPU count is a hard CFS quota on the sandbox's cgroup: 4 busy
    loops in a 2-vCPU sandbox get at most 2 cores (less when the host is busy)."""
    import time
    from pathlib import Path

    cg = Path("/sys/fs/cgroup/cpu/forkyard", sandbox.sandbox_id)
    if not cg.is_dir():
        pytest.skip("no cgroup v1 cpu hierarchy on this host")
    assert int((cg / "cpu.cfs_quota_us").read_text()) == 2 * int((cg / "cpu.cfs_period_us").read_text())
    acct = Path("/sys/fs/cgroup/cpuacct/forkyard", sandbox.sandbox_id, "cpuacct.usage")
    u0, t0 = int(acct.read_text()), time.time()
    sandbox.commands.run("for i in 1 2 3 4; do timeout 3 sh -c 'while :; do :; done' & done; wait", timeout=30)
    cores = (int(acct.read_text()) - u0) / 1e9 / (time.time() - t0)
    assert 0 < cores <= 2.2, cores


def test_host_memory_floor_refuses_before_the_host_degrades(server):
    """Issue 10 (density): however far memory limits are overcommitted, a start that
    would leave the host under FORKYARD_MIN_AVAILABLE_MEMORY_PCT of its memory available
    is a 503 naming the cause, and nothing is created."""
    from forkyard.orchestrator.admission import AtCapacity, Capacity, _host_available_mb, _host_memory_mb

    cap = Capacity(memory_mb=1 << 30, vcpus=None, max_sandboxes=None, min_available_pct=10, sandbox_host_mb=64)
    cap.check([], 2, 512)  # this host has more than 10 % free for one more
    room = int((_host_available_mb() - _host_memory_mb() * 0.10) // 64)
    with pytest.raises(AtCapacity, match="host memory low"):
        cap.check([], 2, 512, count=room + 1)
    assert Capacity(memory_mb=1 << 30, vcpus=None, max_sandboxes=None, min_available_pct=0,
                    sandbox_host_mb=64).fits([], 2, 512, count=room + 1)  # 0: off
    server.kill_all()
    with server.restarted_with(FORKYARD_MIN_AVAILABLE_MEMORY_PCT="99.9", FORKYARD_MEMORY_OVERCOMMIT="10"), \
            server.api() as c:
        assert c.get("/metrics/node").json()["capacity"]["minAvailableMemoryPct"] == 99.9
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 503 and "host memory low" in r.json()["message"], r.text
        assert c.get("/v2/sandboxes").json() == []


HOG = r"""
import os, sys, time
b = bytearray(int(sys.argv[1]) << 20)
for i in range(0, len(b), 4096):
    b[i] = 1  # touch every page: host memory really in use
open("/tmp/hog.ready", "w").close()
while not os.path.exists("/tmp/hog.stop"):
    time.sleep(0.1)
"""


def test_overcommitted_node_refuses_by_memory_in_use_and_running_sandboxes_live(server):
    """Issue 21: with memory limits overcommitted, a node admits by what its sandboxes
    really hold: once their use fills the node's memory a create or fork is a 503
    naming it, although the limits would admit more, and every running sandbox keeps
    running with its memory; when one frees its memory, starts are admitted again."""
    from forkyard.orchestrator.admission import _host_memory_mb

    server.kill_all()
    node_mb = 1200  # this node's memory for sandboxes: the host's minus the reserve
    env = {"FORKYARD_MEMORY_OVERCOMMIT": "4", "FORKYARD_RESERVED_MEMORY_MB": str(_host_memory_mb() - node_mb),
           "FORKYARD_MIN_AVAILABLE_MEMORY_PCT": "0", "FORKYARD_HOT_PAUSE_S": "0"}
    with server.restarted_with(**env), server.api() as c:
        cap = c.get("/metrics/node").json()["capacity"]
        assert (cap["hostMemoryMB"], cap["memoryOvercommit"], cap["memoryMB"]) == (node_mb, 4, 4 * node_mb)
        hogs = []
        for _ in range(3):  # 3 x ~400 MiB in use of 1200; by limits (512 MiB each) room for 9
            r = c.post("/sandboxes", json={"templateID": "base", "timeout": 300})
            assert r.status_code == 201, r.text
            sbx = Sandbox.connect(r.json()["sandboxID"])
            sbx.files.write("/tmp/hog.py", HOG)
            sbx.commands.run("python3 /tmp/hog.py 360", background=True)
            hogs.append(sbx)
        for sbx in hogs:
            for _ in range(300):
                if sbx.files.exists("/tmp/hog.ready"):
                    break
                time.sleep(0.2)
        in_use = c.get("/metrics/node").json()["memoryInUseMB"]
        assert in_use >= 3 * 360, in_use
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 503, r.text
        assert "sandboxes use" in r.json()["message"] and "of 1200 MiB of host memory" in r.json()["message"]
        r = c.post(f"/sandboxes/{hogs[0].sandbox_id}/fork", json={"count": 1})
        assert r.status_code == 503 and "sandboxes use" in r.json()["message"], r.text
        assert len(c.get("/v2/sandboxes").json()) == 3  # nothing was created
        for sbx in hogs:  # the running ones were not harmed
            assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "running"
            assert sbx.commands.run("pgrep -f hog.py >/dev/null && echo alive").stdout.strip() == "alive"
        hogs[0].files.write("/tmp/hog.stop", "")  # one frees its memory: room again
        deadline = time.time() + 30
        while c.get("/metrics/node").json()["memoryInUseMB"] > in_use - 300 and time.time() < deadline:
            time.sleep(0.2)
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
        assert r.status_code == 201, r.text
        server.kill_all()
