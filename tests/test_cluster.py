"""The cluster on one host: real redis-server (AOF), scheduler, gateway and 3 node
processes with real gVisor sandboxes, driven through the official e2b SDK pointed at
the gateway. Each test gets a fresh cluster (≈ 4 s to start) and leaves the host clean.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import httpx

from forkyard.config import Settings
import pytest
import _hostutil as hu
from _cluster import Cluster, assert_clean
from conftest import TEST_ROOT
from e2b import Sandbox, SandboxQuery
from e2b.exceptions import NotFoundException
from test_lifecycle import COUNTER

from forkyard.cluster.types import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S

# COUNTER: a value held only in a running process's memory (GET /set/V stores V, GET
# returns it), reached here through the gateway.


@pytest.fixture
def cluster(base_template):
    """A fresh 3-node cluster; node0 runs at most 17 sandboxes (room for a source + 16)."""
    with Cluster(TEST_ROOT / f"cluster-{os.getpid()}", nodes=3, max_sandboxes={0: 17}).running() as c:
        yield c



def counter(c: Cluster, sbx: Sandbox, set_to: int | None = None, base: str | None = None) -> int:
    """Read (or set) the in-memory counter inside ``sbx`` through the gateway."""
    path = "/" if set_to is None else f"/set/{set_to}"
    deadline = time.time() + 20
    last = None
    while True:
        try:
            r = httpx.get(f"{base or c.gateway_url}{path}", timeout=5,
                          headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
            if r.status_code == 200:
                return int(r.text)
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        if time.time() > deadline:
            raise AssertionError(f"counter in {sbx.sandbox_id} did not answer (last: {last})")
        time.sleep(0.1)


def with_counter(c: Cluster, sbx: Sandbox, value: int) -> None:
    sbx.files.write("/home/user/counter.py", COUNTER)
    sbx.commands.run("python3 /home/user/counter.py", background=True, timeout=0)
    assert counter(c, sbx, set_to=value) == value


def wait_for(pred, timeout_s: float, what: str):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def only_on(c: Cluster, node: str):
    """Context: every node but ``node`` drained (nothing runs on them yet), so new
    sandboxes land on ``node``; undrained afterwards."""

    class _Ctx:
        def __enter__(self):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    if f"node{i}" != node:
                        assert s.post(f"/v1/nodes/node{i}/drain").status_code == 200

        def __exit__(self, *exc):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    s.post(f"/v1/nodes/node{i}/undrain")

    return _Ctx()


def test_sdk_through_gateway_spreads_over_nodes(cluster):
    """Create / commands / files / PTY / list with metadata / pause / resume / snapshot
    through one gateway URL; sandboxes land on all three nodes."""
    c = cluster
    tag = f"t{time.time_ns()}"
    boxes = [Sandbox.create("base", timeout=120, metadata={"run": tag, "i": str(i)}, envs={"WHO": f"w{i}"}, **c.sdk)
             for i in range(3)]
    try:
        owners = [c.owner(b.sandbox_id) for b in boxes]
        assert sorted(owners) == ["node0", "node1", "node2"], owners
        # the SDK's get_host() points at the gateway, not at a node (the node's own domain)
        assert boxes[0].get_host(8000) == f"8000-{boxes[0].sandbox_id}.localhost:{c.gw_port}"
        # each node acknowledged its placement in a heartbeat: nothing stays pending in Redis
        import redis

        r = redis.Redis.from_url(c.redis_url)
        wait_for(lambda: not any(r.hlen(f"fy:placingn:node{i}") for i in range(3)), HEARTBEAT_INTERVAL_S * 4,
                 "every placement to be acknowledged by its node")
        for i, b in enumerate(boxes):
            assert b.commands.run("echo $WHO").stdout.strip() == f"w{i}"
            b.files.write("/home/user/f.txt", f"file {i}")
            assert b.files.read("/home/user/f.txt") == f"file {i}"
        from e2b import PtySize

        term = boxes[1].pty.create(PtySize(rows=24, cols=80))
        boxes[1].pty.send_stdin(term.pid, b"echo pty-$((6*7)); exit 0\n")
        out = bytearray()
        term.wait(on_pty=out.extend)
        assert b"pty-42" in out
        listed = Sandbox.list(query=SandboxQuery(metadata={"run": tag}), **c.sdk).next_items()
        assert sorted(s.sandbox_id for s in listed) == sorted(b.sandbox_id for b in boxes)
        with c.api() as api:  # E2B pagination across nodes
            r = api.get("/v2/sandboxes", params={"metadata": f"run={tag}", "limit": 2})
            assert len(r.json()) == 2 and r.headers.get("x-next-token")
            r2 = api.get("/v2/sandboxes", params={"metadata": f"run={tag}", "limit": 2,
                                                   "nextToken": r.headers["x-next-token"]})
            assert len(r2.json()) == 1
            assert {x["sandboxID"] for x in r.json() + r2.json()} == {b.sandbox_id for b in boxes}
            m = api.get("/metrics/node").json()
            assert m["sandboxes"]["running"] == 3 and {n["nodeID"] for n in m["nodes"]} == {"node0", "node1", "node2"}
            assert api.get(f"/sandboxes/{boxes[0].sandbox_id}/metrics").status_code == 200
        # pause + resume (same node while it is up), memory kept
        with_counter(c, boxes[2], 31)
        boxes[2].pause()
        states = {s.sandbox_id: s.state for s in Sandbox.list(query=SandboxQuery(metadata={"run": tag}), **c.sdk).next_items()}
        assert states[boxes[2].sandbox_id] == "paused"
        # no hot pause in a cluster (the paused sandbox may resume on another node): no
        # node keeps a frozen copy, and its pool is off too
        for url in c.node_urls:
            node = httpx.get(f"{url}/metrics/node", headers={"X-API-Key": c.api_key}, timeout=10).json()
            assert node["hotPaused"] == 0 and not node.get("pool"), node
        again = Sandbox.connect(boxes[2].sandbox_id, **c.sdk)
        assert counter(c, again) == 31 and again.files.read("/home/user/f.txt") == "file 2"
        # snapshot, then create from it (placed anywhere; the repository is shared)
        snap = boxes[0].create_snapshot(name=f"snap-{tag}")
        child = Sandbox.create(snap.snapshot_id, timeout=60, **c.sdk)
        assert child.files.read("/home/user/f.txt") == "file 0"
        child.kill()
    finally:
        for b in boxes:
            b.kill()
    assert Sandbox.list(query=SandboxQuery(metadata={"run": tag}), **c.sdk).next_items() == []


def test_fork_of_24_spills_to_other_nodes(cluster):
    """node0 has room for 16 children beside the source: a fork of 24 puts 16 there and
    8 on the other nodes, every child with the source's memory (counter) and files."""
    c = cluster
    with only_on(c, "node0"):
        src = Sandbox.create("base", timeout=300, **c.sdk)
    try:
        assert c.owner(src.sandbox_id) == "node0"
        with_counter(c, src, 7)
        src.files.write("/home/user/who.txt", "source")
        with c.api() as api:
            r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 24, "timeout": 120}, timeout=600)
        assert r.status_code == 201, r.text
        results = r.json()
        assert len(results) == 24 and all("sandbox" in x for x in results), results
        kids = [x["sandbox"]["sandboxID"] for x in results]
        placed = Counter(c.owner(k) for k in kids)
        assert placed["node0"] == 16 and placed["node1"] + placed["node2"] == 8, (placed, _holders(c, kids))
        for k in kids:
            kid = Sandbox.connect(k, **c.sdk)
            try:
                assert counter(c, kid) == 7
            except AssertionError as e:
                raise AssertionError(f"{e}; bindings: {_holders(c, [k])}") from None
            assert kid.files.read("/home/user/who.txt") == "source"
            assert kid.get_info().metadata["forkyard.parentSandboxID"] == src.sandbox_id
        assert counter(c, src) == 7  # the source keeps running
        # the one checkpoint was exported to the repository and deleted once every child ran
        image = Sandbox.connect(kids[-1], **c.sdk).get_info().metadata["forkyard.snapshotID"]
        assert not (c.root / "repository" / "manifests" / f"{image}.json").exists()
        assert {Sandbox.connect(k, **c.sdk).get_info().metadata["forkyard.snapshotID"] for k in kids} == {image}
        with c.api() as api:
            for k in kids:
                assert api.delete(f"/sandboxes/{k}").status_code == 204
    finally:
        src.kill()


