"""The control plane at scale (issue 26), with a simulated fleet (``tests/_fleet.py``:
real redis-server with AOF, two real scheduler processes and the gateway; nodes that
speak the node agent's protocol through its own message builders). No runsc needed.

Before issue 26 a placement read every node and its pending count, chose, then wrote:
concurrent placements read the same counts and herded onto the same nodes (with room
for 300 and 8 clients, 400 of 400 were granted, 344 onto full nodes).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import redis

from _fleet import Fleet
from forkyard.cluster.config import SECRET_HEADER

ROOT = Path(__file__).resolve().parent.parent


async def _place(c: httpx.AsyncClient, count: int) -> httpx.Response:
    return await c.post("/v1/placements", json={"kind": "create", "count": count, "snapshot": "base"})


async def test_racing_placements_on_two_replicas_never_give_a_node_more_than_its_room(plane):
    """8 clients on each of 2 replicas place creates (of 1 and 2 sandboxes) as fast as
    they can against 10 nodes with room for 3 each: exactly 30 are granted, none beyond
    a node's room, and the next placement is refused for capacity."""
    room, nodes = 3, 10
    fleet = Fleet(nodes, room, plane.scheduler_urls, plane.secret)
    await fleet.register()
    fleet.run()
    granted: Counter = Counter()
    try:
        async def client(url: str, k: int):
            async with httpx.AsyncClient(base_url=url, headers={SECRET_HEADER: plane.secret}, timeout=30) as c:
                while True:
                    r = await _place(c, 1 + k % 2)
                    if r.status_code == 503:
                        return
                    assert r.status_code == 200, r.text
                    for p in r.json()["placements"]:
                        granted[p["nodeID"]] += p["count"]

        await asyncio.gather(*(client(u, k) for u in plane.scheduler_urls for k in range(8)))
        # a client that gave up on a lost race may have left room: take what is left, one at a time
        async with httpx.AsyncClient(base_url=plane.scheduler_urls[0], headers={SECRET_HEADER: plane.secret},
                                     timeout=30) as c:
            while (r := await _place(c, 1)).status_code == 200:
                granted[r.json()["placements"][0]["nodeID"]] += 1
            assert r.status_code == 503 and "no node has room" in r.json()["message"], r.text
        over = {n: v for n, v in granted.items() if v > room}
        assert not over, f"nodes given more sandboxes than their room ({room}): {over}"
        assert sum(granted.values()) == room * nodes, granted
        # Redis counts the same: every node's pending placements add up to its room
        r = redis.Redis.from_url(plane.redis_url)
        pending = {n.node_id: sum(int(v) for v in r.hvals(f"fy:placingn:{n.node_id}")) for n in fleet.nodes}
        assert pending == {n.node_id: room for n in fleet.nodes}, pending
        assert r.zcard("fy:place") == 0  # full nodes leave the placement index
        assert not fleet.errors(), fleet.errors()[:3]
    finally:
        await fleet.stop()


async def test_acknowledged_placements_free_their_count_and_the_node_fills_exactly(plane):
    """Placed creates that reach the node (rows + ack in its next heartbeat) move from
    ``placing`` to ``running``; the node can then take exactly what is left."""
    fleet = Fleet(2, 4, plane.scheduler_urls, plane.secret)
    await fleet.register()
    try:
        async with httpx.AsyncClient(base_url=plane.scheduler_urls[1], headers={SECRET_HEADER: plane.secret},
                                     timeout=30) as c:
            for _ in range(3):
                p = (await _place(c, 1)).json()["placements"][0]
                fleet.by_id[p["nodeID"]].start(1, p["placementID"])
            for n in fleet.nodes:
                await n.beat()  # rows published, placements acked
            r = redis.Redis.from_url(plane.redis_url)
            assert sum(r.hlen(f"fy:placingn:{n.node_id}") for n in fleet.nodes) == 0
            got = Counter()
            while (resp := await _place(c, 1)).status_code == 200:
                got[resp.json()["placements"][0]["nodeID"]] += 1
            assert resp.status_code == 503
            assert {n.node_id: len(n.rows) + got[n.node_id] for n in fleet.nodes} == {n.node_id: 4 for n in fleet.nodes}
    finally:
        await fleet.stop()


