"""Server restart: running sandboxes are re-adopted; unknown leftovers are removed."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess

from e2b import Sandbox

from conftest import CLEAN, host_leftovers
from forkyard.config import Settings


def test_restart_readopts_running_sandbox(server):
    sbx = Sandbox.create("base", timeout=300)
    try:
        h = sbx.commands.run("sleep 1000", background=True)
        sbx.files.write("/home/user/keep", "kept")
        server.stop()
        server.start()
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.files.read("/home/user/keep") == "kept"
        assert h.pid in [p.pid for p in same.commands.list()]
        assert same.commands.run("echo alive").stdout.strip() == "alive"
    finally:
        sbx.kill()


def test_restart_after_sigkill_cleans_unknown_sandbox(server):
    sbx = Sandbox.create("base", timeout=300)
    server.stop(sig_kill=True)
    # Forget the sandbox, as if the crash happened before its row was committed.
    db = sqlite3.connect(server.data_dir / "state.db")
    db.execute("DELETE FROM sandboxes WHERE id = ?", (sbx.sandbox_id,))
    db.commit()
    db.close()
    assert host_leftovers()["runsc"], "the sandbox should still run while the server is down"
    server.start()
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    assert server.leftovers() == CLEAN


def test_pause_image_of_another_runtime_build_is_refused_with_409(server, tmp_path):
    """A pause image records the runsc build that wrote it. After the node's runtime
    changes build, resuming it answers 409 naming both builds and the sandbox stays
    paused; back on the original build it resumes with its files."""
    real = os.path.realpath(shutil.which(Settings().runsc))
    real_build = subprocess.run([real, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    other = tmp_path / "runsc"
    other.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo 'runsc version 0.0~test-other-build'; exit 0; }}\n"
                     f"exec {real} \"$@\"\n")
    other.chmod(0o755)
    sbx = Sandbox.create("base", timeout=300)
    sbx.files.write("/home/user/keep", "kept")
    sbx.pause()
    server.settle()
    with server.restarted_with(FORKYARD_RUNSC=str(other)), server.api() as c:
        r = c.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 60})
        assert r.status_code == 409, r.text
        assert "0.0~test-other-build" in r.json()["message"] and real_build in r.json()["message"]
        assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
    same = Sandbox.connect(sbx.sandbox_id)
    assert same.files.read("/home/user/keep") == "kept"
    same.kill()


def _kill_ms(server, sandbox_id: str) -> float:
    import time

    with server.api() as c:
        t = time.perf_counter()
        assert c.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        return (time.perf_counter() - t) * 1000


def test_readopted_sandbox_dies_as_fast_as_a_fresh_one(server):
    """Issue 10: sandboxes are started under the node's reaper daemon, which outlives
    server restarts, so a sandbox re-adopted after a restart is reaped at once when
    killed (it was reaped by PID 1 about once a second: ~1.5-2 s per kill)."""
    old = [Sandbox.create("base", timeout=300) for _ in range(2)]
    server.stop()
    server.start()
    fresh = [Sandbox.create("base", timeout=300) for _ in range(2)]
    readopted_ms = [_kill_ms(server, s.sandbox_id) for s in old]
    fresh_ms = [_kill_ms(server, s.sandbox_id) for s in fresh]
    print(f"kill: re-adopted {readopted_ms} ms, fresh {fresh_ms} ms")
    assert max(readopted_ms) < 2 * max(fresh_ms) + 300, (readopted_ms, fresh_ms)
    assert server.leftovers() == CLEAN