def test_a_sandbox_killed_for_its_memory_says_why_through_the_gateway(cluster):
    """The OOM cause a node records (forkyard.orchestrator.tombstones) reaches the
    gateway: its REST 404 and proxy 502 name it, as a single node's do."""
    c = cluster
    sbx = Sandbox.create("base", timeout=120, **c.sdk)
    sid = sbx.sandbox_id
    err = hu.oom_kill_sandbox(sbx)
    assert "out of memory (limit 512 MiB)" in str(err)
    with c.api() as api:
        # once the node's deletion is published, the gateway answers from Redis
        wait_for(lambda: c.owner(sid) is None, 10, "the dead sandbox's binding to be dropped")
        info = api.get(f"/sandboxes/{sid}")
        assert info.status_code == 404 and "it was killed: out of memory (limit 512 MiB)" in info.json()["message"], info.text
    proxied = httpx.get(f"{c.gateway_url}/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"},
                        timeout=30)
    assert proxied.status_code == 502 and "out of memory" in proxied.json()["message"], proxied.text


def _holders(c: Cluster, ids: list[str]) -> dict[str, tuple[str | None, list[str]]]:
    """``{id: (bound node, [nodes whose own API has it])}`` for a failure message."""
    out = {}
    for k in ids:
        have = []
        for i, url in enumerate(c.node_urls):
            r = httpx.get(f"{url}/sandboxes/{k}", headers={"X-API-Key": c.api_key}, timeout=10)
            if r.status_code == 200:
                have.append(f"node{i}")
        out[k] = (c.owner(k), have)
    return out


