"""Faults of the control plane — Redis, the schedulers, the gateway, clocks — against a
live cluster with probes and a mixed SDK workload (tests/chaos/_chaos.py). The goal for
each: no running or paused sandbox lost, traffic to running sandboxes keeps flowing
(only Redis being down may interrupt sandboxes this gateway never routed), creates and
moves answer a clear 503 until the control plane is back, and it recovers within
seconds. Figures are printed at the end of the session.

Before issue 19: Redis down 8-10 s destroyed every running sandbox; the scheduler down
over 5 s made every running sandbox answer 404 (the SDK says killed); a gateway with a
skewed clock judged every node down.
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from chaos._chaos import LONG, bench_only, Poller, Workload, create_on, read_counter, record, recovery_s
from chaos._faults import skewed_env
from e2b import Sandbox

from forkyard.cluster.types import HEARTBEAT_TIMEOUT_S

#: the first test also starts the shared cluster; the long variants take minutes more
pytestmark = pytest.mark.timeout(1800 if LONG else 900)

REDIS_DOWN_S = [1, 5, 10, 30, 60] if LONG else [10]
SCHEDULERS_DOWN_S = [2, 10, 30, 60] if LONG else [10]


def _no_node_declared(h) -> None:
    states = h.c.node_states()
    assert set(states.values()) == {"up"}, states


def test_redis_down(healthy):
    """Redis stopped for each duration, then started again from its AOF: nothing lost;
    probe traffic keeps flowing (the gateway routes from the bindings it read last);
    no node is declared down afterwards (each gets a full timeout from Redis's return)."""
    h = healthy
    for down_s in REDIS_DOWN_S:
        h.probes.ensure(running=3, paused=2)
        with Poller(h.c, h.probes.running) as poll, Workload(h.c, seed=down_s) as wl:
            time.sleep(1)
            h.c.redis.stop()
            with h.c.api() as api:  # what needs Redis says so
                r = api.post("/sandboxes", json={"templateID": "base"}, timeout=30)
                assert r.status_code == 503 and ("Redis" in r.text or "scheduler" in r.text), r.text
            time.sleep(max(0.0, down_s - 0.5))
            h.c.start_redis()
            t_back = time.time()
            rec = recovery_s(h.c, h.probes.running, t_back)
            time.sleep(HEARTBEAT_TIMEOUT_S + 1)  # past the grace: a wrong verdict would show now
        _no_node_declared(h)
        lost_r, lost_p = h.probes.check()
        record(f"Redis down {down_s} s (AOF on)", running_lost=len(lost_r), paused_lost=len(lost_p), poller=poll,
               recovery=rec, workload=wl)
        assert (lost_r, lost_p) == ([], []), (lost_r, lost_p)
        assert not poll.errors, poll.errors[:5]
        assert not wl.leaked


@bench_only
def test_redis_restarted_with_and_without_aof(healthy):
    """A restart from the AOF loses nothing. A restart without it (empty Redis) loses no
    sandbox either: every node publishes what it holds at its next heartbeat, and the
    gateway asks the nodes about ids it has no binding for meanwhile."""
    h = healthy
    for aof in (True, False):
        h.probes.ensure(running=3, paused=2)
        with Poller(h.c, h.probes.running) as poll, Workload(h.c, seed=7 if aof else 8) as wl:
            time.sleep(1)
            h.c.redis.stop()
            h.c.start_redis(aof=aof)
            t_back = time.time()
            rec = recovery_s(h.c, h.probes.running, t_back)
            deadline = time.time() + 10  # the nodes have published everything again
            while time.time() < deadline and any(h.c.owner(p.sid) is None for p in h.probes.all.values()):
                time.sleep(0.2)
            time.sleep(HEARTBEAT_TIMEOUT_S + 1)
        _no_node_declared(h)
        lost_r, lost_p = h.probes.check()
        record(f"Redis restarted {'from its AOF' if aof else 'empty (no AOF)'}", running_lost=len(lost_r),
               paused_lost=len(lost_p), poller=poll, recovery=rec, workload=wl)
        assert (lost_r, lost_p) == ([], []), (lost_r, lost_p)
        assert not wl.leaked


def test_schedulers_killed(healthy):
    """Both scheduler replicas SIGKILLed for each duration: running sandboxes keep
    answering throughout (0 failed probe reads), creates answer 503 naming the
    scheduler, and after the restart nothing is lost and no node is declared down."""
    h = healthy
    for down_s in SCHEDULERS_DOWN_S:
        h.probes.ensure(running=3, paused=2)
        with Poller(h.c, h.probes.running) as poll, Workload(h.c, seed=100 + down_s) as wl:
            time.sleep(1)
            for s in h.c.schedulers:
                s.stop(sig_kill=True)
            t0 = time.time()
            with h.c.api() as api:
                r = api.post("/sandboxes", json={"templateID": "base"}, timeout=30)
                assert r.status_code == 503 and "scheduler unreachable" in r.json()["message"], r.text
                for p in h.probes.all.values():  # REST on existing sandboxes still works
                    got = api.get(f"/sandboxes/{p.sid}")
                    assert got.status_code == 200, (p.sid, p.paused, got.status_code, got.text)
            time.sleep(max(0.0, down_s - (time.time() - t0)))
            for s in h.c.schedulers:
                s.start()
            rec = recovery_s(h.c, h.probes.running, time.time())
            time.sleep(HEARTBEAT_TIMEOUT_S + 1)
        _no_node_declared(h)
        lost_r, lost_p = h.probes.check()
        record(f"both schedulers SIGKILL {down_s} s", running_lost=len(lost_r), paused_lost=len(lost_p),
               poller=poll, recovery=rec, workload=wl)
        assert (lost_r, lost_p) == ([], []), (lost_r, lost_p)
        assert not poll.errors, poll.errors[:5]
        assert not wl.leaked


@bench_only
def test_one_of_two_schedulers_killed(healthy):
    """One replica SIGKILLed for 10 s: nodes and the gateway go on with the other one
    (FORKYARD_SCHEDULER_URL lists both) — no failed probe read, no failed create, no
    node ever silent."""
    h = healthy
    h.probes.ensure(running=3, paused=2)
    silent = []
    with Poller(h.c, h.probes.running) as poll, Workload(h.c, seed=3) as wl:
        time.sleep(1)
        h.c.schedulers[0].stop(sig_kill=True)
        with httpx.Client(base_url=h.c.schedulers[1].health.rsplit("/", 1)[0],
                          headers={"x-forkyard-cluster-secret": h.c.secret}, timeout=10) as s2:
            t0 = time.time()
            while time.time() - t0 < 10:
                silent += [n["nodeID"] for n in s2.get("/v1/nodes").json() if n["silent"]]
                time.sleep(0.5)
        made = Sandbox.create("base", timeout=60, **h.c.sdk)
        made.kill()
        h.c.schedulers[0].start()
        rec = recovery_s(h.c, h.probes.running, time.time())
    lost_r, lost_p = h.probes.check()
    record("one of two schedulers SIGKILL 10 s", running_lost=len(lost_r), paused_lost=len(lost_p), poller=poll,
           recovery=rec, workload=wl)
    assert (lost_r, lost_p) == ([], [])
    assert not poll.errors and not silent, (poll.errors[:5], silent)
    assert not wl.errors["create"], wl.errors["create"][:3]


@bench_only
def test_gateway_killed_mid_stream(healthy):
    """SIGKILL the gateway while a command streams its output through it: the client's
    stream breaks (one error), the sandbox and the command go on, and once the gateway is
    back the client reconnects to the same process and reads it to the end."""
    h = healthy
    h.probes.ensure(running=3, paused=2)
    p = h.probes.running[0]
    sbx = Sandbox.connect(p.sid, **h.c.sdk)
    handle = sbx.commands.run("for i in $(seq 1 400); do echo line$i; sleep 0.25; done", background=True, timeout=0)
    got, broke = [], []

    def read():
        try:
            handle.wait(on_stdout=lambda line: got.append(line))
        except Exception as e:  # noqa: BLE001 — the stream breaks when the gateway dies
            broke.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=read, daemon=True)
    t.start()
    deadline = time.time() + 20
    while len(got) < 4 and time.time() < deadline:
        time.sleep(0.05)
    assert got, "no output streamed through the gateway"
    with Poller(h.c, h.probes.running) as poll:
        h.c.gateway.proc.send_signal(signal.SIGKILL)
        h.c.gateway.proc.wait()
        t_kill = time.time()
        t.join(timeout=30)
        h.c.gateway.start()
        rec = recovery_s(h.c, h.probes.running, t_kill)
    assert broke, "the stream should have broken with its gateway"
    again = Sandbox.connect(p.sid, **h.c.sdk)
    last = max(int(x.strip()[4:]) for x in "".join(got).split() if x.startswith("line"))
    newer = None
    for stdout, _, _ in again.commands.connect(handle.pid):  # the same process, still printing
        nums = [int(x[4:]) for x in (stdout or "").split() if x.startswith("line")]
        if nums and max(nums) > last:
            newer = max(nums)
            break
    again.commands.kill(handle.pid)
    assert newer, "no new output from the process after the gateway came back"
    lost_r, lost_p = h.probes.check()
    record("gateway SIGKILL mid-stream, restarted", running_lost=len(lost_r), paused_lost=len(lost_p), poller=poll,
           recovery=rec, note=f"the stream broke ({broke[0][:60]}); reconnected to pid {handle.pid}: line{newer} "
                               f"after line{last}")
    assert (lost_r, lost_p) == ([], [])


