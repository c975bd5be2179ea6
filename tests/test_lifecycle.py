"""Pause/resume, snapshots, fork and TTL through the official e2b SDK (real sandboxes)."""

from __future__ import annotations

import sqlite3
import time
from datetime import datetime

import httpx
import pytest
from conftest import SERVER_DIR
from e2b import Sandbox

# A value held only in a running process's memory: GET /set/V stores V, any other
# GET returns it. Idempotent, so a retried request never changes the answer.
COUNTER = r'''
import http.server
n = 0
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global n
        if self.path.startswith("/set/"):
            n = int(self.path[5:])
        body = str(n).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("0.0.0.0", 8000), H).serve_forever()
'''


def value(server, sbx, set_to: int | None = None, wait_s: float = 60) -> int:
    """Read (or first set) the in-memory value of the process inside ``sbx``, retrying for
    up to ``wait_s`` s (a host running 100 fork children answers slowly).

    Raises:
        AssertionError: no 200 within ``wait_s`` s; says the last answer or error.
    """
    deadline = time.time() + wait_s
    path = "/" if set_to is None else f"/set/{set_to}"
    last = "no answer"
    while True:
        try:
            r = httpx.get(f"{server.url}{path}", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"},
                          timeout=5)
            if r.status_code == 200:
                return int(r.text)
            last = f"{r.status_code} {r.text}"
        except httpx.HTTPError as e:
            last = repr(e)
        if time.time() > deadline:
            raise AssertionError(f"counter in {sbx.sandbox_id} did not answer in {wait_s} s: {last}")
        time.sleep(0.1)


def with_counter(sbx) -> None:
    """Start the counter server in ``sbx``. ``timeout=0``: envd ends a command at its
    request's deadline (the SDK's default 60 s, as on E2B), also in fork children restored
    after it; a test that runs longer than that would find the counter killed."""
    sbx.files.write("/home/user/counter.py", COUNTER)
    sbx.commands.run("python3 /home/user/counter.py", background=True, timeout=0)


def state_of(server, sandbox_id: str) -> str | None:
    with server.api() as c:
        r = c.get(f"/sandboxes/{sandbox_id}")
    return r.json()["state"] if r.status_code == 200 else None


def test_pause_resume_keeps_process_memory_and_files(server):
    sbx = Sandbox.create("base", timeout=120)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=7) == 7
        sbx.files.write("/home/user/note", "before pause")
        assert sbx.pause() is True
        assert state_of(server, sbx.sandbox_id) == "paused"
        assert sbx.pause() is False  # already paused → 409 → False
        with server.api() as c:
            assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 409
        same = Sandbox.connect(sbx.sandbox_id)  # connect resumes a paused sandbox
        assert state_of(server, sbx.sandbox_id) == "running"
        assert value(server, same) == 7  # in-memory state continued
        assert value(server, same, set_to=8) == 8
        assert same.files.read("/home/user/note") == "before pause"
        assert same.commands.run("echo ok").stdout.strip() == "ok"
        with server.api() as c:
            assert c.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={}).status_code == 409
    finally:
        sbx.kill()


def test_resume_endpoint_and_paused_survives_restart(server):
    sbx = Sandbox.create("base", timeout=120)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=5) == 5
        sbx.pause()
        server.stop()
        server.start()
        assert state_of(server, sbx.sandbox_id) == "paused"
        listed = {s.sandbox_id: s.state for s in Sandbox.list().next_items()}
        assert listed[sbx.sandbox_id].value == "paused"
        with server.api() as c:
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/resume", json={"timeout": 60})
        assert r.status_code == 201, r.text
        assert value(server, sbx) == 5
    finally:
        sbx.kill()


def test_snapshot_then_create_from_it(server):
    sbx = Sandbox.create("base", timeout=120)
    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=11) == 11
        sbx.files.write("/home/user/snap.txt", "in snapshot")
        info = sbx.create_snapshot(name="my-snap")
        assert sbx.commands.run("echo still running").stdout.strip() == "still running"
        assert info.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        for ref in (info.snapshot_id, "my-snap"):
            child = Sandbox.create(ref, timeout=60)
            try:
                assert child.files.read("/home/user/snap.txt") == "in snapshot"
                assert value(server, child) == 11
            finally:
                child.kill()
        Sandbox.delete_snapshot(info.snapshot_id)
        with server.api() as c:
            assert c.post("/sandboxes", json={"templateID": info.snapshot_id}).status_code == 404
    finally:
        sbx.kill()