def test_node_sigkill(cluster):
    """SIGKILL a node: its paused sandbox resumes on another node at once (memory and
    files), within the heartbeat timeout its running sandbox answers E2B's 404; a
    snapshot taken there still creates sandboxes. When the node comes back it destroys
    the sandbox that was reported gone (its runsc container included) and drops the one
    that moved."""
    c = cluster
    with only_on(c, "node0"):
        run = Sandbox.create("base", timeout=300, **c.sdk)
        paused = Sandbox.create("base", timeout=300, **c.sdk)
    assert c.owner(run.sandbox_id) == c.owner(paused.sandbox_id) == "node0"
    with_counter(c, paused, 5)
    paused.files.write("/home/user/keep.txt", "kept")
    paused.pause()
    snap = run.create_snapshot(name="before-crash")
    c.nodes[0].stop(sig_kill=True)
    t0 = time.time()
    # resumed at once, before node0 is declared down: moved at the first try (it answered
    # 502 for ~5 s: the gateway sent the call to the dead node)
    moved = Sandbox.connect(paused.sandbox_id, **c.sdk)
    assert c.owner(paused.sandbox_id) in ("node1", "node2")
    with c.api() as api:
        wait_for(lambda: api.get(f"/sandboxes/{run.sandbox_id}").status_code == 404, HEARTBEAT_TIMEOUT_S + 5,
                 "the dead node's running sandbox to be reported gone")
        elapsed = time.time() - t0
        body = api.get(f"/sandboxes/{run.sandbox_id}").json()
        assert body["code"] == 404 and run.sandbox_id in body["message"]
    assert elapsed <= HEARTBEAT_TIMEOUT_S + 2, elapsed
    with pytest.raises(NotFoundException):
        Sandbox.connect(run.sandbox_id, **c.sdk)
    assert counter(c, moved) == 5 and moved.files.read("/home/user/keep.txt") == "kept"
    from_snap = Sandbox.create("before-crash", timeout=60, **c.sdk)
    assert c.owner(from_snap.sandbox_id) in ("node1", "node2")
    from_snap.kill()
    # node0 comes back: the gone sandbox's runtime is destroyed, the moved one dropped
    c.nodes[0].start()
    node0 = httpx.Client(base_url=c.node_urls[0], headers={"X-API-Key": c.api_key}, timeout=30)
    wait_for(lambda: node0.get("/v2/sandboxes").json() == [], 20, "node0 to drop what it no longer owns")
    runsc_root = c.root / "node0" / "runsc"
    listed = subprocess.run([Settings().runsc, f"--root={runsc_root}", "list", "-quiet"], capture_output=True, text=True)
    assert run.sandbox_id not in listed.stdout
    assert counter(c, moved) == 5  # the moved sandbox is untouched
    moved.kill()
    Sandbox.delete_snapshot(snap.snapshot_id, **c.sdk)


def test_fs_paused_sandbox_resumes_on_another_node(cluster):
    """A filesystem-only pause (SDK ``mode="filesystem"``) answers after its image is in
    the shared repository; with its node SIGKILLed, connect cold-boots it on another
    node over its files (processes gone, a new boot id)."""
    c = cluster
    with only_on(c, "node0"):
        p = Sandbox.create("base", timeout=300, **c.sdk)
    assert c.owner(p.sandbox_id) == "node0"
    p.files.write("/home/user/keep.txt", "kept")
    bg = p.commands.run("sleep 1000", background=True)
    boot = p.commands.run("cat /proc/sys/kernel/random/boot_id").stdout
    with c.api() as api:
        r = api.post(f"/sandboxes/{p.sandbox_id}/pause", json={"memory": False})
        assert r.status_code == 204, r.text
        assert "export;" in r.headers.get("server-timing", "") and "commit;" in r.headers["server-timing"]
    c.nodes[0].stop(sig_kill=True)
    wait_for(lambda: c.node_states().get("node0") == "down", HEARTBEAT_TIMEOUT_S + 5, "node0 to be down")
    moved = Sandbox.connect(p.sandbox_id, **c.sdk)
    assert c.owner(p.sandbox_id) in ("node1", "node2")
    assert moved.files.read("/home/user/keep.txt") == "kept"
    assert bg.pid not in [x.pid for x in moved.commands.list()]
    assert moved.commands.run("cat /proc/sys/kernel/random/boot_id").stdout != boot
    moved.kill()