def test_control_plane_bench_runs_small_and_never_over_grants(tmp_path):
    """bench/bench_control_plane.py at a small size: it runs (its bare-HTTP floor too,
    and it waits for the fleet's steady state), prints its table, and its racing
    placements never put more sandboxes on a node than its room."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_control_plane.py"), "--nodes", "4",
                          "--sandboxes", "300", "--placements", "40", "--clients", "4", "--list-sizes", "300",
                          "--cpu-seconds", "2", "--bare-http", "--root", str(tmp_path / "bench")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "placement p50, 1 client" in out.stdout and "over-granted: 0" in out.stdout, out.stdout
    assert "bare uvicorn POST" in out.stdout and "# steady after" in out.stdout, out.stdout


def _all_pages(get, **params) -> list[str]:
    """Every id a paginated list gives, following ``x-next-token``."""
    ids, token = [], None
    while True:
        r = get(**params, **({"nextToken": token} if token else {}))
        assert r.status_code == 200, r.text
        ids += [x["sandboxID"] for x in r.json()]
        token = r.headers.get("x-next-token")
        if not token:
            return ids


async def test_gateway_list_reads_only_the_page_and_lists_as_a_node_does(plane):
    """GET /v2/sandboxes through the gateway: filters (state, metadata, template, start
    times), order and paging give what a node's own list gives over the same records
    (forkyard.api.routes_sandboxes.list_page, the oracle), and a page reads about its own
    size from Redis, not every binding (it read all 600 before issue 26)."""
    from datetime import datetime, timezone

    from fastapi import Response

    from forkyard.api.routes_sandboxes import list_page

    fleet = Fleet(3, 1000, plane.scheduler_urls, plane.secret)
    await fleet.register()
    try:
        await fleet.seed(600, metadata=lambda i: {"user": f"u{i % 7}", "k=x": "a b&c" if i % 3 else "z"},
                         paused_every=5)
        recs = [r for n in fleet.nodes for r in n.rows.values()]
        iso = lambda t: datetime.fromtimestamp(t, timezone.utc).isoformat()  # noqa: E731
        mid = sorted(r.started_at for r in recs)[300]

        def oracle(**q) -> list[str]:
            ids, token = [], None
            while True:
                resp = Response()
                page = list_page(recs, resp, q.get("metadata"), q.get("state"), q.get("template"), q.get("order"),
                                 token, q.get("limit", 100), q.get("startedAfter"), q.get("startedBefore"))
                ids += [x["sandboxID"] for x in page]
                token = resp.headers.get("x-next-token")
                if not token:
                    return ids

        with httpx.Client(base_url=plane.gateway_url, headers={"X-API-Key": plane.api_key}, timeout=60) as gw:
            def get(**params):
                return gw.get("/v2/sandboxes", params=params)

            import urllib.parse

            for q in [{}, {"limit": 7}, {"order": "asc", "limit": 33}, {"state": "paused", "limit": 9},
                      {"state": "running"}, {"metadata": "user=u3", "limit": 10},
                      {"metadata": urllib.parse.urlencode({"user": "u2", "k=x": "a b&c"}), "state": "running"},
                      {"startedAfter": iso(mid), "limit": 50}, {"startedBefore": iso(mid), "order": "asc"},
                      {"template": "base", "metadata": "user=u6", "state": "paused"}, {"template": "other"}]:
                assert _all_pages(get, **q) == oracle(**q), q
            assert get(nextToken="bm90LWEtdG9rZW4").status_code == 400
            # v1 (running only, no pages) and the cluster's counts
            v1 = gw.get("/sandboxes", params={"metadata": "user=u1"}).json()
            assert sorted(x["sandboxID"] for x in v1) == sorted(oracle(metadata="user=u1", state="running"))
            m = gw.get("/metrics/cluster").json()["sandboxes"]
            assert m == {"running": 480, "paused": 120}, m
            r = redis.Redis.from_url(plane.redis_url)
            r.config_resetstat()
            assert len(get(limit=10).json()) == 10
            reads = r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0)
            assert reads <= 11 + 3, f"one page of 10 read {reads} hashes (11 bindings + 3 nodes at most)"
    finally:
        await fleet.stop()


async def test_heartbeats_send_only_a_digest_until_something_changes(plane):
    """A node whose sandboxes did not change sends only the digest of its held ids (the
    scheduler compares it with the digest its scripts keep of the node's bindings: no
    set is read); a change on the node, or on the scheduler's side (a paused sandbox
    moved away), brings the full list back, and the move is reconciled."""
    from forkyard.cluster.messages import held_digest
    from forkyard.cluster.store import ClusterStore

    fleet = Fleet(2, 100, plane.scheduler_urls, plane.secret)
    await fleet.register()
    store = ClusterStore(plane.redis_url)
    try:
        await fleet.seed(40, paused_every=4)
        n0, n1 = fleet.nodes
        assert (await n0.beat())["full"]  # its set changed since the last full heartbeat
        for _ in range(3):
            out = await n0.beat()
            assert not out["full"] and not out.get("resend"), out
        r = redis.Redis.from_url(plane.redis_url)
        assert r.get(f"fy:nodedig:{n0.node_id}").decode() == held_digest(n0.rows)
        n0.start(1, None)  # a new sandbox on the node: full again
        assert (await n0.beat())["full"] and not (await n0.beat())["full"]
        moved = next(s for s, rec in n0.rows.items() if rec.state == "paused")
        assert await store.rebind(moved, n0.node_id, n1.node_id)  # the scheduler side changes
        assert r.get(f"fy:nodedig:{n0.node_id}").decode() == held_digest(set(n0.rows) - {moved})
        out = await n0.beat()
        assert not out["full"] and out["resend"]
        out = await n0.beat()
        assert out["full"] and out["foreign"] == [moved], out
        assert (await n1.beat())["adopt"][0]["id"] == moved
    finally:
        await store.aclose()
        await fleet.stop()


async def test_heartbeat_route_checks_key_size_and_body_before_redis(plane):
    """The heartbeat is answered before the framework (forkyard.cluster.beats) with the
    guard's checks: no key 401, the master secret 403, an announced or a streamed
    (chunked) body over the bound 413, a body that does not validate 422 with the field
    named, another URL than the key's 403 — each with a message, none of them writes the
    node into Redis; then the same node's valid heartbeat registers it."""
    from forkyard.cluster.messages import heartbeat_body, node_report
    from forkyard.cluster.nodekeys import NODE_URL_HEADER, node_key
    from forkyard.cluster.scheduler import MAX_BODY

    nid, url = "lean0", "http://127.0.0.1:9/lean0"
    key = {SECRET_HEADER: node_key(plane.secret, nid, url), NODE_URL_HEADER: url}
    report = node_report([], vcpus=4, memory_mb=1024, max_sandboxes=10, free_slots=1, cache_bytes=0, load1=0.0,
                         runtime="simulated", cached_snapshots=[], boot="b", drain_done=False)
    good = heartbeat_body(url, report, [], set(), False)
    path = f"/v1/nodes/{nid}/heartbeat"

    async def chunks():
        for _ in range(MAX_BODY // (1 << 20) + 1):
            yield b" " * (1 << 20)

    async with httpx.AsyncClient(base_url=plane.scheduler_urls[0], timeout=30, trust_env=False) as c:
        tries = [(401, dict(json=good, headers={NODE_URL_HEADER: url})),
                 (403, dict(json=good, headers={SECRET_HEADER: plane.secret, NODE_URL_HEADER: url})),
                 (413, dict(content=b" " * (MAX_BODY + 1), headers=key)),
                 (413, dict(content=chunks(), headers=key)),
                 (422, dict(content=b"{not json", headers=key)),
                 (422, dict(json={**good, "digest": "XYZ"}, headers=key)),
                 (422, dict(json={**good, "held": "not-a-list"}, headers=key)),
                 (403, dict(json={**good, "url": "http://127.0.0.1:9/other"}, headers=key))]
        for status, kw in tries:
            r = await c.post(path, **kw)
            assert r.status_code == status and r.json()["message"], (status, r.status_code, r.text[:300])
        assert "digest" in (await c.post(path, json={**good, "digest": "XYZ"}, headers=key)).json()["message"]
        assert not redis.Redis.from_url(plane.redis_url).exists(f"fy:node:{nid}")
        r = await c.post(path, json=good, headers=key)
        assert r.status_code == 200 and r.json()["status"] == "up", r.text
        assert redis.Redis.from_url(plane.redis_url).hget(f"fy:node:{nid}", "url").decode() == url


async def test_gateway_create_body_is_bounded_while_read(plane):
    """The gateway reads a create's JSON body under its bound (forkyard.relay.body): a
    streamed (chunked) body over it is a 413 with a message, before anything is placed;
    a body that is not a JSON object is a 400."""
    from forkyard.cluster.gateway import MAX_JSON_BODY

    async def chunks():
        for _ in range(MAX_JSON_BODY // (1 << 16) + 2):
            yield b" " * (1 << 16)

    async with httpx.AsyncClient(base_url=plane.gateway_url, headers={"X-API-Key": plane.api_key}, timeout=30,
                                 trust_env=False) as c:
        r = await c.post("/sandboxes", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and str(MAX_JSON_BODY) in r.json()["message"], r.text[:300]
        for bad in (b"{not json", b"[1, 2]"):
            r = await c.post("/sandboxes", content=bad, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["message"], r.text[:300]


async def test_placements_plan_on_a_short_lived_view_that_spreads_a_burst_and_never_overrides_the_reservation(plane):
    """Placements plan on the candidates one read of Redis gave (forkyard.cluster.view):
    a burst of 20 on one read, spread over 4 equal nodes 5 each (the view counts the
    room this replica took: without that all 20 would go to the first node), and the
    reservation still decides — a node drained after the view was read, or one filled
    by another replica meanwhile, gets nothing more."""
    from forkyard.cluster.nodekeys import NodeKeys
    from forkyard.cluster.scheduler import plan_and_reserve
    from forkyard.cluster.store import ClusterStore
    from forkyard.cluster.view import CandidateView

    fleet = Fleet(4, 100, plane.scheduler_urls, plane.secret)
    await fleet.register()
    store = ClusterStore(plane.redis_url, keys=NodeKeys(plane.secret))
    try:
        view = CandidateView(store, ttl_s=60.0)  # one read for the whole test unless a try fails
        r = redis.Redis.from_url(plane.redis_url)

        def hgetalls() -> int:
            return int(r.info("commandstats").get("cmdstat_hgetall", {}).get("calls", 0))

        before = hgetalls()
        got = Counter()
        for _ in range(20):
            plan, _ = await plan_and_reserve(store, 1, snapshot_id="base", view=view)
            got[plan[0][0].node_id] += 1
        assert sorted(got.values()) == [5, 5, 5, 5], got
        assert hgetalls() - before <= 4, "a burst within the view's life reads the nodes once"
        # drained after the view was read: the reservation refuses it, the plan is made again
        drained = fleet.nodes[0].node_id
        async with httpx.AsyncClient(base_url=plane.scheduler_urls[0], headers={SECRET_HEADER: plane.secret},
                                     timeout=30, trust_env=False) as c:
            assert (await c.post(f"/v1/nodes/{drained}/drain")).status_code == 200
        # another replica fills a second node to its room behind this view's back
        full = fleet.nodes[1].node_id
        other = ClusterStore(plane.redis_url, keys=NodeKeys(plane.secret))
        try:
            pid, _, _ = await other.reserve([(full, 95)])
            assert pid is not None
        finally:
            await other.aclose()
        for _ in range(20):
            plan, _ = await plan_and_reserve(store, 1, snapshot_id="base", view=view)
            assert plan[0][0].node_id not in (drained, full), plan
        pending = {n.node_id: sum(int(v) for v in r.hvals(f"fy:placingn:{n.node_id}")) for n in fleet.nodes}
        assert pending[full] == 100 and pending[drained] == 5, pending
    finally:
        await store.aclose()
        await fleet.stop()


async def test_placement_route_checks_secret_size_and_body(plane):
    """``POST /v1/placements`` is answered in front of FastAPI (forkyard.cluster.leanroute)
    after the guard: no secret 401, a node key 403, a body over the bound 413, a body
    that does not validate 422 naming the field, a fork without its source 400 — each
    a ``{code, message}`` — and nothing reserved by any of them."""
    from forkyard.cluster.nodekeys import NODE_URL_HEADER, node_key
    from forkyard.cluster.scheduler import MAX_BODY

    fleet = Fleet(1, 10, plane.scheduler_urls, plane.secret)
    await fleet.register()
    node = fleet.nodes[0]
    ok = {SECRET_HEADER: plane.secret}
    try:
        async with httpx.AsyncClient(base_url=plane.scheduler_urls[1], timeout=30, trust_env=False) as c:
            tries = [(401, dict(json={"kind": "create"})),
                     (403, dict(json={"kind": "create"}, headers={SECRET_HEADER: node_key(plane.secret, node.node_id,
                                                                                         node.url),
                                                                  NODE_URL_HEADER: node.url})),
                     (413, dict(content=b" " * (MAX_BODY + 1), headers=ok)),
                     (422, dict(content=b"{not json", headers=ok)),
                     (422, dict(json={"kind": "teleport"}, headers=ok)),
                     (422, dict(json={"kind": "create", "count": 101}, headers=ok)),
                     (400, dict(json={"kind": "fork"}, headers=ok))]
            for status, kw in tries:
                resp = await c.post("/v1/placements", **kw)
                assert resp.status_code == status and resp.json()["code"] == status and resp.json()["message"], \
                    (status, resp.status_code, resp.text[:300])
            assert "count" in (await c.post("/v1/placements", json={"kind": "create", "count": 101},
                                            headers=ok)).json()["message"]
            assert not redis.Redis.from_url(plane.redis_url).hlen(f"fy:placingn:{node.node_id}")
            resp = await c.post("/v1/placements", json={"kind": "create", "count": 2}, headers=ok)
            assert resp.status_code == 200, resp.text
            assert resp.json()["placements"][0] == {"nodeID": node.node_id, "url": node.url, "count": 2,
                                                    "placementID": resp.json()["placements"][0]["placementID"]}
    finally:
        await fleet.stop()