@pytest.mark.parametrize("n", [1, 4, 16])
def test_fork_children_inherit_then_diverge(server, n):
    src = Sandbox.create("base", timeout=300, envs={"ROLE": "parent"})
    children = []
    try:
        with_counter(src)
        assert value(server, src, set_to=42) == 42
        src.files.write("/home/user/shared.txt", "from parent")
        before = src.get_info().end_at
        results = src.fork(count=n, timeout=120)
        errors = [r for r in results if isinstance(r, Exception)]
        children = [r for r in results if not isinstance(r, Exception)]
        assert not errors, errors
        assert len(children) == n
        assert src.get_info().end_at == before  # source keeps its id and expiry
        assert len({c.sandbox_id for c in children} | {src.sandbox_id}) == n + 1
        for i, child in enumerate(children):
            assert value(server, child) == 42  # the parent's in-memory value
            assert child.files.read("/home/user/shared.txt") == "from parent"
            assert child.commands.run("echo $ROLE").stdout.strip() == "parent"
            child.files.write("/home/user/mine.txt", f"child {i}")
            assert value(server, child, set_to=100 + i) == 100 + i
            md = child.get_info().metadata
            assert md["forkyard.parentSandboxID"] == src.sandbox_id and md["forkyard.snapshotID"]
        for i, child in enumerate(children):
            assert child.files.read("/home/user/mine.txt") == f"child {i}"
            assert value(server, child) == 100 + i
        assert not src.files.exists("/home/user/mine.txt")
        assert value(server, src) == 42  # children's changes never reach the parent
    finally:
        for c in children:
            c.kill()
        src.kill()


def test_fork_bad_input(server):
    sbx = Sandbox.create("base", timeout=60)
    try:
        with server.api() as c:
            for body in ({"count": 0}, {"count": 101}, {"count": "x"}, {"timeout": -5}):
                r = c.post(f"/sandboxes/{sbx.sandbox_id}/fork", json=body)
                assert r.status_code == 400, (body, r.text)
            assert c.post("/sandboxes/nope/fork", json={}).status_code == 404
            assert c.post("/sandboxes/nope/pause").status_code == 404
            assert c.post("/sandboxes/nope/resume", json={}).status_code == 404
            assert c.post("/sandboxes/nope/snapshots", json={}).status_code == 404
            assert c.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={"name": "Bad Name!"}).status_code == 400
            assert c.delete("/templates/nope").status_code == 404
        assert sbx.commands.run("echo fine").stdout.strip() == "fine"  # source untouched
    finally:
        sbx.kill()
    with server.api() as c:
        assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 404


def test_ttl_auto_pause_and_auto_delete(server):
    paused = Sandbox.create("base", timeout=2)  # autoPause defaults to true here
    killed = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "kill"})
    try:
        deadline = time.time() + 30
        while time.time() < deadline and (state_of(server, paused.sandbox_id) != "paused"
                                          or state_of(server, killed.sandbox_id) is not None):
            time.sleep(0.3)
        assert state_of(server, paused.sandbox_id) == "paused"
        assert state_of(server, killed.sandbox_id) is None
        again = Sandbox.connect(paused.sandbox_id)
        assert again.commands.run("echo back").stdout.strip() == "back"
    finally:
        paused.kill()