def test_scheduler_and_gateway_restarts(cluster):
    """Scheduler SIGKILL: running sandboxes keep being served (the gateway reads
    bindings from Redis), creates answer a clear 503, and after a restart no binding
    is lost and placements continue. Gateway SIGKILL + restart: clients' retries work;
    a second gateway serves the same sandboxes."""
    c = cluster
    a = Sandbox.create("base", timeout=300, **c.sdk)
    owner = c.owner(a.sandbox_id)
    c.scheduler.stop(sig_kill=True)
    assert a.commands.run("echo still").stdout.strip() == "still"
    with c.api() as api:
        r = api.post("/sandboxes", json={"templateID": "base"})
        assert r.status_code == 503 and "scheduler" in r.json()["message"]
    c.scheduler.start()
    assert c.owner(a.sandbox_id) == owner
    b = Sandbox.create("base", timeout=60, **c.sdk)
    c.gateway.stop(sig_kill=True)
    c.gateway.start()
    assert a.commands.run("echo after").stdout.strip() == "after"
    assert Sandbox.connect(b.sandbox_id, **c.sdk).commands.run("echo b").stdout.strip() == "b"
    # a second, independent gateway
    from conftest import free_port

    from _cluster import Proc

    port = free_port()
    gw2 = Proc("gateway2", c.gateway.argv[:-1] + [str(port)], c.env, c.root / "gateway2.log",
               f"http://127.0.0.1:{port}/health")
    gw2.start()
    try:
        url2 = f"http://127.0.0.1:{port}"
        via2 = Sandbox.connect(a.sandbox_id, api_url=url2, sandbox_url=url2, api_key=c.api_key)
        assert via2.commands.run("echo two").stdout.strip() == "two"
    finally:
        gw2.stop()
    a.kill()
    b.kill()


def test_a_sandbox_made_just_before_the_scheduler_went_is_not_a_404(cluster):
    """A create answered while the scheduler went away is not published (the node
    publishes through the scheduler, and answers anyway after PUBLISH_WAIT_S), and for the
    first seconds no heartbeat is late yet: the gateway that made it asks its node
    instead of answering 404 (stop 30's long chaos run saw "Paused sandbox … not found"
    from the SDK there). Unpublished is made certain here: the scheduler is stopped and
    the sandbox's binding removed from Redis, as if it had never been published."""
    import redis

    c = cluster
    sbx = Sandbox.create("base", timeout=300, **c.sdk)
    sid = sbx.sandbox_id
    c.scheduler.signal(signal.SIGSTOP)
    try:
        r = redis.Redis.from_url(c.redis_url)
        r.delete(f"fy:sbx:{sid}")
        r.srem("fy:sandboxes", sid)
        t0 = time.monotonic()
        with c.api() as api:
            got = api.get(f"/sandboxes/{sid}")
        took = time.monotonic() - t0
        assert got.status_code == 200 and got.json()["sandboxID"] == sid, (got.status_code, got.text, took)
        assert Sandbox.connect(sid, **c.sdk).commands.run("echo here").stdout == "here\n"
    finally:
        c.scheduler.signal(signal.SIGCONT)
    wait_for(lambda: c.owner(sid) is not None, 20, "the node to publish the binding again")
    sbx.kill()


def test_redis_restart_and_outage(cluster):
    """Redis restarted (AOF on): nothing lost. Redis down: the gateway answers 503 with
    a message naming Redis; when it is back everything works again."""
    c = cluster
    a = Sandbox.create("base", timeout=300, metadata={"k": "redis"}, **c.sdk)
    p = Sandbox.create("base", timeout=300, **c.sdk)
    p.pause()
    owner = c.owner(a.sandbox_id)
    c.restart_redis()
    assert c.owner(a.sandbox_id) == owner
    states = {s.sandbox_id: s.state for s in Sandbox.list(**c.sdk).next_items()}
    assert states == {a.sandbox_id: "running", p.sandbox_id: "paused"}
    c.redis.stop()
    try:
        with c.api() as api:
            r = api.get("/v2/sandboxes")
            assert r.status_code == 503 and "Redis" in r.json()["message"]
            r = api.post("/sandboxes", json={"templateID": "base"})
            assert r.status_code == 503
            assert httpx.get(f"{c.gateway_url}/health").status_code == 503
    finally:
        c.redis.start()
        c._wait_redis()
    wait_for(lambda: c.node_states() == {"node0": "up", "node1": "up", "node2": "up"}, 15, "nodes to be up again")
    assert a.commands.run("echo back").stdout.strip() == "back"
    assert Sandbox.connect(p.sandbox_id, **c.sdk).commands.run("echo p").stdout.strip() == "p"
    b = Sandbox.create("base", timeout=60, **c.sdk)
    for s in (a, p, b):
        s.kill()


