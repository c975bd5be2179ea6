"""Issue 25, item 1: routing and auth are decided on exactly the path that is forwarded.

The gateway decided on the decoded path and forwarded the raw one, which httpx then
cleaned of dot segments: ``GET /template-files/../v2/sandboxes`` without a key listed
every sandbox (the check saw a key-less upload route), ``/template-files/../sandboxes/ID``
handed out the envd token, ``…/../cluster/…`` reached node-internal routes with the
cluster secret attached. Each attack goes out on a raw socket, so no client library
cleans the path first; through the gateway and straight to a node.
"""

from __future__ import annotations

import json
import os

import pytest

from _wire import request as _request
from conftest import TEST_ROOT


def _key_less_attacks(sid: str) -> list[tuple[str, str]]:
    """(method, target) pairs that must not get past an unauthenticated check."""
    create = "/template-files/../sandboxes"
    return [
        ("GET", "/template-files/../v2/sandboxes"),
        ("GET", "/template-files/../sandboxes"),
        ("GET", f"/template-files/../sandboxes/{sid}"),
        ("GET", f"/template-files/%2e%2e/sandboxes/{sid}"),
        ("GET", f"/template-files/.%2E/sandboxes/{sid}"),
        ("GET", f"/template-files/..%2fsandboxes%2f{sid}"),
        ("GET", f"/template-files/..%5csandboxes%5c{sid}"),
        ("GET", f"/template-files\\..\\sandboxes\\{sid}"),
        ("GET", f"/template-files/x/../../sandboxes/{sid}"),
        ("GET", f"/template-files/%252e%252e/sandboxes/{sid}"),
        ("GET", f"//template-files/../sandboxes/{sid}"),
        ("GET", f"/template-files/./../sandboxes/{sid}"),
        ("POST", create),
        ("POST", "/template-files/../cluster/adopt"),
        ("DELETE", "/template-files/../cluster/images/x"),
        ("GET", "/health/../v2/sandboxes"),
        ("GET", "/template-files/../metrics/node"),
    ]


def _assert_refused(url: str, method: str, target: str, headers: dict, secrets: list[str]) -> None:
    body = json.dumps({"templateID": "base", "timeout": 30}).encode() if method == "POST" else b""
    status, data = _request(url, method, target, {"Content-Type": "application/json", **headers}, body)
    for s in secrets:
        assert s.encode() not in data, (url, method, target, status, data[:400])
    assert status == 400, (url, method, target, status, data[:400])
    assert b'"code":400' in data.replace(b" ", b""), data[:400]


@pytest.fixture(scope="module")
def cluster(base_template):
    from _cluster import Cluster

    c = Cluster(TEST_ROOT / f"cluster-paths-{os.getpid()}", nodes=1)
    try:
        c.start()
        yield c
    finally:
        c.close()


def test_gateway_refuses_dot_segments_and_encoded_variants(cluster):
    with cluster.api() as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        before = {s["sandboxID"] for s in api.get("/sandboxes").json()}
        try:
            for method, target in _key_less_attacks(sid):
                _assert_refused(cluster.gateway_url, method, target, {}, [sid, token])
            # With the key: nothing reaches the node-internal routes either.
            key = {"X-API-Key": cluster.api_key}
            for method, target in [("POST", "/x/../cluster/adopt"), ("DELETE", "/x/../cluster/images/x"),
                                   ("POST", f"/sandboxes/{sid}/../../cluster/sandboxes/{sid}/fork"),
                                   ("DELETE", "/%63luster/images/x/.."), ("POST", "/x/%2e%2e/cluster/adopt")]:
                _assert_refused(cluster.gateway_url, method, target, key, [token])
            # Nothing was created by the POSTs above, and the sandbox still works.
            assert {s["sandboxID"] for s in api.get("/sandboxes").json()} == before
            assert api.get(f"/sandboxes/{sid}").status_code == 200
            # The routes themselves still work when spelled plainly (key-less upload
            # route: its own signature check answers, not the path rule).
            status, _ = _request(cluster.gateway_url, "PUT", "/template-files/" + "0" * 64 + "?token=x", body=b"x")
            assert status == 403, status
            status, data = _request(cluster.gateway_url, "GET", "/v2/sandboxes", {})
            assert status == 401, data[:300]
        finally:
            api.delete(f"/sandboxes/{sid}")


def test_node_refuses_dot_segments_and_encoded_variants(cluster):
    """The node's own API (reached without the gateway, e.g. single-node or behind a
    proxy that forwards raw targets) applies the same rule."""
    node = cluster.node_urls[0]
    with cluster.api() as api:
        r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
        try:
            for method, target in _key_less_attacks(sid):
                _assert_refused(node, method, target, {}, [sid, token])
            key = {"X-API-Key": cluster.api_key}
            for method, target in [("GET", f"/sandboxes/x/../{sid}"), ("GET", "/v2/./sandboxes"),
                                   ("GET", f"/sandboxes//{sid}"), ("GET", f"/sandboxes/{sid}%2f..")]:
                _assert_refused(node, method, target, key, [token])
            status, _ = _request(node, "GET", f"/sandboxes/{sid}", key)
            assert status == 200
        finally:
            api.delete(f"/sandboxes/{sid}")


def test_scheduler_refuses_dot_segments_and_encoded_variants(cluster):
    """The scheduler's internal API applies the same rule (it forwards nothing, but one
    rule on every hop leaves no pair of hops that could disagree): with the cluster secret
    too, and before its ``/health`` exemption."""
    sched = cluster.scheduler_url
    secret = {"x-forkyard-cluster-secret": cluster.secret}
    for method, target in [("GET", "/health/../v1/nodes"), ("GET", "/v1/x/../nodes"), ("GET", "/v1/%2e%2e/v1/nodes"),
                           ("POST", "/v1/nodes/node0/../node0/drain"), ("GET", "//v1/nodes")]:
        _assert_refused(sched, method, target, {}, [cluster.secret])
        _assert_refused(sched, method, target, secret, [cluster.secret])
    status, _ = _request(sched, "GET", "/v1/nodes", secret)
    assert status == 200, status
    status, _ = _request(sched, "GET", "/health", {})
    assert status == 200, status