def test_default_timeout_and_fork_children_do_what_their_source_does(server):
    """README: a create without ``timeout`` runs 300 s; fork children at their timeout do
    what their source does — paused with the default, killed when the source was
    created ``autoPause: false``."""
    def ts(iso: str) -> float:
        return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()

    made: list[str] = []
    with server.api() as c:
        try:
            r = c.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 201, r.text
            pausing = r.json()["sandboxID"]
            made.append(pausing)
            info = c.get(f"/sandboxes/{pausing}").json()
            assert ts(info["endAt"]) - ts(info["startedAt"]) == pytest.approx(300, abs=1)
            r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120, "autoPause": False})
            assert r.status_code == 201, r.text
            killing = r.json()["sandboxID"]
            made.append(killing)
            kids = {}
            for src in (pausing, killing):
                r = c.post(f"/sandboxes/{src}/fork", json={"count": 1, "timeout": 2})
                assert r.status_code in (200, 201), r.text
                kids[src] = r.json()[0]["sandbox"]["sandboxID"]
                made.append(kids[src])
            deadline = time.time() + 60
            while time.time() < deadline and (state_of(server, kids[pausing]) != "paused"
                                              or state_of(server, kids[killing]) is not None):
                time.sleep(0.3)
            assert state_of(server, kids[pausing]) == "paused"
            assert state_of(server, kids[killing]) is None
            assert state_of(server, pausing) == "running" and state_of(server, killing) == "running"
        finally:
            for sid in made:
                c.delete(f"/sandboxes/{sid}")


