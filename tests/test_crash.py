"""kill -9 of the server in the middle of pause, snapshot and fork, then restart:
the source is running or paused (never lost), only committed snapshots are listed and
each of them restores, and nothing is left behind once the source is killed."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import CLEAN, SERVER_DIR
from e2b import Sandbox
from test_lifecycle import state_of, value, with_counter

OPS = {
    "pause": ("/sandboxes/{id}/pause", None),
    "snapshot": ("/sandboxes/{id}/snapshots", {"name": "crash-snap"}),
    "fork": ("/sandboxes/{id}/fork", {"count": 4, "timeout": 60}),
}


@pytest.mark.parametrize("delay", [0.05, 0.25])
@pytest.mark.parametrize("op", list(OPS))
def test_kill9_mid_operation(server, op, delay):
    sbx = Sandbox.create("base", timeout=300)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=3) == 3
        # 100 MB of fresh state makes the checkpoint long enough to be interrupted.
        sbx.commands.run("head -c 100M /dev/urandom > /home/user/blob")
        path, body = OPS[op]

        def fire():
            try:
                with server.api() as c:
                    c.post(path.format(id=sbx.sandbox_id), json=body, timeout=60)
            except httpx.HTTPError:
                pass  # the server dies under it

        t = threading.Thread(target=fire)
        t.start()
        time.sleep(delay)
        server.stop(sig_kill=True)
        t.join(60)
        server.start()

        st = state_of(server, sbx.sandbox_id)
        assert st in ("running", "paused"), f"source lost after kill -9 during {op}: {st}"
        same = Sandbox.connect(sbx.sandbox_id)  # resumes when paused
        assert value(server, same) == 3  # its in-memory state survived either way
        assert same.commands.run("wc -c < /home/user/blob").stdout.strip() == str(100 << 20)
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
        for snap in Sandbox.list_snapshots().next_items():
            child = Sandbox.create(snap.snapshot_id, timeout=60)
            assert child.commands.run("echo ok").stdout.strip() == "ok"
            child.kill()
            Sandbox.delete_snapshot(snap.snapshot_id)
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        assert listed == [sbx.sandbox_id], listed  # no half-made fork children
    finally:
        server.kill_all()
    deadline = time.time() + 20  # an interrupted runsc checkpoint may still be exiting
    while server.leftovers() != CLEAN and time.time() < deadline:
        time.sleep(0.5)
    assert server.leftovers() == CLEAN


def test_kill9_after_pause_reply(server):
    """The pause reply goes out before the image is committed; a kill -9 right after the
    204 must still leave the sandbox paused (restart commits the staged image)."""
    sbx = Sandbox.create("base", timeout=300)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=5) == 5
        sbx.commands.run("head -c 100M /dev/urandom > /home/user/blob")
        with server.api() as c:
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause", timeout=60)
        server.stop(sig_kill=True)  # the background commit of ~100 MB is in flight
        assert r.status_code == 204, r.text
        assert "checkpoint;dur=" in r.headers.get("server-timing", "")
        server.start()
        assert state_of(server, sbx.sandbox_id) == "paused"
        same = Sandbox.connect(sbx.sandbox_id)
        assert value(server, same) == 5
        assert same.commands.run("wc -c < /home/user/blob").stdout.strip() == str(100 << 20)
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
    finally:
        server.kill_all()
    deadline = time.time() + 20
    while server.leftovers() != CLEAN and time.time() < deadline:
        time.sleep(0.5)
    assert server.leftovers() == CLEAN