def test_drain(cluster):
    """``forkyard node drain``: no new placements on the node, its running sandboxes are
    paused to the repository and then resume elsewhere with their memory. A connect sent
    right after the drain began never resumes on the draining node (it did, 2 of 3
    tries: the node paused the sandbox for the drain, then the waiting connect resumed it
    there); ``--wait`` returns once the node is drained; ``node which`` shows the owner."""
    c = cluster
    with only_on(c, "node1"):
        a, b, d = (Sandbox.create("base", timeout=300, **c.sdk) for _ in range(3))
    for i, s in enumerate((a, b, d)):
        with_counter(c, s, 11 + i)
    with c.sched() as sc:
        assert sc.post("/v1/nodes/node1/drain").status_code == 200
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # connects during the drain
        back = list(pool.map(lambda s: Sandbox.connect(s.sandbox_id, timeout=300, **c.sdk), (b, d)))
    for s, want in zip(back, (12, 13)):
        assert c.owner(s.sandbox_id) != "node1", _holders(c, [s.sandbox_id])
        assert counter(c, s) == want
    env = dict(c.env)
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "node", "drain", "node1", "--wait"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "node node1 is drained" in out.stdout, (out.stdout, out.stderr)
    assert {s.sandbox_id: s.state for s in Sandbox.list(**c.sdk).next_items()}[a.sandbox_id] == "paused"
    assert time.time() - t0 < 120
    news = [Sandbox.create("base", timeout=60, **c.sdk) for _ in range(3)]
    assert "node1" not in {c.owner(n.sandbox_id) for n in news}
    back_a = Sandbox.connect(a.sandbox_id, **c.sdk)
    assert c.owner(a.sandbox_id) != "node1"
    assert counter(c, back_a) == 11
    ls = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "node", "ls", "--json"], env=env,
                        capture_output=True, text=True, timeout=60)
    import json

    assert {n["nodeID"]: n["status"] for n in json.loads(ls.stdout)}["node1"] == "draining"
    piped = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "node", "ls"], env=env,
                           capture_output=True, text=True, timeout=60)  # as every list command: ids when piped
    assert sorted(piped.stdout.split()) == sorted(n["nodeID"] for n in json.loads(ls.stdout)), piped.stdout
    which = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "node", "which", "--json", a.sandbox_id],
                           env=env, capture_output=True, text=True, timeout=60)
    assert json.loads(which.stdout) == [{"sandboxID": a.sandbox_id, "nodeID": c.owner(a.sandbox_id), "state": "running"}]
    with c.api() as api:  # the listing says where each sandbox is, too
        listed = {x["sandboxID"]: x["nodeID"] for x in api.get("/v2/sandboxes").json()}
    assert listed[a.sandbox_id] == c.owner(a.sandbox_id)
    for s in news + [back_a] + back:
        s.kill()


def test_a_node_undrained_since_its_last_heartbeat_serves_a_wake_the_gateway_sends(cluster):
    """A node hears of an undrain at its next heartbeat (up to 1 s later); a connect the
    gateway sent in between was refused 409 "draining" on every retry (the gateway, which
    read the node as up, kept it there: test_p2p_cluster failed so in CI). The gateway
    sends the status it read and the node, told ``0`` while it believes it drains, asks
    the scheduler at once: the paused sandbox resumes on its node. Three rounds, so the
    old race shows in nearly every run."""
    c = cluster
    with only_on(c, "node0"):
        boxes = [Sandbox.create("base", timeout=300, **c.sdk) for _ in range(3)]
    for i, s in enumerate(boxes):
        with_counter(c, s, 30 + i)
        s.pause()
    log = c.root / "node0.log"
    for i, s in enumerate(boxes):
        heard = log.read_text().count("draining: pausing")
        with c.sched() as sc:
            assert sc.post("/v1/nodes/node0/drain").status_code == 200
        wait_for(lambda: log.read_text().count("draining: pausing") > heard, 10, "node0 to hear of its drain")
        with c.sched() as sc:
            assert sc.post("/v1/nodes/node0/undrain").status_code == 200
        back = Sandbox.connect(s.sandbox_id, timeout=300, **c.sdk)  # before node0's next heartbeat
        assert c.owner(back.sandbox_id) == "node0"
        assert counter(c, back) == 30 + i
        back.kill()


def test_two_schedulers_move_a_paused_sandbox_once(cluster):
    """Two scheduler replicas asked at once to place the paused sandbox of a dead node
    agree on one node and move it exactly once."""
    c = cluster
    with only_on(c, "node2"):
        p = Sandbox.create("base", timeout=300, **c.sdk)
    with_counter(c, p, 3)
    p.pause()
    c.nodes[2].stop(sig_kill=True)
    wait_for(lambda: c.node_states().get("node2") == "down", HEARTBEAT_TIMEOUT_S + 5, "node2 to be down")
    from conftest import free_port

    from _cluster import Proc

    port = free_port()
    s2 = Proc("scheduler2", c.scheduler.argv[:-1] + [str(port)], c.env, c.root / "scheduler2.log",
              f"http://127.0.0.1:{port}/health")
    s2.start()
    try:
        urls = [c.scheduler_url, f"http://127.0.0.1:{port}"] * 6

        def ask(url):
            return httpx.post(f"{url}/v1/placements", json={"kind": "resume", "sandboxID": p.sandbox_id},
                              headers={"x-forkyard-cluster-secret": c.secret}, timeout=30).json()

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, urls))
    finally:
        s2.stop()
    assert all("placements" in a for a in answers), answers
    assert len({a["placements"][0]["nodeID"] for a in answers}) == 1, answers
    assert sum(1 for a in answers if a.get("moved")) == 1, answers
    back = Sandbox.connect(p.sandbox_id, **c.sdk)
    assert counter(c, back) == 3
    back.kill()


