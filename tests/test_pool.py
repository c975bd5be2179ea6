"""Warm pool (forkyard.orchestrator.pool): creates are handed pre-started sandboxes with
everything the request asked for applied at hand-out; pooled sandboxes are never listed,
counted or shared, hold capacity honestly and yield to user sandboxes, and a restart (or
a crash) leaves none behind.

One server for the module: pool ``base:2`` and at most 2 sandboxes on the node (user and
pooled together), so the yielding is visible with few sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import pytest
from e2b import Sandbox

from conftest import CLEAN, NET_PREFIX, host_leftovers


@pytest.fixture(scope="module")
def pool_server(server):
    server.kill_all()  # the node limit below counts every user sandbox
    with server.restarted_with(FORKYARD_POOL="base:2", FORKYARD_MAX_SANDBOXES="2"):
        yield server
        server.kill_all()


def _node(srv) -> dict:
    with srv.api() as c:
        return c.get("/metrics/node").json()


def _pool(srv) -> dict:
    return _node(srv)["pool"]["base"]


def _wait_pool(srv, ready: int, timeout_s: float = 90) -> dict:
    """Wait until the pool has ``ready`` ready sandboxes and none starting."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        p = _pool(srv)
        if p["ready"] == ready and p["starting"] == 0:
            return p
        time.sleep(0.1)
    raise AssertionError(f"pool never reached {ready} ready: {_pool(srv)}")


def _phases(r: httpx.Response) -> set[str]:
    return {p.split(";")[0].strip() for p in r.headers.get("server-timing", "").split(",") if p.strip()}


def _create(c: httpx.Client, **body) -> httpx.Response:
    r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120, **body})
    assert r.status_code == 201, r.text
    return r


def _envd(srv, sid: str, token: str | None) -> httpx.Response:
    """``GET /envs`` of sandbox ``sid``'s envd through the proxy."""
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}
    if token is not None:
        headers["X-Access-Token"] = token
    return httpx.get(f"{srv.url}/envs", headers=headers, timeout=30)


def test_pooled_create_applies_the_request_and_is_not_listed(pool_server):
    srv = pool_server
    _wait_pool(srv, 2)
    pooled = set(_node(srv)["poolSandboxes"])
    assert len(pooled) == 2
    with srv.api() as c:
        assert not pooled & {s["sandboxID"] for s in c.get("/v2/sandboxes").json()}  # never listed
        assert _node(srv)["sandboxes"]["running"] == 0  # nor counted
        prom = httpx.get(f"{srv.url}/metrics", timeout=30).text  # the pool is visible in Prometheus
        assert 'forkyard_pool_target{template="base"} 2.0' in prom
        assert 'forkyard_pool_sandboxes{state="ready",template="base"} 2.0' in prom, prom
        r = _create(c, envVars={"POOL_VAR": "v1"}, metadata={"who": "pool-test"}, timeout=90)
        assert "pool" in _phases(r) and "runtime" not in _phases(r), r.headers
        info = r.json()
        sid, token = info["sandboxID"], info["envdAccessToken"]
        assert token
        got = c.get(f"/sandboxes/{sid}").json()
        assert got["metadata"] == {"who": "pool-test"}
        span = (time.mktime(time.strptime(got["endAt"][:19], "%Y-%m-%dT%H:%M:%S"))
                - time.mktime(time.strptime(got["startedAt"][:19], "%Y-%m-%dT%H:%M:%S")))
        assert abs(span - 90) <= 1, got
        assert [s["sandboxID"] for s in c.get("/v2/sandboxes").json()] == [sid]
        assert _node(srv)["sandboxes"]["running"] == 1
        assert sid not in _node(srv)["poolSandboxes"]
    try:
        assert _envd(srv, sid, "wrong-token").status_code == 401
        assert _envd(srv, sid, None).status_code == 401
        ok = _envd(srv, sid, token)
        assert ok.status_code == 200 and ok.json().get("POOL_VAR") == "v1", ok.text
        sbx = Sandbox.connect(sid)
        out = sbx.commands.run('echo "$POOL_VAR $(whoami)"').stdout.strip()
        assert out == "v1 user"
    finally:
        with srv.api() as c:
            c.delete(f"/sandboxes/{sid}")


def test_pooled_sandbox_expires_at_its_timeout(pool_server):
    srv = pool_server
    _wait_pool(srv, 2)
    with srv.api() as c:
        r = _create(c, timeout=2, autoPause=False)
        assert "pool" in _phases(r)
        sid = r.json()["sandboxID"]
        deadline = time.time() + 15
        while c.get(f"/sandboxes/{sid}").status_code != 404 and time.time() < deadline:
            time.sleep(0.2)
        assert c.get(f"/sandboxes/{sid}").status_code == 404


