"""REST API behaviour: E2B SDK calls, auth, bad input, TTL, concurrency."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from e2b import Sandbox, SandboxQuery


def test_list_info_timeout_kill(server):
    sbx = Sandbox.create("base", metadata={"suite": "api", "k": "v w"}, timeout=60)
    try:
        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": "api", "k": "v w"}
        before = info.end_at
        sbx.set_timeout(600)
        assert sbx.get_info().end_at > before
        listed = Sandbox.list(query=SandboxQuery(metadata={"k": "v w"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert Sandbox.list(query=SandboxQuery(metadata={"k": "other"})).next_items() == []
        assert sbx.is_running()
    finally:
        sbx.kill()
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]
    with server.api() as c:
        assert c.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404


def test_pagination(server):
    sbxs = [Sandbox.create("base", metadata={"page": "1"}, timeout=60) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"page": "1"}), limit=2)
        seen = pager.next_items()
        assert len(seen) == 2 and pager.has_next
        seen += pager.next_items()
        assert not pager.has_next
        assert sorted(s.sandbox_id for s in seen) == sorted(s.sandbox_id for s in sbxs)
    finally:
        for s in sbxs:
            s.kill()


def test_auth_required(server):
    r = httpx.get(f"{server.url}/v2/sandboxes")
    assert r.status_code == 401 and "message" in r.json()
    r = httpx.get(f"{server.url}/v2/sandboxes", headers={"X-API-Key": "e2b_wrong"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "body,status",
    [
        ({"templateID": "no-such-template"}, 404),
        ({"templateID": "../../etc"}, 404),
        ({"templateID": "base", "timeout": -1}, 400),
        ({"templateID": "base", "timeout": 10**9}, 400),
        ({"templateID": "base", "metadata": {"a": 1}}, 400),
        ({}, 400),
    ],
)
def test_bad_create(server, body, status):
    with server.api() as c:
        r = c.post("/sandboxes", json=body)
    assert r.status_code == status, r.text
    assert r.json()["message"]


def test_malformed_json_and_unknown_ids(server):
    with server.api() as c:
        r = c.post("/sandboxes", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        for method, path in [("GET", "/sandboxes/nope"), ("DELETE", "/sandboxes/nope"),
                             ("POST", "/sandboxes/nope/timeout")]:
            r = c.request(method, path, json={"timeout": 10})
            assert r.status_code == 404, (method, path, r.text)
            assert "not found" in r.json()["message"]
        assert c.get("/v2/sandboxes", params={"state": "bogus"}).status_code == 400
        assert c.get("/v2/sandboxes", params={"nextToken": "%%%"}).status_code == 400


def test_proxy_unknown_sandbox(server):
    r = httpx.get(f"{server.url}/health", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "49983"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]  # E2B's proxy answer
    r = httpx.get(f"{server.url}/health", headers={"E2b-Sandbox-Id": "nope", "E2b-Sandbox-Port": "x"})
    assert r.status_code == 400


def test_proxy_other_port_and_host_routing(sandbox, server):
    sandbox.commands.run("cd /tmp && echo served > index.html && python3 -m http.server 8000 >/dev/null 2>&1",
                         background=True)
    deadline = time.time() + 20
    while True:
        r = httpx.get(f"{server.url}/index.html",
                      headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"})
        if r.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200 and r.text.strip() == "served"
    r = httpx.get(f"http://127.0.0.1:{server.port}/index.html",
                  headers={"Host": f"8000-{sandbox.sandbox_id}.localhost"})
    assert r.text.strip() == "served"
    # A port nobody listens on: clear 502, not a hang.
    r = httpx.get(f"{server.url}/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "9"},
                  timeout=20)
    assert r.status_code == 502


def test_secure_sandbox_token(server):
    sbx = Sandbox.create("base", secure=True, timeout=60)
    try:
        assert sbx.commands.run("echo ok").stdout.strip() == "ok"
        r = httpx.get(f"{server.url}/envs", headers={"E2b-Sandbox-Id": sbx.sandbox_id})
        assert r.status_code == 401
    finally:
        sbx.kill()


def test_ttl_expiry_kills(server):
    sbx = Sandbox.create("base", timeout=2, lifecycle={"on_timeout": "kill"})
    deadline = time.time() + 20
    while time.time() < deadline and sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]:
        time.sleep(0.5)
    assert sbx.sandbox_id not in [s.sandbox_id for s in Sandbox.list().next_items()]


def test_ten_concurrent_sandboxes(server):
    def one(i: int) -> str:
        sbx = Sandbox.create("base", timeout=120)
        try:
            sbx.files.write("/home/user/n", str(i))
            out = sbx.commands.run("echo $(cat /home/user/n); python3 -c 'import os; print(os.getpid())'").stdout
            return out.split()[0]
        finally:
            sbx.kill()

    with ThreadPoolExecutor(10) as ex:
        results = list(ex.map(one, range(10)))
    assert results == [str(i) for i in range(10)]


def test_metrics(sandbox):
    m = sandbox.get_metrics()
    assert m and m[-1].mem_total > 0


def test_spare_network_slots_are_used_and_refilled(server):
    """The server keeps network slots built ahead; a create takes one and the pool refills."""
    def spares() -> list[int]:
        with server.api() as c:
            r = c.get("/metrics/node")
        assert r.status_code == 200, r.text
        return r.json()["spareSlots"]

    deadline = time.time() + 30
    while len(before := spares()) < 16 and time.time() < deadline:
        time.sleep(0.2)
    assert len(before) == 16, before
    sbx = Sandbox.create("base", timeout=60)
    try:
        assert before[0] not in spares()  # the sandbox runs in the first spare slot
        deadline = time.time() + 30
        while len(after := spares()) < 16 and time.time() < deadline:
            time.sleep(0.2)
        assert len(after) == 16 and before[0] not in after
    finally:
        sbx.kill()