def test_moved_paused_sandbox_is_adopted_without_the_adopt_call(cluster):
    """The scheduler moves a dead node's paused sandbox to another node, and the adopt
    call that normally follows never comes (say the gateway died in between): the
    target's next heartbeats must adopt it, not drop the binding (it was lost: 404)."""
    c = cluster
    with only_on(c, "node2"):
        p = Sandbox.create("base", timeout=300, **c.sdk)
    with_counter(c, p, 5)
    p.pause()
    c.nodes[2].stop(sig_kill=True)
    wait_for(lambda: c.node_states().get("node2") == "down", HEARTBEAT_TIMEOUT_S + 5, "node2 to be down")
    r = httpx.post(f"{c.scheduler_url}/v1/placements", json={"kind": "resume", "sandboxID": p.sandbox_id},
                   headers={"x-forkyard-cluster-secret": c.secret}, timeout=30).json()
    assert r.get("moved") is True, r
    target = r["placements"][0]["nodeID"]
    time.sleep(3 * HEARTBEAT_INTERVAL_S + 1)  # several heartbeats of the target, no adopt call
    assert c.owner(p.sandbox_id) == target
    back = Sandbox.connect(p.sandbox_id, **c.sdk)
    assert counter(c, back) == 5
    back.kill()


def test_cluster_auth(cluster):
    """Users need the API key at the gateway (checked before the body is read); the
    control plane needs the cluster secret, which is not the API key."""
    c = cluster
    with httpx.Client(timeout=10) as h:
        assert h.get(f"{c.gateway_url}/v2/sandboxes").status_code == 401
        assert h.get(f"{c.gateway_url}/v2/sandboxes", headers={"X-API-Key": "wrong"}).status_code == 401
        # a large keyless body is refused at once, without being read
        t0 = time.time()
        r = h.post(f"{c.gateway_url}/sandboxes", content=b"x" * (64 << 20))
        assert r.status_code == 401 and time.time() - t0 < 5
        assert h.get(f"{c.scheduler_url}/v1/nodes").status_code == 401
        assert h.get(f"{c.scheduler_url}/v1/nodes", headers={"x-forkyard-cluster-secret": c.api_key}).status_code == 401
        assert h.post(f"{c.node_urls[0]}/cluster/adopt", json={"id": "x"},
                      headers={"X-API-Key": c.api_key}).status_code == 401
        assert h.get(f"{c.scheduler_url}/health").status_code == 200
        # The gateway never relays node-internal calls (it would add the secret to them)
        key = {"X-API-Key": c.api_key}
        for method, path in [("POST", "/cluster/adopt"), ("DELETE", "/cluster/images/x"), ("POST", "/cluster/fork-children"),
                             ("POST", "/cluster/sandboxes/x/fork"), ("GET", "/cluster")]:
            r = h.request(method, f"{c.gateway_url}{path}", json={"id": "x"}, headers=key)
            assert r.status_code == 404 and "not part of the API" in r.text, (path, r.status_code, r.text)
        # and a node takes only records shaped as forkyard writes them (ids name host paths)
        secret = {"x-forkyard-cluster-secret": c.nodes[0].env["FORKYARD_NODE_KEY"]}  # node0's own key
        record = {"template_id": "base", "state": "paused", "slot": None, "vcpus": 2, "memory_mb": 512,
                  "started_at": 0, "end_at": 0, "auto_pause": True, "image_id": "snapx"}
        for bad in [{"id": "."}, {"id": "../../tmp/x"}, {"id": "ok1", "disk_mb": -1}, {"id": "ok1", "vcpus": 10**6},
                    {"id": "ok1", "image_id": "../x"}]:
            r = h.post(f"{c.node_urls[0]}/cluster/adopt", json={**record, **bad}, headers=secret)
            assert r.status_code == 400, (bad, r.status_code, r.text)


