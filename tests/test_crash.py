"""kill -9 of the server at named phases of pause, snapshot and fork (test-only hold
points park the operation there, so the kill lands exactly in that phase), then restart:
the source is in the state that phase implies (never lost), interrupted snapshots and
fork children never appear, and nothing is left behind once the source is killed."""

from __future__ import annotations

import threading

import httpx
import pytest
from conftest import SERVER_DIR
from e2b import Sandbox
from test_lifecycle import state_of, value, with_counter

OPS = {
    "pause": ("/sandboxes/{id}/pause", None),
    "snapshot": ("/sandboxes/{id}/snapshots", {"name": "crash-snap"}),
    "fork": ("/sandboxes/{id}/fork", {"count": 4, "timeout": 60}),
}
#: (operation, hold point where the server is killed, state the source must be in after
#: the restart). Hold points: forkyard/orchestrator/holds.py.
CASES = [
    ("pause", "pause.before-checkpoint", "running"),  # persisted "pausing", nothing checkpointed
    ("pause", "pause.checkpointed", "paused"),  # stopped, image staged but not marked complete
    ("snapshot", "snapshot.staged", "running"),  # image staged, never committed: not listed
    ("fork", "fork.staged", "running"),  # no child exists yet
    ("fork", "fork.children-recorded", "running"),  # 4 children persisted "creating", none started
]


@pytest.mark.parametrize("op, phase, after", CASES, ids=[c[1] for c in CASES])
def test_kill9_mid_operation(server, op, phase, after):
    """The server is SIGKILLed while the operation is parked at ``phase`` (so the kill
    lands exactly there), then restarted: the source is in the expected state with its
    memory and files, only committed snapshots are listed, no half-made child remains."""
    sbx = Sandbox.create("base", timeout=300)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=3) == 3
        sbx.commands.run("head -c 20M /dev/urandom > /home/user/blob")
        path, body = OPS[op]
        hold = server.hold(phase, sbx.sandbox_id)

        def fire():
            try:
                with server.api() as c:
                    c.post(path.format(id=sbx.sandbox_id), json=body, timeout=120)
            except httpx.HTTPError:
                pass  # the server dies under it

        t = threading.Thread(target=fire)
        t.start()
        assert hold.wait() == sbx.sandbox_id
        server.stop(sig_kill=True)
        t.join(60)
        server.start()  # the hold files belong to the dead process; the new one does not wait

        assert state_of(server, sbx.sandbox_id) == after
        same = Sandbox.connect(sbx.sandbox_id)  # resumes when paused
        assert value(server, same) == 3  # its in-memory state survived either way
        assert same.commands.run("wc -c < /home/user/blob").stdout.strip() == str(20 << 20)
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
        # Only this sandbox's own (other tests may leave snapshots of theirs on the server).
        assert Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items() == []  # the interrupted one never appears
        listed = Sandbox.list().next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in listed]
        kids = [s.sandbox_id for s in listed if (s.metadata or {}).get("forkyard.parentSandboxID") == sbx.sandbox_id]
        assert kids == [], kids  # no half-made fork children
    finally:
        hold.disarm()
        server.kill_all()
    server.wait_clean(20)  # an interrupted runsc checkpoint may still be exiting


def test_kill9_after_pause_reply(server):
    """The pause reply goes out before the image is committed; a kill -9 after the 204
    and before the commit starts (held there) must still leave the sandbox paused: the
    restart commits the staged image."""
    sbx = Sandbox.create("base", timeout=300)
    hold = server.hold("pause.before-commit", sbx.sandbox_id)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=5) == 5
        sbx.commands.run("head -c 20M /dev/urandom > /home/user/blob")
        with server.api() as c:
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause", timeout=60)
        assert r.status_code == 204, r.text
        assert "checkpoint;dur=" in r.headers.get("server-timing", "")
        hold.wait()  # the background commit has not started
        server.stop(sig_kill=True)
        staged = [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
        assert len(staged) == 1, staged  # only the staged image holds the sandbox now
        server.start()
        assert state_of(server, sbx.sandbox_id) == "paused"
        same = Sandbox.connect(sbx.sandbox_id)
        assert value(server, same) == 5
        assert same.commands.run("wc -c < /home/user/blob").stdout.strip() == str(20 << 20)
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
    finally:
        hold.disarm()
        server.kill_all()
    server.wait_clean(20)