def test_creates_in_a_row_get_distinct_isolated_sandboxes_and_the_pool_refills(pool_server):
    srv = pool_server
    before = _wait_pool(srv, 2)
    a = Sandbox.create("base", timeout=120)
    b = Sandbox.create("base", timeout=120)
    try:
        assert a.sandbox_id != b.sandbox_id
        assert _pool(srv)["hits"] == before["hits"] + 2  # both from the pool
        a.files.write("/home/user/only-in-a", "a")
        h = a.commands.run("sleep 600", background=True)
        assert not b.files.exists("/home/user/only-in-a")
        assert h.pid not in [p.pid for p in b.commands.list()]
        # Two user sandboxes fill the node (FORKYARD_MAX_SANDBOXES=2): the pool may not refill.
        time.sleep(2.5)
        assert _pool(srv)["ready"] + _pool(srv)["starting"] == 0
    finally:
        a.kill()
        b.kill()
    _wait_pool(srv, 2)  # room again: refilled
    ids = set(_node(srv)["poolSandboxes"])
    assert a.sandbox_id not in ids and b.sandbox_id not in ids  # never reused
    assert srv.leftovers() == CLEAN


def test_egress_policy_is_applied_at_hand_out(pool_server):
    srv = pool_server
    _wait_pool(srv, 2)
    with srv.api() as c:
        r = _create(c, allow_internet_access=False)
        assert "pool" in _phases(r)
        sid = r.json()["sandboxID"]
        try:
            config = json.loads((srv.data_dir / "sandboxes" / sid / "bundle" / "config.json").read_text())
            (netns,) = [n["path"] for n in config["linux"]["namespaces"] if n["type"] == "network"]
            middle = netns.rsplit("/", 1)[1].rstrip("s")
            assert middle.startswith(NET_PREFIX)
            rules = subprocess.run(["ip", "netns", "exec", middle, "iptables", "-S", "FORWARD"],
                                   capture_output=True, text=True, check=True).stdout
            assert any(l.startswith("-A FORWARD") and l.endswith("-j DROP") for l in rules.splitlines()), rules
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_a_request_the_pool_cannot_honour_starts_cold_and_the_pool_yields(pool_server):
    """A create from a snapshot is never served from the pool; on a full node (user +
    pooled = FORKYARD_MAX_SANDBOXES) the pool gives way to it, and user sandboxes
    alone are refused beyond the limit."""
    srv = pool_server
    _wait_pool(srv, 2)
    with srv.api() as c:
        src = _create(c).json()["sandboxID"]
        Sandbox.connect(src).files.write("/home/user/from-snapshot", "yes")
        r = c.post(f"/sandboxes/{src}/snapshots", json={})
        assert r.status_code == 201, r.text
        snap = r.json()["snapshotID"]
        c.delete(f"/sandboxes/{src}")
        try:
            _wait_pool(srv, 2)  # the node is full of pooled sandboxes again
            r = _create(c, templateID=snap)
            assert "runtime" in _phases(r) and "pool" not in _phases(r), r.headers
            child = r.json()["sandboxID"]
            assert Sandbox.connect(child).files.read("/home/user/from-snapshot") == "yes"
            p = _pool(srv)
            assert p["ready"] + p["starting"] <= 1, p  # yielded to the cold sandbox
            second = _create(c).json()["sandboxID"]  # from what the pool still had (or cold)
            r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            assert r.status_code == 503, r.text  # 2 user sandboxes: the node is full
            assert _pool(srv)["ready"] + _pool(srv)["starting"] == 0
            for sid in (child, second):
                c.delete(f"/sandboxes/{sid}")
        finally:
            c.delete(f"/templates/{snap}")


def test_a_rebuilt_template_makes_pooled_sandboxes_stale(pool_server):
    """Pooled sandboxes of an older build of the template (its completion marker
    changed) are dropped, never handed out; the create starts cold from the new build."""
    srv = pool_server
    _wait_pool(srv, 2)
    old = set(_node(srv)["poolSandboxes"])
    marker = srv.templates_dir / "base" / ".complete"
    st = marker.stat()
    os.utime(marker, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # what a rebuild's new marker does
    with srv.api() as c:
        r = _create(c)
        assert "runtime" in _phases(r) and "pool" not in _phases(r), r.headers
        assert r.json()["sandboxID"] not in old
        c.delete(f"/sandboxes/{r.json()['sandboxID']}")
        _wait_pool(srv, 2)
        assert not old & set(_node(srv)["poolSandboxes"])
        r = _create(c)
        assert "pool" in _phases(r)
        c.delete(f"/sandboxes/{r.json()['sandboxID']}")


def test_a_malformed_pool_setting_stops_the_server_with_a_clear_error(tmp_path):
    env = {**os.environ, "FORKYARD_POOL": "base:lots", "FORKYARD_DATA_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "FORKYARD_POOL" in r.stdout + r.stderr and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr


def test_restart_and_crash_leave_no_pooled_sandbox_behind(pool_server):
    srv = pool_server
    _wait_pool(srv, 2)
    srv.stop()  # SIGTERM: the pool is destroyed
    assert host_leftovers() == CLEAN
    srv.start()
    _wait_pool(srv, 2)
    old = set(_node(srv)["poolSandboxes"])
    assert len(old) == 2
    srv.stop(sig_kill=True)  # a crash: the pooled sandboxes are left running …
    assert len(host_leftovers()["runsc"]) > 0
    srv.start()  # … and the next start removes them (they have no row): nothing adopted
    with srv.api() as c:
        assert c.get("/v2/sandboxes").json() == []
    _wait_pool(srv, 2)
    assert not old & set(_node(srv)["poolSandboxes"])
    assert srv.leftovers() == CLEAN
