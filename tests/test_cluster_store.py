"""The cluster store's placement accounting against a real redis-server: a placement
counts against its node until the node acknowledges it in a heartbeat (whose report
then shows its sandboxes) or it expires — never lost while a report is in flight,
which put a 17th child on a node with room for 16 and two creates in a row on one node."""

from __future__ import annotations

import asyncio
import time

import pytest
from conftest import redis_server

from forkyard.cluster.store import PLACING_TTL_S, ClusterStore
from forkyard.cluster.types import NodeReport


@pytest.fixture
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis", numbered=True)) as url:
        yield url


async def test_placement_counts_until_acked_not_until_the_next_heartbeat(redis_url):
    store = ClusterStore(redis_url)
    try:
        now = time.time()
        await store.heartbeat("n0", "http://n0", NodeReport(running=0), now=now)
        pid = await store.add_placing("n0", 3, now=now + 0.01)
        other = await store.add_placing("n1", 1, now=now + 0.01)
        # A heartbeat recorded after the placement, whose report was built before the
        # sandboxes existed (running=0): the placement still counts.
        await store.heartbeat("n0", "http://n0", NodeReport(running=0), now=now + 0.02)
        assert await store.pending_placements(["n0", "n1"], now=now + 0.03) == {"n0": 3, "n1": 1}
        # The node acks it once its report shows them; acks of unknown ids are harmless.
        await store.ack_placing("n0", [pid, "0123456789abcdef"])
        assert await store.pending_placements(["n0", "n1"], now=now + 0.04) == {"n0": 0, "n1": 1}
        # One never acked (its request never reached the node) stops counting in time.
        assert await store.pending_placements(["n1"], now=now + PLACING_TTL_S + 1) == {"n1": 0}
        assert other  # an id was handed out for it
    finally:
        await store.aclose()


async def test_concurrent_placements_each_count(redis_url):
    store = ClusterStore(redis_url)
    try:
        pids = await asyncio.gather(*(store.add_placing("n0", 2) for _ in range(20)))
        assert len(set(pids)) == 20
        assert (await store.pending_placements(["n0"]))["n0"] == 40
        await store.ack_placing("n0", pids[:15])
        assert (await store.pending_placements(["n0"]))["n0"] == 10
    finally:
        await store.aclose()


async def test_the_redis_pool_is_bounded_and_makes_callers_wait(redis_url):
    """More concurrent calls than connections wait for one (they used to fail with
    redis-py's "Too many connections" past its default 100, as 503s); past the wait
    bound a call fails as Redis unavailable, and the pool never grows past its size."""
    import redis as sync_redis

    from forkyard.cluster.store import ClusterStoreUnavailable

    store = ClusterStore(redis_url, max_connections=3, pool_wait_s=5)
    try:
        got = await asyncio.gather(*(store.heartbeat(f"n{i}", f"http://n{i}", NodeReport()) for i in range(60)))
        assert got == ["up"] * 60
        clients = [c for c in sync_redis.Redis.from_url(redis_url).client_list() if c.get("cmd") != "client|list"]
        assert len(clients) <= 3, clients
    finally:
        await store.aclose()
    store = ClusterStore(redis_url, max_connections=1, pool_wait_s=0.3)
    try:
        busy = asyncio.create_task(store._r.blpop("fy:test:never", timeout=1))  # holds the one connection
        await asyncio.sleep(0.1)
        t0 = time.monotonic()
        with pytest.raises(ClusterStoreUnavailable, match="No connection available"):
            await store.now()
        assert 0.25 < time.monotonic() - t0 < 1.5
        await busy
        assert await store.now() > 0  # free again
    finally:
        await store.aclose()
