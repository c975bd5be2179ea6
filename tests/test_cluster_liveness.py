"""When a node is declared down (forkyard.cluster.liveness) — the rules on made-up
clusters, and the declaration script against a real redis-server. No runsc needed.

Before issue 19 the sweep judged nodes by heartbeats stored in Redis as soon as Redis
answered again, so an 8 s Redis outage declared every node down and every running
sandbox was destroyed; these tests pin the rules that prevent it."""

from __future__ import annotations

import asyncio

from test_cluster_store import redis_url  # noqa: F401 — the real redis-server fixture

from forkyard.cluster.liveness import Liveness
from forkyard.cluster.scheduler import SWEEP_LEASE_S, sweep_once
from forkyard.cluster.store import ClusterStore
from forkyard.cluster.types import NODE_DOWN, NODE_UP, NodeInfo, NodeReport

T = 1_000_000.0


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def node(nid: str, silent_s: float, now: float = T, status: str = NODE_UP) -> NodeInfo:
    return NodeInfo(node_id=nid, url=f"http://{nid}", status=status, last_seen=now - silent_s, report=NodeReport())


async def _n0_silent_for_30_s(store: ClusterStore) -> float:
    """Nodes n0-n2, n0's last heartbeat 30 s ago and running ``run0``; returns Redis's
    time (s)."""
    now = await store.now()
    for nid in ("n0", "n1", "n2"):
        await store.heartbeat(nid, f"http://{nid}", NodeReport(), now=now - (30 if nid == "n0" else 0))
    await store.publish("n0", [{"id": "run0", "state": "running"}], [])
    return now


def _answering(asked: list[str]):
    """A health probe that answers (alive) and records the URLs it was asked."""

    async def probe(url):
        asked.append(url)
        return True

    return probe


def watch(live: Liveness, clock: Clock, start: float, seconds: float) -> float:
    """Tick once a second for ``seconds`` with Redis up; returns Redis time at the end."""
    now = start
    for _ in range(int(seconds)):
        clock.t += 1
        now += 1
        live.tick(now)
    return now


def test_a_silent_node_among_heard_ones_is_declared_after_the_timeout():
    clock = Clock()
    live = Liveness(timeout_s=5, clock=clock)
    now = watch(live, clock, T - 60, 60)  # the replica has been watching for a minute
    nodes = [node("a", 0.5, now), node("b", 0.3, now), node("c", 4.0, now)]
    assert live.judge(nodes, now).declare == []
    nodes[2] = node("c", 5.5, now)
    v = live.judge(nodes, now)
    assert v.declare == ["c"] and v.held_back is None


def test_after_a_redis_outage_every_node_gets_a_full_timeout():
    """Redis down 30 s: every heartbeat is 30 s old when it returns; none is declared
    until the nodes had a full timeout after Redis came back."""
    clock = Clock()
    live = Liveness(timeout_s=5, clock=clock)
    now = watch(live, clock, T, 60)
    last = now - 0.5  # every node's last heartbeat before the outage
    for _ in range(30):  # Redis down: sweeps fail
        clock.t += 1
        live.tick(None)
    now += 30
    live.tick(now)

    def nodes(heard: set[str]) -> list[NodeInfo]:
        return [NodeInfo(node_id=n, url="", status=NODE_UP, last_seen=now - 0.2 if n in heard else last,
                         report=NodeReport()) for n in "abc"]

    assert live.judge(nodes(set()), now).declare == []
    now = watch(live, clock, now, 4)
    assert live.judge(nodes(set()), now).declare == []
    # a and b are heard again; c stays silent and is declared once 5 s passed since Redis returned
    now = watch(live, clock, now, 2)
    assert live.judge(nodes({"a", "b"}), now).declare == ["c"]


def test_a_stalled_sweep_restarts_the_grace():
    """A scheduler that was stopped (SIGSTOP) or starved sees every heartbeat old when it
    runs again: it waits a full timeout before judging."""
    clock = Clock()
    live = Liveness(timeout_s=5, clock=clock)
    now = watch(live, clock, T, 30)
    clock.t += 20
    now += 20
    live.tick(now)
    assert live.judge([node("a", 21, now), node("b", 0.1, now), node("c", 0.1, now)], now).declare == []
    now = watch(live, clock, now, 6)
    assert live.judge([node("a", 27, now), node("b", 0.1, now), node("c", 0.1, now)], now).declare == ["a"]


