"""Volume leases (:mod:`forkyard.cluster.volumes`) are a node's own call: only that
node's key takes or gives back a lease in its name; another node's key, the master
secret and a user's API key are refused, and no node releases a lease another holds.
A real redis-server and the scheduler's app (in process)."""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import redis_server
from forkyard.cluster.nodekeys import NODE_URL_HEADER, NodeKeys
from forkyard.cluster.config import SECRET_HEADER
from forkyard.cluster.scheduler import create_scheduler_app
from forkyard.cluster.store import ClusterStore
from forkyard.cluster.types import NodeReport

SECRET = "master-" + "s" * 32
URLS = {"A": "http://10.0.0.1:3000", "B": "http://10.0.0.2:3000"}


@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as url:
        yield url


def _as(node: str, url: str | None = None) -> dict:
    return {SECRET_HEADER: NodeKeys(SECRET).key(node, url or URLS[node]), NODE_URL_HEADER: url or URLS[node]}


async def test_only_a_nodes_own_key_moves_its_leases(redis_url):
    store = ClusterStore(redis_url)
    app = create_scheduler_app(store, SECRET)
    now = time.time()
    for n, u in URLS.items():
        await store.heartbeat(n, u, NodeReport(running=0), now=now)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
        lease = "/v1/nodes/{n}/volumes/{v}/{op}"
        r = await c.post(lease.format(n="B", v="vol1", op="lease"), json={"name": "data"}, headers=_as("B"))
        assert r.status_code == 200 and r.json()["granted"], r.text
        refused = [
            ("A's key in B's name", "B", _as("A")),
            ("A's key, B's url header", "B", {**_as("A"), NODE_URL_HEADER: URLS["B"]}),
            ("B's id with A's key minted for B's url", "B", _as("A", URLS["B"])),
            ("the master secret", "B", {SECRET_HEADER: SECRET, NODE_URL_HEADER: URLS["B"]}),
            ("a user's API key", "B", {"x-api-key": "e2b_" + "0" * 40}),
            ("no credential", "B", {}),
        ]
        for what, n, headers in refused:
            for op in ("lease", "release"):
                r = await c.post(lease.format(n=n, v="vol1", op=op), json={"name": "data"}, headers=headers)
                assert r.status_code in (401, 403), (what, op, r.status_code, r.text)
        # A in its own name: refused the lease B holds, and its release changes nothing
        r = await c.post(lease.format(n="A", v="vol1", op="lease"), json={"name": "data"}, headers=_as("A"))
        assert r.status_code == 200 and not r.json()["granted"] and r.json()["holder"] == "B", r.text
        r = await c.post(lease.format(n="A", v="vol1", op="release"), json={}, headers=_as("A"))
        assert r.status_code == 200 and r.json() == {"released": False}
        assert await store.volume_holders(ids=["vol1"]) == ["B"]
        # path tricks: not the node route (a node key is refused there) or not a name (400)
        for path in ("/v1/nodes/A/volumes/../../B/volumes/vol1/release", "/v1/nodes/A/volumes/vol1/release/",
                     "/v1/nodes/A/volumes/vol1%2F..%2F..%2FB/release", "/v1/nodes/A/volumes/.../release"):
            r = await c.post(path, json={}, headers=_as("A"))
            assert r.status_code in (400, 403, 404, 405, 422), (path, r.status_code, r.text)
        assert await store.volume_holders(ids=["vol1"]) == ["B"]
    await store.aclose()
