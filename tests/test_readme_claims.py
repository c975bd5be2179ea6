"""README claims and documented settings, each checked against a real server.

One server of this module runs with every setting changed from its default
(``FORKYARD_HOST``, ``FORKYARD_RUNSC``, ``FORKYARD_ENVD``, ``FORKYARD_SPARE_SLOTS``,
``FORKYARD_SPARE_DISKS``, ``FORKYARD_ENVD_REARM``, ``FORKYARD_CACHE_BYTES``,
``FORKYARD_PAUSED_RETENTION_S``, ``FORKYARD_FORK_PARALLELISM``,
``FORKYARD_HOT_PAUSE_MAX``, no ``FORKYARD_API_KEY``), so each test shows the setting took
effect, not only that the server started.

The claims tested elsewhere, claim by claim: the table in docs/testing.md ("Every README
claim, and the test that checks it"); a README claim with no row there is untested.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from forkyard.config import Settings
from conftest import TEST_ROOT, ServerProc

from forkyard.network.slots import NetnsNetwork

from _slot import LETTER, SLOT  # noqa: E402 — this session's slot (tests/_slot.py)

PREFIX = "fc" + LETTER
OUTER_NET = f"10.214.{SLOT * 16}.0/20"
HOST = "127.0.0.2"
RETENTION_S = 6
SPARES = 2
SPARE_DISKS = 1
CACHE_BYTES = 123_456_789
DATA = TEST_ROOT / f"server-{PREFIX}-claims"
ENVD = Path(__file__).resolve().parent.parent / "envd" / "bin" / "envd"


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


class ClaimsServer(ServerProc):
    """The server with every documented setting changed from its default."""

    def __init__(self):
        super().__init__(DATA, TEST_ROOT / "templates")
        self.url = f"http://{HOST}:{self.port}"
        self.wrapper_log = DATA.parent / f"{DATA.name}-runsc-calls"
        self.envd_copy = DATA.parent / f"{DATA.name}-envd"

    def env(self) -> dict[str, str]:
        env = super().env()
        env.pop("FORKYARD_API_KEY")  # the server generates its key file
        env.pop("FORKYARD_API_KEY_FILE", None)
        env.update(FORKYARD_NET_PREFIX=PREFIX, FORKYARD_OUTER_NET=OUTER_NET, FORKYARD_HOST=HOST,
                   FORKYARD_RUNSC=str(DATA.parent / f"{DATA.name}-runsc"), FORKYARD_ENVD=str(self.envd_copy),
                   FORKYARD_SPARE_SLOTS=str(SPARES), FORKYARD_CACHE_BYTES=str(CACHE_BYTES),
                   FORKYARD_PAUSED_RETENTION_S=str(RETENTION_S), FORKYARD_FORK_PARALLELISM="1",
                   FORKYARD_HOT_PAUSE_MAX="0", FORKYARD_SPARE_DISKS=str(SPARE_DISKS), FORKYARD_ENVD_REARM="1")
        return env


@pytest.fixture(scope="module")
def claims(base_template):
    shutil.rmtree(DATA, ignore_errors=True)
    DATA.mkdir(parents=True)
    srv = ClaimsServer()
    real = os.path.realpath(shutil.which(Settings().runsc))  # the build forkyard runs by default
    wrapper = Path(srv.env()["FORKYARD_RUNSC"])
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {srv.wrapper_log}\nexec {real} "$@"\n')
    wrapper.chmod(0o700)
    shutil.copy2(ENVD, srv.envd_copy)
    srv.start()
    key_file = DATA / "api_key"
    srv.api_key = key_file.read_text().strip()
    yield srv
    try:
        if srv.proc and srv.proc.poll() is None:
            srv.kill_all()
    finally:
        srv.stop()
        NetnsNetwork(None, outer_net=OUTER_NET, prefix=PREFIX).teardown_host()
        shutil.rmtree(DATA, ignore_errors=True)
        for p in (wrapper, srv.wrapper_log, srv.envd_copy):
            p.unlink(missing_ok=True)


def _create(c: httpx.Client, **body) -> str:
    r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120, **body})
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def test_generated_api_key_file_is_0600_and_works(claims):
    key_file = DATA / "api_key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert claims.api_key
    with claims.api() as c:
        assert c.get("/v2/sandboxes").status_code == 200
    assert httpx.get(f"{claims.url}/v2/sandboxes", headers={"X-API-Key": "e2b_wrong"}).status_code == 401


def test_host_runsc_envd_spare_slots_and_cache_settings_take_effect(claims):
    with pytest.raises(httpx.ConnectError):  # FORKYARD_HOST: bound to 127.0.0.2 only
        httpx.get(f"http://127.0.0.1:{claims.port}/health", timeout=2)
    with claims.api() as c:
        sid = _create(c)
        calls = claims.wrapper_log.read_text()  # FORKYARD_RUNSC: every runsc call went through it
        assert sid in calls and ("run" in calls.split() or "restore" in calls.split())
        config = (DATA / "sandboxes" / sid / "bundle" / "config.json").read_text()
        assert str(claims.envd_copy) in config  # FORKYARD_ENVD: the binary mounted into the sandbox
        deadline = time.time() + 30
        while len(c.get("/metrics/node").json()["spareSlots"]) != SPARES and time.time() < deadline:
            time.sleep(0.2)
        assert len(c.get("/metrics/node").json()["spareSlots"]) == SPARES  # FORKYARD_SPARE_SLOTS
        while len(c.get("/metrics/node").json()["spareDisks"]) != SPARE_DISKS and time.time() < deadline:
            time.sleep(0.2)
        assert len(c.get("/metrics/node").json()["spareDisks"]) == SPARE_DISKS  # FORKYARD_SPARE_DISKS
        repo = c.get("/metrics/repository").json()
        assert repo["cache"]["limit_bytes"] == CACHE_BYTES  # FORKYARD_CACHE_BYTES
        assert repo["backend"] == "posix_fs"
        assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_node_counts_refreshes_and_fork_defaults(claims):
    with claims.api() as c:
        before = c.get("/metrics/node").json()["sandboxes"]
        sid = _create(c)
        assert c.get("/metrics/node").json()["sandboxes"]["running"] == before["running"] + 1
        # /refreshes extends to at least now + duration and never shortens.
        end0 = _ts(c.get(f"/sandboxes/{sid}").json()["endAt"])
        assert c.post(f"/sandboxes/{sid}/refreshes", json={"duration": 600}).status_code == 204
        end1 = _ts(c.get(f"/sandboxes/{sid}").json()["endAt"])
        assert end1 > end0 and 590 < end1 - time.time() <= 600
        assert c.post(f"/sandboxes/{sid}/refreshes", json={"duration": 10}).status_code == 204
        assert _ts(c.get(f"/sandboxes/{sid}").json()["endAt"]) == pytest.approx(end1, abs=1)
        # Snapshot and fork answers carry their phases in Server-Timing.
        r = c.post(f"/sandboxes/{sid}/snapshots", json={})
        assert r.status_code == 201, r.text
        phases = {p.split(";")[0].strip() for p in r.headers["server-timing"].split(",")}
        assert {"checkpoint", "commit"} <= phases, phases
        assert c.delete(f"/templates/{r.json()['snapshotID']}").status_code in (200, 204)
        r = c.post(f"/sandboxes/{sid}/fork", json={})  # no timeout: children live 15 s
        assert r.status_code in (200, 201), r.text
        phases = {p.split(";")[0].strip() for p in r.headers["server-timing"].split(",")}
        assert {"checkpoint", "children"} <= phases, phases
        (kid,) = [x["sandbox"] for x in r.json()]
        # FORKYARD_ENVD_REARM=1: the restored child's envd got SIGUSR1 (off by default).
        assert f"kill {kid['sandboxID']} USR1" in claims.wrapper_log.read_text()
        info = c.get(f"/sandboxes/{kid['sandboxID']}").json()
        assert _ts(info["endAt"]) - _ts(info["startedAt"]) == pytest.approx(15, abs=1)
        assert c.get("/metrics/node").json()["sandboxes"]["running"] == before["running"] + 2
        assert c.delete(f"/sandboxes/{kid['sandboxID']}").status_code == 204  # else it pauses at 15 s
        assert c.delete(f"/sandboxes/{sid}").status_code == 204


def test_paused_sandbox_is_deleted_after_retention(claims):
    """``FORKYARD_PAUSED_RETENTION_S``: the paused sandbox and its image are deleted, and
    not before the retention period (so it is the retention sweep that deleted it).
    ``FORKYARD_HOT_PAUSE_MAX=0``: no frozen copy is kept (a plain checkpoint).

    Nothing here waits on a fixed time: the pause's commit may take longer than the
    retention period on a loaded host (a kill waits for the commit), so the state is
    read right after the pause reply and the deletion is timed from the request."""
    claims.settle()  # earlier tests' image GC is done: the manifests now are theirs
    manifests = DATA / "snapshots" / "repository" / "manifests"
    before = {p.name for p in manifests.glob("*.json")}
    with claims.api() as c:
        sid = _create(c)
        t_pause = time.time()  # paused_at is set after this, so no deletion before t_pause + RETENTION_S
        r = c.post(f"/sandboxes/{sid}/pause")
        assert r.status_code == 204
        assert "checkpoint;" in r.headers["server-timing"] and "freeze;" not in r.headers["server-timing"]
        info = c.get(f"/sandboxes/{sid}")
        if info.status_code == 200:  # else the host was so slow that retention already ran
            assert info.json()["state"] == "paused"
            assert c.get("/metrics/node").json()["hotPaused"] == 0  # FORKYARD_HOT_PAUSE_MAX=0
        deadline = t_pause + RETENTION_S + 60
        while (gone := c.get(f"/sandboxes/{sid}").status_code == 404) is False and time.time() < deadline:
            time.sleep(0.2)
        t_gone = time.time()
        assert gone, f"paused sandbox not deleted {t_gone - t_pause:.0f} s after its pause"
        assert t_gone >= t_pause + RETENTION_S  # FORKYARD_PAUSED_RETENTION_S, not something else
        claims.settle()
        left = [p.name for p in manifests.glob("*.json") if p.name not in before and sid in p.read_text()]
        assert not left, left  # its image is gone too (an image's manifest names its source)


def test_fork_parallelism_bounds_concurrent_child_restores(claims):
    """``FORKYARD_FORK_PARALLELISM=1``: a fork of 2 restores its children one at a time.

    The hold point ``fork.child-start`` is where a child, holding its place among the
    parallel restores, is about to restore. Child A is parked there; while it is, the
    point is armed again: a second restore allowed in parallel would reach it at once
    (both children are started together), with 1 it cannot until A is running."""
    phase = "fork.child-start"
    with claims.api() as c:
        sid = _create(c)
        h = claims.hold(phase)
        logged = len(claims.wrapper_log.read_text())

        def restores() -> list[str]:  # runsc restore calls since the fork began (FORKYARD_RUNSC wrapper)
            return [ln for ln in claims.wrapper_log.read_text()[logged:].splitlines() if "restore" in ln.split()]

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(c.post, f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 60})
            try:
                first = h.wait()
                arm = h.dir / f"{phase}.arm"
                arm.write_text("")  # armed again (the reached file stays A's)
                time.sleep(3)  # ample for B to get here if it could: both were started together
                assert arm.exists() and not restores(), "a second child started while the first held the only place"
                h.release()
                deadline = time.time() + 90
                while arm.exists() and time.time() < deadline:  # B gets the place once A is up
                    time.sleep(0.02)
                assert not arm.exists(), "the second child never started"
                assert [ln.split()[-1] for ln in restores()] == [first]  # B has not restored yet
                second = h.wait()
                assert second != first
                assert c.get(f"/sandboxes/{first}").json()["state"] == "running"  # A was done before B began
                h.release()
                r = fut.result(timeout=120)
            finally:
                claims.release_holds()
        assert r.status_code in (200, 201), r.text
        kids = [x["sandbox"]["sandboxID"] for x in r.json()]
        assert sorted(kids) == sorted([first, second])
        phases = {p.split(";")[0].strip() for p in r.headers["server-timing"].split(",")}
        assert "children" in phases
        for kid in kids:
            c.delete(f"/sandboxes/{kid}")
        assert c.delete(f"/sandboxes/{sid}").status_code == 204


def _anchors(md: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-``/``_`` dropped, spaces → ``-``."""
    out = set()
    for line in md.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_readme_and_docs_links_resolve():
    """Every relative link of README.md and docs/*.md (the cluster, deploy, runtime and
    security docs it points to) names a file that exists, and an anchor that one of its
    headings makes."""
    root = Path(__file__).resolve().parent.parent
    checked = 0
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.name}: link to missing {target}"
            if anchor:
                assert anchor in _anchors(dest.read_text()), f"{doc.name}: no heading for #{anchor} in {dest.name}"
            checked += 1
    assert checked >= 15