def test_most_nodes_silent_at_once_blames_the_control_plane():
    clock = Clock()
    live = Liveness(timeout_s=5, mass_fraction=0.5, clock=clock)
    now = watch(live, clock, T, 60)
    nodes = [node("a", 9, now), node("b", 9, now), node("c", 0.2, now)]
    v = live.judge(nodes, now)
    assert v.declare == [] and "2 of 3 nodes are silent" in v.held_back
    # one of two (not a majority) is the node's own fault; nodes declared before do not count
    assert live.judge([node("a", 9, now), node("b", 0.2, now), node("x", 999, now, NODE_DOWN)], now).declare == ["a"]
    # a single-node cluster whose node dies: declared (nothing else could be blamed)
    assert live.judge([node("a", 9, now)], now).declare == ["a"]


def test_nothing_is_judged_while_redis_fails():
    live = Liveness(timeout_s=5, clock=Clock())
    live.tick(None)
    assert live.judge([node("a", 60)], T).declare == []


async def test_declaration_uses_redis_time_and_rechecks_atomically(redis_url):  # noqa: F811
    """The script compares heartbeats with Redis's own clock; a node heard between the
    judgement and the script is not declared; a declared node's running sandboxes get
    tombstones with the cause, its paused ones stay bound; a heartbeat clears it."""
    store = ClusterStore(redis_url)
    try:
        now = await store.now()
        await store.heartbeat("n0", "http://n0", NodeReport(), now=now - 30)  # stamped 30 s ago
        await store.heartbeat("n1", "http://n1", NodeReport())  # stamped by Redis: now
        await store.publish("n0", [{"id": "run0", "state": "running"}, {"id": "pau0", "state": "paused"}], [])
        assert await store.mark_down("n1", healthy_since=now - 60, timeout_s=5) is None  # heard
        assert await store.mark_down("n0", healthy_since=now - 2, timeout_s=5) is None  # grace
        assert await store.mark_down("n0", healthy_since=now - 60, timeout_s=5) == ["run0"]
        nodes = {n.node_id: n for n in await store.nodes()}
        assert nodes["n0"].declared_down and nodes["n0"].status == NODE_DOWN and not nodes["n1"].declared_down
        assert 29 < nodes["n0"].age < 40
        assert await store.binding("run0") is None and await store.is_gone("run0")
        assert "n0 stopped sending heartbeats" in await store.death("run0")
        assert (await store.binding("pau0")).node_id == "n0"
        # the node is back: heard, up again, told to drop the gone one
        assert await store.heartbeat("n0", "http://n0", NodeReport()) == NODE_UP
        assert not (await store.node("n0")).declared_down
        foreign, missing, _ = await store.reconcile("n0", {"run0", "pau0"})
        assert foreign == ["run0"] and missing == []
        # ... unless it paused it meanwhile (cut off): a paused sandbox is never dropped
        await store.heartbeat("n0", "http://n0", NodeReport(), now=now - 30)
        await store.publish("n0", [{"id": "run1", "state": "running"}], [])
        assert await store.mark_down("n0", healthy_since=now - 60, timeout_s=5) == ["run1"]
        foreign, missing, _ = await store.reconcile("n0", {"run1", "pau0"}, paused={"run1", "pau0"})
        assert foreign == [] and missing == ["run1"] and not await store.is_gone("run1")
    finally:
        await store.aclose()


async def test_a_node_that_announced_a_restart_is_not_declared_in_its_grace(redis_url):  # noqa: F811
    store = ClusterStore(redis_url)
    try:
        now = await store.now()
        await store.heartbeat("n0", "http://n0", NodeReport(), now=now - 30)
        await store.publish("n0", [{"id": "run0", "state": "running"}], [])
        assert await store.announce_restart("n0", 60)
        assert await store.mark_down("n0", healthy_since=now - 60, timeout_s=5) is None
        assert (await store.node("n0")).grace_until > now + 50
        assert await store.announce_restart("n0", 0)  # its grace is over
        assert await store.mark_down("n0", healthy_since=now - 60, timeout_s=5) == ["run0"]
        assert not await store.announce_restart("nobody", 60)
    finally:
        await store.aclose()


async def test_sweep_after_redis_lost_its_data_declares_nobody(redis_url):  # noqa: F811
    """Without AOF a restarted Redis is empty: the sweep writes a new epoch and declares
    nothing; nodes re-register with their own status (a draining one stays draining)."""
    store = ClusterStore(redis_url)
    try:
        live = Liveness(timeout_s=5)
        await store.heartbeat("n0", "http://n0", NodeReport(), own_status="draining")
        await store._r.flushall()
        assert await store.state_age() is None
        assert await sweep_once(store, live) == []
        assert 0 <= await store.state_age() < 5
        assert await store.heartbeat("n0", "http://n0", NodeReport(), own_status="draining") == "draining"
        await store.set_status("n0", NODE_UP)  # the operator's undrain wins over the node's view
        assert await store.heartbeat("n0", "http://n0", NodeReport(), own_status="draining") == NODE_UP
    finally:
        await store.aclose()


