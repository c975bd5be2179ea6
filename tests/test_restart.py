"""Server restart: running sandboxes are re-adopted; unknown leftovers are removed."""

from __future__ import annotations

import sqlite3

from e2b import Sandbox

from conftest import CLEAN, host_leftovers


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