def sqlite_image_id(sandbox_id: str) -> str | None:
    """The image id the server's state row holds for ``sandbox_id`` (its pause image)."""
    db = sqlite3.connect(SERVER_DIR / "state.db")
    try:
        row = db.execute("SELECT image_id FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def test_resume_and_kill_right_after_pause_reply(server):
    """Pause answers before its image is committed; a resume or kill that arrives while
    the background commit has not even started (held there) waits for it instead of
    racing it, then succeeds."""
    from concurrent.futures import ThreadPoolExecutor

    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id

    def call(method: str, path: str, **kw) -> int:
        with server.api() as c:
            return c.request(method, path, **kw).status_code

    try:
        with_counter(sbx)
        assert value(server, sbx, set_to=11) == 11
        sbx.commands.run("head -c 20M /dev/urandom > /home/user/blob")
        hold = server.hold("pause.before-commit", sid)
        with server.api() as c:
            r = c.post(f"/sandboxes/{sid}/pause")
            assert r.status_code == 204, r.text
            assert "checkpoint;dur=" in r.headers["server-timing"]
        hold.wait()
        assert state_of(server, sid) == "paused"
        assert call("POST", f"/sandboxes/{sid}/pause") == 409
        with ThreadPoolExecutor(1) as pool:
            resumed = pool.submit(call, "POST", f"/sandboxes/{sid}/resume", json={"timeout": 300})
            time.sleep(1.0)
            assert not resumed.done(), "resume did not wait for the pause's commit"
            hold.release()
            assert resumed.result() == 201
        same = Sandbox.connect(sid)
        assert value(server, same) == 11
        assert same.commands.run("wc -c < /home/user/blob").stdout.strip() == str(20 << 20)

        hold = server.hold("pause.before-commit", sid)
        assert call("POST", f"/sandboxes/{sid}/pause") == 204
        hold.wait()
        pause_id = sqlite_image_id(sid)
        manifest = SERVER_DIR / "snapshots" / "repository" / "manifests" / f"{pause_id}.json"
        with ThreadPoolExecutor(1) as pool:
            killed = pool.submit(call, "DELETE", f"/sandboxes/{sid}")
            time.sleep(1.0)
            assert not killed.done(), "kill did not wait for the pause's commit"
            assert not manifest.exists()
            hold.release()
            assert killed.result() == 204
        assert state_of(server, sid) is None
        server.wait_clean(10)
        server.settle()
        assert not manifest.exists()  # committed, then removed with the killed sandbox
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
    finally:
        server.kill_all()


def test_concurrent_connects_and_connect_during_pause(server):
    """Connects wait for a pause/resume in progress: concurrent connects to a paused
    sandbox all succeed (one resumes it: 201, the others find it running: 200), and a
    connect racing a pause leaves the sandbox running and reachable."""
    from concurrent.futures import ThreadPoolExecutor

    sbx = Sandbox.create("base", timeout=300)
    try:
        sid = sbx.sandbox_id
        with server.api() as c:
            assert c.post(f"/sandboxes/{sid}/pause").status_code == 204

        def connect(_):
            with server.api() as c:
                return c.post(f"/sandboxes/{sid}/connect", json={"timeout": 300}).status_code

        with ThreadPoolExecutor(3) as pool:
            codes = sorted(pool.map(connect, range(3)))
        assert codes == [200, 200, 201], codes

        def pause(_):
            with server.api() as c:
                return c.post(f"/sandboxes/{sid}/pause").status_code

        # A connect arriving while the pause holds the sandbox (parked after "pausing" is
        # persisted, before the checkpoint) waits for it, then resumes the paused sandbox.
        hold = server.hold("pause.before-checkpoint", sid)
        with ThreadPoolExecutor(2) as pool:
            paused = pool.submit(pause, 0)
            hold.wait()
            connected = pool.submit(connect, 0)
            time.sleep(1.0)
            assert not connected.done(), "connect did not wait for the pause in progress"
            hold.release()
            assert paused.result() == 204
            assert connected.result() == 201  # it found the sandbox paused and resumed it
        assert state_of(server, sid) == "running"
        assert Sandbox.connect(sid).commands.run("echo up").stdout.strip() == "up"
    finally:
        server.kill_all()


def test_timeout_set_during_snapshot_is_kept_and_rejected_resume_changes_nothing(server):
    """A timeout change arriving while a snapshot is parked mid-way (hold point) waits
    for it and is not undone by the snapshot's write-back; a resume refused with 409
    leaves the sandbox's lifecycle as it was."""
    import threading

    sbx = Sandbox.create("base", timeout=300)
    try:
        sid = sbx.sandbox_id
        hold = server.hold("snapshot.staged", sid)  # parked mid-snapshot (state "snapshotting")
        codes = []

        def snapshot():
            with server.api() as c2:
                codes.append(c2.post(f"/sandboxes/{sid}/snapshots", json={}).status_code)

        with server.api() as c:
            snap = threading.Thread(target=snapshot)
            snap.start()
            hold.wait()
            from concurrent.futures import ThreadPoolExecutor

            def set_timeout():
                with server.api() as c3:
                    return c3.post(f"/sandboxes/{sid}/timeout", json={"timeout": 7000}).status_code

            with ThreadPoolExecutor(1) as pool:
                timed = pool.submit(set_timeout)  # arrives while the snapshot is in flight
                time.sleep(1.0)
                assert not timed.done(), "the timeout change did not wait for the snapshot"
                hold.release()
                snap.join(60)
                assert codes == [201], codes
                assert timed.result() == 204  # applied after the snapshot's write-back
            end = c.get(f"/sandboxes/{sid}").json()["endAt"]
            from datetime import datetime

            left = datetime.fromisoformat(end.replace("Z", "+00:00")).timestamp() - time.time()
            assert 6900 < left <= 7000, left
            r = c.post(f"/sandboxes/{sid}/resume", json={"autoPause": False})
            assert r.status_code == 409, r.text
            assert c.get(f"/sandboxes/{sid}").json()["lifecycle"]["onTimeout"] == "pause"
    finally:
        server.kill_all()
        for s in Sandbox.list_snapshots().next_items():
            Sandbox.delete_snapshot(s.snapshot_id)


def test_pause_that_cannot_stage_leaves_the_sandbox_running(server):
    """A local disk error before the checkpoint (here: an immutable snapshots directory)
    fails the pause with a 500 message and the sandbox stays running, not stuck."""
    import subprocess

    sbx = Sandbox.create("base", timeout=300)
    snaps = SERVER_DIR / "snapshots"
    try:
        subprocess.run(["chattr", "+i", str(snaps)], check=True)
        try:
            with server.api() as c:
                r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause")
                assert r.status_code == 500 and "pause of sandbox" in r.json()["message"], r.text
                assert c.get("/health").status_code == 200  # same keep-alive connection still works
        finally:
            subprocess.run(["chattr", "-i", str(snaps)], check=True)
        assert state_of(server, sbx.sandbox_id) == "running"
        assert sbx.commands.run("echo up").stdout.strip() == "up"
        assert sbx.pause() is True
        assert state_of(server, sbx.sandbox_id) == "paused"
    finally:
        server.kill_all()