def test_gateway_routes_websocket_host_form_cli_and_client(cluster):
    """Through the gateway: WebSocket by headers and by host ``PORT-ID.DOMAIN``, plain
    HTTP by host form, the ``forkyard`` CLI and the async client (fork, list)."""
    import asyncio
    import json
    import socket

    from test_proxy_ws import WS_ECHO
    from websockets.sync.client import connect

    from forkyard.client import AsyncForkyard

    c = cluster
    sbx = Sandbox.create("base", timeout=120, **c.sdk)
    try:
        sbx.files.write("/home/user/ws.py", WS_ECHO)
        sbx.commands.run("python3 /home/user/ws.py", background=True, timeout=0)
        with_counter(c, sbx, 9)
        hdrs = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8765"}
        ws = wait_for(lambda: _try(lambda: connect(f"ws://127.0.0.1:{c.gw_port}/echo", additional_headers=hdrs,
                                                   open_timeout=5)), 20, "the WebSocket echo server")
        with ws:
            ws.send("hello")
            assert ws.recv(timeout=10) == "hello"
        sock = socket.create_connection(("127.0.0.1", c.gw_port), timeout=10)
        with connect(f"ws://8765-{sbx.sandbox_id}.localhost:{c.gw_port}/", sock=sock, open_timeout=5) as ws2:
            ws2.send("via host")
            assert ws2.recv(timeout=10) == "via host"
        r = httpx.get(f"{c.gateway_url}/", headers={"Host": f"8000-{sbx.sandbox_id}.localhost"}, timeout=10)
        assert r.status_code == 200 and r.text == "9"
        # 1 MiB GETs take the fast path on the gateway too (spliced towards the client).
        sbx.commands.run("mkdir -p /tmp/www && head -c 1048576 /dev/urandom > /tmp/www/big.bin", timeout=30)
        want = sbx.commands.run("sha256sum /tmp/www/big.bin").stdout.split()[0]
        sbx.commands.run("cd /tmp/www && python3 -m http.server 8001 >/dev/null 2>&1", background=True, timeout=0)
        big = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8001"}
        wait_for(lambda: _try(lambda: httpx.get(f"{c.gateway_url}/big.bin", headers=big, timeout=10).status_code == 200),
                 20, "http.server in the sandbox")
        before = _spliced(c.gateway_url, c.api_key)
        with httpx.Client(timeout=30) as h:
            for _ in range(5):
                r = h.get(f"{c.gateway_url}/big.bin", headers=big)
                assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == want
        assert _spliced(c.gateway_url, c.api_key) - before >= 5 * ((1 << 20) - (64 << 10))
        env = dict(c.env, E2B_API_URL=c.gateway_url, E2B_SANDBOX_URL=c.gateway_url, E2B_API_KEY=c.api_key)
        out = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "ls", "--json"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert sbx.sandbox_id in {s["sandboxID"] for s in json.loads(out.stdout)}
        out = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "exec", sbx.sandbox_id, "--", "echo", "via-cli"],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "via-cli" in out.stdout, out.stderr

        async def client_flow():
            async with AsyncForkyard(url=c.gateway_url, api_key=c.api_key) as fy:
                kids = await fy.fork_info(sbx.sandbox_id, 2, timeout=60)
                assert len(kids) == 2 and all(hasattr(k, "sandbox_id") for k in kids), kids
                listed = {s.sandbox_id for s in await fy.list_sandboxes()}
                assert {k.sandbox_id for k in kids} <= listed
                for k in kids:
                    await fy.kill(k.sandbox_id)

        asyncio.run(client_flow())
    finally:
        sbx.kill()


def _spliced(url: str, key: str) -> float:
    """``forkyard_proxy_spliced_bytes_total`` of the process at ``url``."""
    r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    r.raise_for_status()
    return float(next(x for x in r.text.splitlines() if x.startswith("forkyard_proxy_spliced_bytes_total ")).split()[1])


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 — retried by wait_for
        return None


def test_template_build_through_gateway(cluster, tmp_path):
    """The SDK's ``Template.build`` (with a COPY step, so its signed upload URL must point
    back at the gateway) through the gateway; the built template starts on every node."""
    from e2b import Template

    c = cluster
    (tmp_path / "hello.txt").write_text("copied through the gateway\n")
    name = f"gw-{os.getpid()}"
    tmpl = Template(file_context_path=tmp_path).from_template("base").copy("hello.txt", "/home/user/")
    Template.build(tmpl, name, api_key=c.api_key, api_url=c.gateway_url)
    try:
        for i in range(3):  # one on each node (one at a time: a drained node pauses what it runs)
            with only_on(c, f"node{i}"):
                b = Sandbox.create(name, timeout=60, **c.sdk)
            try:
                assert c.owner(b.sandbox_id) == f"node{i}"
                assert b.files.read("/home/user/hello.txt") == "copied through the gateway\n"
            finally:
                b.kill()
    finally:
        with c.api() as api:
            api.delete(f"/templates/{name}")


