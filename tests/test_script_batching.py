"""forkyard.cluster.batching against a real redis-server: calls of one script that arrive
together go to Redis in one pipeline, each still gets its own reply or error, a Redis
that lost its scripts (a restart) is handled, and a Redis that is gone fails every
waiting call — through the cluster store's heartbeats too."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
import redis.asyncio as aioredis
from conftest import redis_server

from forkyard.cluster.batching import ScriptBatcher
from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable
from forkyard.cluster.types import NodeReport

ECHO = "if ARGV[1] == 'boom' then return redis.error_reply('boom') end return {KEYS[1], ARGV[1]}"


@pytest.fixture
def redis_url(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis", numbered=True)) as url:
        yield url


def _pipelines_sent(url: str) -> int:
    """EVALSHA calls Redis has run (INFO commandstats)."""
    return redis.Redis.from_url(url).info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)


async def test_calls_arriving_together_share_a_pipeline_and_keep_their_own_replies(redis_url):
    r = aioredis.Redis.from_url(redis_url)
    sent: list[int] = []
    real_pipeline = r.pipeline

    def counting_pipeline(*a, **kw):
        sent.append(1)
        return real_pipeline(*a, **kw)

    r.pipeline = counting_pipeline
    b = ScriptBatcher(r, r.register_script(ECHO), window_s=0.05)
    try:
        replies = await asyncio.gather(*[b.call([f"k{i}"], [str(i)]) for i in range(10)],
                                       b.call(["k"], ["boom"]), return_exceptions=True)
        assert [x for x in replies[:10]] == [[f"k{i}".encode(), str(i).encode()] for i in range(10)]
        assert isinstance(replies[10], redis.ResponseError) and "boom" in str(replies[10])
        assert len(sent) == 1, "eleven calls within the window went as one pipeline"
        assert _pipelines_sent(redis_url) >= 11  # each ran as its own script on Redis
        # a full batch goes at once, without waiting for the window
        b.max_batch, b.window_s = 4, 10.0
        t0 = time.monotonic()
        await asyncio.gather(*[b.call([f"k{i}"], [str(i)]) for i in range(4)])
        assert time.monotonic() - t0 < 5
    finally:
        await r.aclose()


async def test_a_redis_that_lost_its_scripts_is_loaded_again(redis_url):
    r = aioredis.Redis.from_url(redis_url)
    b = ScriptBatcher(r, r.register_script(ECHO), window_s=0.01)
    try:
        assert await b.call(["a"], ["1"]) == [b"a", b"1"]
        await r.script_flush()  # as after a restart without the scripts
        got = await asyncio.gather(b.call(["a"], ["2"]), b.call(["b"], ["3"]))
        assert got == [[b"a", b"2"], [b"b", b"3"]]
    finally:
        await r.aclose()


async def test_heartbeats_fail_with_the_store_error_when_redis_is_gone(tmp_path):
    with redis_server(tmp_path) as url:
        store = ClusterStore(url, timeout_s=0.5)
        got = await asyncio.gather(*[store.heartbeat(f"n{i}", f"http://n{i}", NodeReport(running=0)) for i in range(5)])
        assert got == ["up"] * 5
        assert len(await store.nodes()) == 5
    try:  # the server is gone now
        results = await asyncio.gather(*[store.heartbeat(f"n{i}", f"http://n{i}", NodeReport(running=0))
                                         for i in range(5)], return_exceptions=True)
        assert all(isinstance(x, ClusterStoreUnavailable) for x in results), results
    finally:
        await store.aclose()
