"""Hot pause (forkyard.orchestrator.hot): a paused sandbox's frozen runtime is kept for a
grace period so resume is an unfreeze; its image is committed all the same, so a dropped
copy (grace over, restart) resumes from the image with nothing lost."""

from __future__ import annotations

import time

from e2b import Sandbox

from conftest import CLEAN


def _node(server) -> dict:
    with server.api() as c:
        return c.get("/metrics/node").json()


def _timing(r) -> str:
    return r.headers.get("server-timing", "")


def test_resume_of_a_kept_sandbox_unfreezes_it(server):
    sbx = Sandbox.create("base", timeout=300)
    try:
        h = sbx.commands.run("sleep 1000", background=True)
        sbx.files.write("/home/user/f", "v1")
        with server.api() as c:
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause")
            assert r.status_code == 204 and "freeze;" in _timing(r), r.headers
            server.settle()  # the image is committed meanwhile: the pause is durable
            assert c.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
            kept = _node(server)["hotPaused"]
            assert kept >= 1
            scraped = c.get("/metrics").text  # the Prometheus gauge says the same
            assert f"forkyard_hot_paused {float(kept)}" in scraped, [l for l in scraped.splitlines() if "hot" in l]
            assert not sbx.is_running()
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 300})
            assert r.status_code == 201, r.text
            assert "thaw;" in _timing(r) and "restore;" not in _timing(r), _timing(r)
        same = Sandbox.connect(sbx.sandbox_id)
        assert h.pid in [p.pid for p in same.commands.list()]
        assert same.files.read("/home/user/f") == "v1"
        assert same.commands.run("echo ok").stdout.strip() == "ok"
    finally:
        sbx.kill()


def test_kill_of_a_kept_sandbox_frees_everything(server):
    sbx = Sandbox.create("base", timeout=300)
    sbx.pause()
    server.settle()
    before = _node(server)["hotPaused"]
    assert before >= 1
    sbx.kill()
    assert _node(server)["hotPaused"] == before - 1
    assert server.leftovers() == CLEAN


def test_dropped_copy_resumes_from_the_image(server):
    """With a 1 s grace the frozen copy is dropped (runtime and slot freed, the sandbox
    stays paused); the next resume restores the committed image: process and files kept."""
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="1"):
        sbx = Sandbox.create("base", timeout=300)
        try:
            h = sbx.commands.run("sleep 1000", background=True)
            sbx.files.write("/home/user/f", "v2")
            sbx.pause()
            deadline = time.time() + 30
            while _node(server)["hotPaused"] and time.time() < deadline:
                time.sleep(0.2)
            assert _node(server)["hotPaused"] == 0
            assert server.leftovers() == CLEAN  # nothing of the paused sandbox runs any more
            with server.api() as c:
                r = c.post(f"/sandboxes/{sbx.sandbox_id}/connect", json={"timeout": 300})
                assert r.status_code == 201 and "restore;" in _timing(r), (r.status_code, _timing(r))
            same = Sandbox.connect(sbx.sandbox_id)
            assert h.pid in [p.pid for p in same.commands.list()]
            assert same.files.read("/home/user/f") == "v2"
        finally:
            sbx.kill()