def test_a_create_a_node_refuses_for_memory_goes_to_another_node(base_template):
    """A node whose memory admission refuses every start (here its host-memory floor is
    99 %: the scheduler, which counts sandboxes, still sees room there) answers creates
    503; the gateway places each such create again elsewhere, so every create of the
    SDK succeeds, all on the other node."""
    c = Cluster(TEST_ROOT / f"cluster-{os.getpid()}", nodes=2)
    c.nodes[0].env["FORKYARD_MIN_AVAILABLE_MEMORY_PCT"] = "99"
    try:
        c.start()
        made = [Sandbox.create("base", timeout=60, **c.sdk) for _ in range(4)]
        try:
            assert {c.owner(s.sandbox_id) for s in made} == {"node1"}
            assert all(s.commands.run("echo ok").stdout == "ok\n" for s in made)
        finally:
            for s in made:
                s.kill()
        log = (c.root / "gateway.log").read_text()
        assert "node node0 refused a create (503" in log  # the scheduler did place creates there
    finally:
        c.close()
        assert_clean(c)


def test_a_reused_net_prefix_is_refused():
    """Two nodes on one host with the same FORKYARD_NET_PREFIX would remove each other's
    network slots: the second is refused at start with a message naming the setting and
    the process that holds the prefix."""
    hold = subprocess.Popen([sys.executable, "-c", "from forkyard.cli.serve import lock_net_prefix as l; "
                             "l('zzq'); print('held', flush=True); import time; time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert hold.stdout.readline().strip() == "held"
        out = subprocess.run([sys.executable, "-c", "from forkyard.cli.serve import lock_net_prefix as l; l('zzq')"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 1 and "FORKYARD_NET_PREFIX" in out.stderr + out.stdout
        assert f"held by pid {hold.pid} (" in out.stderr + out.stdout, out.stderr
    finally:
        hold.kill()
        hold.wait()
    ok = subprocess.run([sys.executable, "-c", "from forkyard.cli.serve import lock_net_prefix as l; l('zzq')"],
                        capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr


def test_what_a_dead_node_or_gateway_leaves_is_moved_expired_and_collected(base_template):
    """A node down past FORKYARD_ORPHAN_MOVE_S has its paused sandboxes moved to a live
    node without any client call; there its retention deletes them on time (before, a
    node that never came back kept them forever: retention runs on the owning node).
    A fork image a gateway never deleted (it died mid-fork) is deleted by a node's image
    GC once older than FORKYARD_FORK_IMAGE_TTL_S."""
    c = Cluster(TEST_ROOT / f"cluster-orphans-{os.getpid()}", nodes=2)
    c.scheduler.env = dict(c.scheduler.env, FORKYARD_ORPHAN_MOVE_S="1")
    for n in c.nodes:
        n.env = dict(n.env, FORKYARD_PAUSED_RETENTION_S="20", FORKYARD_FORK_IMAGE_TTL_S="5")
    try:
        c.start()
        with only_on(c, "node0"):
            sbx = Sandbox.create("base", timeout=300, **c.sdk)
        # the first half of a cross-node fork, as a gateway that then died left it
        r = httpx.post(f"{c.node_urls[0]}/cluster/sandboxes/{sbx.sandbox_id}/fork", json={"count": 0, "timeout": 60},
                       headers={"x-forkyard-cluster-secret": c.nodes[0].env["FORKYARD_NODE_KEY"]}, timeout=120)
        assert r.status_code == 200, r.text
        fork_manifest = c.root / "repository" / "manifests" / f"{r.json()['image']}.json"
        assert fork_manifest.exists()
        sbx.files.write("/home/user/keep.txt", "kept")
        sbx.pause()
        paused_at = time.time()
        with c.sched() as sc:
            bound = sc.get(f"/v1/sandboxes/{sbx.sandbox_id}").json()
        assert bound["nodeID"] == "node0" and bound["state"] == "paused"
        manifest = c.root / "repository" / "manifests" / f"{bound['record']['image_id']}.json"
        assert manifest.exists()
        c.nodes[0].stop(sig_kill=True)
        node1 = httpx.Client(base_url=c.node_urls[1], headers={"X-API-Key": c.api_key}, timeout=30)
        # moved and adopted by node1 with no call for it
        wait_for(lambda: node1.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 200, HEARTBEAT_TIMEOUT_S + 8,
                 "node1 to adopt the paused sandbox of the dead node")
        assert c.owner(sbx.sandbox_id) == "node1"
        assert time.time() - paused_at < 18, "moved too late for the retention check below to mean anything"
        # retention (20 s from the pause) deletes it on node1, binding and image included
        with c.api() as api:
            wait_for(lambda: api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404, 40,
                     "retention to delete the moved paused sandbox")
        assert time.time() - paused_at >= 19
        assert c.owner(sbx.sandbox_id) is None
        wait_for(lambda: not manifest.exists(), 30, "the pause image to be deleted from the repository")
        wait_for(lambda: not fork_manifest.exists(), 70, "the stale fork image to be deleted")
    finally:
        c.close()
        assert_clean(c)
