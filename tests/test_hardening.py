"""Regressions from trying to break the server: streams of killed sandboxes end, dead
sandboxes are noticed, names cannot shadow templates, bad maps are refused, the proxy
forwards only what the client sent, and every error has E2B's shape."""

from __future__ import annotations

import threading
import time

import httpx
from e2b import Sandbox


def test_stream_of_killed_sandbox_ends(server):
    sbx = Sandbox.create("base", timeout=120)
    h = sbx.commands.run("sleep 100", background=True)
    outcome: list[object] = []

    def wait():
        try:
            outcome.append(h.wait())
        except Exception as e:  # the expected path: the stream is cut
            outcome.append(e)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(1.0)
    sbx.kill()
    t.join(20)
    assert not t.is_alive(), "client stream still hangs after its sandbox was killed"
    assert outcome and isinstance(outcome[0], Exception)


def test_dead_sandbox_is_removed(server):
    sbx = Sandbox.create("base", timeout=120)
    try:
        sbx.commands.run("sudo kill -9 1", background=True)  # envd is init: the sandbox dies
    except Exception:
        pass
    deadline = time.time() + 30
    with server.api() as c:
        while time.time() < deadline and c.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 200:
            time.sleep(0.5)
        assert c.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
        assert c.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 404


def test_snapshot_name_cannot_shadow_template(server, sandbox):
    with server.api() as c:
        r = c.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={"name": "base"})
        assert r.status_code == 409 and "template" in r.json()["message"]
        assert c.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={"name": "ok\n"}).status_code == 400


def test_bad_maps_and_types_refused(server):
    with server.api() as c:
        for body in (
            {"templateID": "base", "envVars": {"A\u0000B": "x"}},
            {"templateID": "base", "envVars": {"A=B": "c"}},
            {"templateID": "base", "envVars": {"": "c"}},
            {"templateID": "base", "envVars": {"BIG": "x" * 200_000}},
            {"templateID": "base", "metadata": {f"k{i}": "v" for i in range(100)}},
            {"templateID": "base", "metadata": {"k": "v" * 20_000}},
        ):
            r = c.post("/sandboxes", json=body)
            assert r.status_code == 400, (list(body), r.text)
        assert c.post("/sandboxes/x/fork", json={"count": True}).status_code == 400
        assert c.post("/sandboxes/x/fork", json={"count": "5"}).status_code == 400
        import base64

        neg = base64.urlsafe_b64encode(b"-100").decode()
        assert c.get("/v2/sandboxes", params={"nextToken": neg}).status_code == 400
        # Starlette-level errors carry E2B's {code, message} too.
        r = c.put("/sandboxes")
        assert r.status_code == 405 and r.json()["code"] == 405 and r.json()["message"]
        r = c.get("/no/such/route")
        assert r.status_code == 404 and r.json()["message"]


def test_proxy_forwards_only_client_headers(server, sandbox):
    with server.api() as c:
        token = c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["envdAccessToken"]
    sandbox.files.write("/home/user/plain.txt", "plain text " * 100)
    r = httpx.get(f"{server.url}/files", params={"path": "/home/user/plain.txt"},
                  headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token,
                           "Accept-Encoding": "identity"})
    assert r.status_code == 200
    assert "content-encoding" not in r.headers
    assert r.content == b"plain text " * 100
    assert len(r.headers.get_list("date")) == 1


async def test_unexpected_error_is_a_json_500_and_the_connection_stays_usable(tmp_path):
    """A bug in a handler answers ``{code: 500, message}`` (not a dropped connection);
    the same client then gets normal answers. In-process app, nothing started."""
    from forkyard.config import Settings
    from forkyard.node import build_node

    app = build_node(Settings(data_dir=tmp_path)).app

    async def boom():
        raise ValueError("kaput")

    app.fastapi.add_api_route("/boom", boom)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                 headers={"X-API-Key": app.fastapi.state.api_key}) as c:
        r = await c.get("/boom")
        assert r.status_code == 500
        assert r.json() == {"code": 500, "message": "internal error: ValueError('kaput')"}
        assert (await c.get("/health")).status_code == 200