@bench_only
def test_clock_skew(healthy):
    """The gateway's wall clock 45 s ahead, the only sweeping scheduler's 60 s behind,
    node1's 90 s ahead (all session long: tests/chaos/conftest.py): no node is declared
    down or silent, traffic flows, a create and a pause/resume on the skewed node work
    (heartbeats and silences use Redis's clock)."""
    h = healthy
    c = h.c
    h.probes.ensure(running=3, paused=2)
    restore = {p.name: p.env for p in [c.gateway, c.schedulers[1]]}
    try:
        c.schedulers[0].stop()
        for proc, skew in ((c.gateway, 45), (c.schedulers[1], -60)):
            proc.stop()
            proc.env = skewed_env(proc.env, skew)
            proc.start()
        c.wait_nodes({"node0", "node1", "node2"})
        with Poller(c, h.probes.running) as poll, Workload(c, seed=11) as wl:
            t0 = time.time()
            while time.time() - t0 < HEARTBEAT_TIMEOUT_S + 3:
                states = c.node_states()
                assert set(states.values()) == {"up"}, states
                time.sleep(0.5)
            on1 = create_on(c, 1, value=77)  # pause and resume on the skewed node
            Sandbox.connect(on1.sid, **c.sdk).pause()
            Sandbox.connect(on1.sid, **c.sdk)
            assert read_counter(c, on1.sid) == 77
            Sandbox.kill(on1.sid, **c.sdk)
            made = Sandbox.create("base", timeout=60, **c.sdk)
            made.kill()
        lost_r, lost_p = h.probes.check()
        record("clock skew: gateway +45 s, scheduler -60 s, node1 +90 s", running_lost=len(lost_r),
               paused_lost=len(lost_p), poller=poll, recovery=None, workload=wl)
        assert (lost_r, lost_p) == ([], [])
        assert not poll.errors, poll.errors[:5]
    finally:
        for proc in (c.gateway, c.schedulers[1]):
            proc.stop()
            proc.env = restore[proc.name]
            proc.start()
        c.schedulers[0].start()