async def test_a_paused_sandbox_whose_image_is_not_committed_never_moves(redis_url):  # noqa: F811
    store = ClusterStore(redis_url)
    try:
        await store.publish("n0", [{"id": "p1", "state": "paused", "committed": False},
                                   {"id": "p2", "state": "paused", "committed": True}], [])
        assert not await store.rebind("p1", "n0", "n1")
        assert await store.rebind("p2", "n0", "n1")
        await store.publish("n0", [{"id": "p1", "state": "paused", "committed": True}], [])  # committed later
        assert await store.rebind("p1", "n0", "n1")
    finally:
        await store.aclose()



async def test_a_silent_node_that_answers_its_health_check_is_not_declared(redis_url):  # noqa: F811
    """Overloaded, or cut off from the scheduler one way: silent but alive. The sweep
    asks the node before declaring it; only one that does not answer is declared."""
    store = ClusterStore(redis_url)
    try:
        now = await _n0_silent_for_30_s(store)
        clock = Clock()
        live = Liveness(timeout_s=5, clock=clock)
        live.tick(now - 60)  # watching for a minute
        asked = []
        answers = _answering(asked)

        assert await sweep_once(store, live, probe=answers) == [] and asked == ["http://n0"]
        assert (await store.binding("run0")) is not None

        async def silent(url):
            return False

        assert await sweep_once(store, live, probe=silent) == ["n0"]
        assert await store.binding("run0") is None
    finally:
        await store.aclose()


async def test_one_replica_sweeps_and_another_takes_over_when_it_stops(redis_url):  # noqa: F811
    """Two scheduler replicas each run the sweep loop; only the holder of the sweeper
    lease reads the nodes (and probes and declares). When the holder stops renewing (it
    died or stalled), the other takes the lease over once it lapses and declares a node
    silent past the timeout: its view was kept up to date while it did not sweep."""
    store = ClusterStore(redis_url)
    try:
        now = await _n0_silent_for_30_s(store)
        clock = Clock()
        a, b = Liveness(timeout_s=5, clock=clock), Liveness(timeout_s=5, clock=clock)
        a.tick(now - 60)
        b.tick(now - 60)
        asked = []
        answers = _answering(asked)

        assert await sweep_once(store, a, probe=answers, replica="A") == [] and asked == ["http://n0"]
        assert await sweep_once(store, b, probe=answers, replica="B") == [] and asked == ["http://n0"]  # not B
        assert await sweep_once(store, a, probe=answers, replica="A") == [] and len(asked) == 2  # A renews
        assert b.healthy_since == now - 60  # B's view is kept: trusted at once when it takes over

        async def silent(url):
            return False

        await asyncio.sleep(SWEEP_LEASE_S + 0.3)  # A stops renewing
        assert await sweep_once(store, b, probe=silent, replica="B") == ["n0"]
        assert await store.binding("run0") is None
        assert not (await store.sweep_lease("A", SWEEP_LEASE_S))[0]  # A, back, does not sweep beside B
    finally:
        await store.aclose()


async def test_a_sweep_reads_the_nodes_only_when_one_is_silent_or_not_indexed(redis_url):  # noqa: F811
    """With every node heard, a sweep is one script (no node hash is read: counted by
    Redis's own command statistics); a node silent past the timeout, or registered
    without an entry in the silence index (a record an older scheduler wrote), makes
    the sweep read every node as before."""
    store = ClusterStore(redis_url)
    try:
        for nid in ("n0", "n1"):
            await store.heartbeat(nid, f"http://{nid}", NodeReport())
        live = Liveness(timeout_s=5)
        await sweep_once(store, live, replica="A")  # the first sweep of a process reads everything once
        await store._r.config_resetstat()
        for _ in range(3):
            assert await sweep_once(store, live, replica="A") == []
        stats = await store._r.info("commandstats")
        assert not any(k in stats for k in ("cmdstat_hmget", "cmdstat_hgetall", "cmdstat_smembers")), stats
        assert (await store.sweep_lease("A", SWEEP_LEASE_S))[2] is False

        await store._r.zrem("fy:seen", "n1")  # a record without an index entry
        assert (await store.sweep_lease("A", SWEEP_LEASE_S))[2] is True
        await store.heartbeat("n1", "http://n1", NodeReport())  # its next heartbeat indexes it
        assert (await store.sweep_lease("A", SWEEP_LEASE_S))[2] is False
        now = await store.now()
        await store.heartbeat("n1", "http://n1", NodeReport(), now=now - 30)  # silent
        assert (await store.sweep_lease("A", SWEEP_LEASE_S))[2] is True
        await store._r.config_resetstat()
        await sweep_once(store, live, replica="A")
        assert "cmdstat_hmget" in await store._r.info("commandstats")
    finally:
        await store.aclose()

