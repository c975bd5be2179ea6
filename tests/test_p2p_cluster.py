"""P2P chunk transport in a real cluster on this host (issue 24): redis-server,
scheduler, gateway and 3 node processes with ``FORKYARD_P2P=on`` (iroh endpoints on
127.0.0.1, no relay), real gVisor sandboxes through the e2b SDK.

tests/test_p2p.py covers a corrupt chunk and a peer going away mid-restore between
real stores; here: a sandbox paused on node0 resumes on another node from node0's
cache, a 24-way fork spread over the 3 nodes and a template's first start on each node
read most chunks from peers (counted per source in /metrics/repository and Prometheus;
each sandbox checked for the source's process memory and files), an iroh endpoint
outside the cluster is refused, and P2P off stays as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import Counter

import httpx
import pytest
from _cluster import Cluster
from conftest import TEST_ROOT
from e2b import Sandbox
from test_cluster import counter, only_on, wait_for, with_counter

from forkyard.repository import SnapshotStore
from forkyard.repository.config import RepoConfig
from forkyard.repository.p2p import ChunkService, Peer
from forkyard.repository.p2p import service as p2psvc

# A 15 s request timeout (default 5): on this 2-core host a fork of 24 restores 24
# sandboxes at once, and a serving node's answers can take longer than 5 s then (CI, stop
# 33: node0 answered 8 requests of each node, then 4 in flight timed out); these tests
# show where chunks come from, not how long a starved peer is waited for.
P2P_ENV = {"FORKYARD_P2P": "on", "FORKYARD_P2P_BIND": "127.0.0.1:0", "FORKYARD_P2P_TIMEOUT_S": "15"}


def _p2p_log(c: Cluster, lines: int = 12) -> str:
    """The last P2P lines each node logged (why a peer failed: its error kind and text),
    for a failure message."""
    out = []
    for i in range(len(c.nodes)):
        log = c.root / f"node{i}.log"
        got = [x for x in log.read_text(errors="replace").splitlines() if "P2P" in x] if log.exists() else []
        out.append(f"node{i}: " + ("\n  ".join(got[-lines:]) or "(no P2P line)"))
    return "\n".join(out)


@contextlib.contextmanager
def _cluster(env: dict | None, nodes: int = 3, max_sandboxes: dict[int, int] | None = None):
    with Cluster(TEST_ROOT / f"p2p-cluster-{os.getpid()}", nodes=nodes, env=env,
                 max_sandboxes=max_sandboxes).running() as c:
        yield c


@pytest.fixture
def p2p_cluster(base_template):
    """A fresh 3-node cluster with P2P on."""
    with _cluster(P2P_ENV) as c:
        yield c


def _repo_metrics(c: Cluster, node: str) -> dict:
    url = c.node_urls[int(node.removeprefix("node"))]
    return httpx.get(f"{url}/metrics/repository", headers={"X-API-Key": c.api_key}, timeout=10).json()


def _pause_on_node0_resume_elsewhere(c: Cluster) -> tuple[Sandbox, str]:
    with only_on(c, "node0"):
        sbx = Sandbox.create("base", timeout=300, **c.sdk)
    assert c.owner(sbx.sandbox_id) == "node0"
    with_counter(c, sbx, 42)
    sbx.files.write("/home/user/keep.txt", "kept")
    sbx.pause()
    with c.sched() as s:  # node0 takes nothing new: the resume goes to another node
        assert s.post("/v1/nodes/node0/drain").status_code == 200
    moved = Sandbox.connect(sbx.sandbox_id, timeout=300, **c.sdk)
    where = c.owner(sbx.sandbox_id)
    assert where in ("node1", "node2")
    assert counter(c, moved) == 42 and moved.files.read("/home/user/keep.txt") == "kept"
    return moved, where


def test_resume_on_another_node_reads_chunks_from_the_node_that_paused(p2p_cluster):
    """Paused on node0 (committed to the repository as always), resumed on node1/2: the
    restoring node reads the image's chunks from node0 over iroh — most of them, counted
    in its /metrics/repository — and the sandbox has its memory and files."""
    c = p2p_cluster
    with c.sched() as s:  # every node advertises its iroh address in its heartbeat
        wait_for(lambda: all((n["report"].get("p2p") or {}).get("addrs") for n in s.get("/v1/nodes").json()),
                 10, "every node to report its P2P address")
    for attempt in range(2):
        # (Under load the resuming node's first dial to node0 timed out in ~1 of 6 runs
        # and every chunk then came from the repository — correct, but not what this test
        # shows. Cause: iroh rebinds its sockets at every link change (each sandbox start)
        # and a dial meanwhile can stall; members' connections are now opened when they
        # are listed (docs/architecture.md, the flaky first dial). Should it still
        # happen: once more.)
        before = {n: _repo_metrics(c, n) for n in ("node1", "node2")}
        moved, where = _pause_on_node0_resume_elsewhere(c)
        got, served = _repo_metrics(c, where), _repo_metrics(c, "node0")
        from_peers = got["p2p"]["chunks_from_peers"] - before[where]["p2p"]["chunks_from_peers"]
        from_repo = got["restore"]["chunks_fetched"] - before[where]["restore"]["chunks_fetched"]
        if from_peers > 0 or attempt == 1:
            break
        print(f"\nattempt 1: no chunk from node0 ({got['p2p']}); once more\n{_p2p_log(c)}")
        moved.kill()
        with c.sched() as s:
            assert s.post("/v1/nodes/node0/undrain").status_code == 200
    assert from_peers > 0 and from_peers >= 4 * from_repo, (got["p2p"], got["restore"], _p2p_log(c))
    assert served["p2p"]["served_chunks"] >= from_peers and served["p2p"]["refused_connections"] == 0
    assert got["p2p"]["peer_corrupt"] == 0
    url = c.node_urls[int(where.removeprefix("node"))]  # the same counts in Prometheus form
    prom = httpx.get(f"{url}/metrics", timeout=10).text
    assert f"forkyard_p2p_fetched_chunks_total {float(got['p2p']['chunks_from_peers'])}" in prom, prom[-2000:]

    moved.kill()


def test_a_killed_peer_still_gives_a_correct_resume_from_the_repository(p2p_cluster):
    """node0 pauses a sandbox (its cache holds the image) and is SIGKILLed: the scheduler
    still lists node0 as a peer for up to the heartbeat timeout, so the resume on
    another node asks it first; that fails, and the image comes from the repository
    with the sandbox's memory and files."""
    c = p2p_cluster
    with only_on(c, "node0"):
        sbx = Sandbox.create("base", timeout=300, **c.sdk)
    with_counter(c, sbx, 5)
    sbx.files.write("/home/user/keep.txt", "kept")
    sbx.pause()
    time.sleep(1.5)  # the other nodes' peer tables list node0's new image
    c.nodes[0].stop(sig_kill=True)
    moved = Sandbox.connect(sbx.sandbox_id, timeout=300, **c.sdk)
    where = c.owner(sbx.sandbox_id)
    assert where in ("node1", "node2")
    assert counter(c, moved) == 5 and moved.files.read("/home/user/keep.txt") == "kept"
    got = _repo_metrics(c, where)
    assert got["p2p"]["chunks_from_peers"] == 0 and got["restore"]["chunks_fetched"] > 0, (got["p2p"], got["restore"])
    assert got["p2p"]["peer_failures"] >= 1, got["p2p"]
    moved.kill()


def test_an_endpoint_outside_the_cluster_cannot_fetch_a_chunk(p2p_cluster, tmp_path):
    """An iroh endpoint that knows node0's address and endpoint id (from the scheduler's
    node list) but is no member — it has no node key, so the scheduler lists it nowhere —
    is refused by node0 before a request is read: its restore of node0's snapshot reads
    the repository only, and node0 counts the refusal. A member creating a sandbox from
    the same snapshot reads it from node0."""
    c = p2p_cluster
    with only_on(c, "node0"):
        sbx = Sandbox.create("base", timeout=300, **c.sdk)
    snap = sbx.create_snapshot(name="p2p-outsider")
    sbx.kill()
    with c.sched() as s:
        node0 = next(n for n in s.get("/v1/nodes").json() if n["nodeID"] == "node0")
    addr = node0["report"]["p2p"]
    st = SnapshotStore(tmp_path / "outsider", RepoConfig(url=str(c.root / "repository")), auto_gc=False)
    svc = ChunkService(st.cache, st.repo, bind="127.0.0.1:0", timeout_s=3.0)
    try:
        svc.set_peers([Peer("node0", addr["id"], tuple(addr["addrs"]), frozenset({snap.snapshot_id}))])
        st.peers = svc
        st.image(snap.snapshot_id)
        assert svc.stats()["chunks_from_peers"] == 0
        assert st.metrics()["restore"]["chunks_fetched"] > 0
        assert _repo_metrics(c, "node0")["p2p"]["refused_connections"] >= 1
    finally:
        svc.close()
        st.close()
        shutil.rmtree(tmp_path / "outsider", ignore_errors=True)
    with only_on(c, "node1"):  # a member creating from that snapshot reads it from node0
        child = Sandbox.create(snap.snapshot_id, timeout=60, **c.sdk)
    assert c.owner(child.sandbox_id) == "node1"
    got = _repo_metrics(c, "node1")
    assert got["p2p"]["chunks_from_peers"] > 0 and got["restore"]["chunks_fetched"] == 0, (got["p2p"], got["restore"])
    child.kill()
    Sandbox.delete_snapshot(snap.snapshot_id, **c.sdk)


def _from_sources(c: Cluster, nodes, before: dict) -> tuple[int, int, list]:
    """``(chunks from peers, chunks from the repository, [p2p, restore] per node)`` read by
    ``nodes`` since ``before`` (their /metrics/repository then); each node's Prometheus
    text says the same totals."""
    peers = repo = 0
    seen = []
    for n in nodes:
        m = _repo_metrics(c, n)
        peers += m["p2p"]["chunks_from_peers"] - before[n]["p2p"]["chunks_from_peers"]
        repo += m["restore"]["chunks_fetched"] - before[n]["restore"]["chunks_fetched"]
        assert m["p2p"]["peer_corrupt"] == 0, m["p2p"]
        seen.append((n, m["p2p"], m["restore"]))
        prom = {line.split()[0]: float(line.split()[1]) for line in
                httpx.get(f"{c.node_urls[int(n.removeprefix('node'))]}/metrics", timeout=10).text.splitlines()
                if line.startswith(("forkyard_p2p_", "forkyard_repository_fetched"))}
        assert prom["forkyard_p2p_fetched_chunks_total"] == m["p2p"]["chunks_from_peers"], prom
        assert prom["forkyard_p2p_fetched_bytes_total"] == m["p2p"]["bytes_from_peers"], prom
        assert prom["forkyard_repository_fetched_bytes_total"] == m["restore"]["bytes_fetched"], prom
    return peers, repo, seen


def test_a_24_way_fork_spread_over_the_nodes_reads_the_image_from_peers(base_template):
    """Room for the source and 8 children per node: a fork of 24 puts 8 children on
    each node; node1's and node2's 16 start from the one exported checkpoint read from
    node0's cache (or each other's) — most chunks from peers, counted per source in
    /metrics/repository and Prometheus — and every child has the source's process
    memory (its counter) and files."""
    with _cluster(P2P_ENV, max_sandboxes={0: 9, 1: 8, 2: 8}) as c:
        with only_on(c, "node0"):
            src = Sandbox.create("base", timeout=300, **c.sdk)
        with_counter(c, src, 24)
        src.files.write("/home/user/who.txt", "source")
        with c.sched() as s:  # every node advertises its iroh address in its heartbeat …
            wait_for(lambda: all((n["report"].get("p2p") or {}).get("addrs") for n in s.get("/v1/nodes").json()),
                     10, "every node to report its P2P address")
        # … and has opened its connections to the others (a member is dialled WARM_AFTER_S
        # after it is listed) before 24 restores change the host's links: a dial made
        # meanwhile can stall (see the resume test)
        time.sleep(p2psvc.WARM_AFTER_S + 2)
        for attempt in range(2):  # (once more when a first dial timed out: see the resume test)
            # fresh data in the source's memory: chunks no node read before
            src.commands.run(f"head -c 8M /dev/urandom > /dev/shm/fresh{attempt}", timeout=60)
            before = {n: _repo_metrics(c, n) for n in ("node1", "node2")}
            with c.api() as api:
                r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 24, "timeout": 300}, timeout=900)
            assert r.status_code == 201, r.text
            kids = [x["sandbox"]["sandboxID"] for x in r.json()]
            placed = Counter(c.owner(k) for k in kids)
            assert len(kids) == 24 and placed == {"node0": 8, "node1": 8, "node2": 8}, placed
            for k in kids:
                kid = Sandbox.connect(k, **c.sdk)
                assert counter(c, kid) == 24 and kid.files.read("/home/user/who.txt") == "source", k
            from_peers, from_repo, seen = _from_sources(c, ("node1", "node2"), before)
            with c.api() as api:
                for k in kids:
                    assert api.delete(f"/sandboxes/{k}").status_code == 204
            if from_peers > from_repo:
                break
            print(f"\nattempt {attempt + 1}: most chunks from the repository ({seen})\n{_p2p_log(c)}")
            # the failed peers are asked again after BACKOFF_S, and by then every node's
            # heartbeat has given back the room of the children just deleted (a fork at
            # once was refused: "no node has room for 1 more sandbox(es)")
            time.sleep(p2psvc.BACKOFF_S)
        assert from_peers > from_repo, (seen, _repo_metrics(c, "node0")["p2p"], _p2p_log(c))  # most from peers
        assert counter(c, src) == 24  # the source runs on, unchanged
        src.kill()


def test_a_templates_first_start_on_every_node_reads_it_from_peers(p2p_cluster, tmp_path):
    """A template built through the gateway (on node0, whose cache then holds its image)
    whose start command holds a value in a process's memory: its first start on node1
    and then on node2 reads most chunks from peers (counted per source), and each
    sandbox has the built file and the process with the value it had when the template
    was snapshotted (restored, not booted again)."""
    from e2b import Template
    from test_lifecycle import COUNTER

    c = p2p_cluster
    (tmp_path / "counter.py").write_text(COUNTER)
    ready = "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:8000/set/77', timeout=2)\""
    names = []
    try:
        for attempt in range(2):
            # (Once more, with a new template once node1/node2 ask node0 again, when a first
            # dial to node0 timed out — the open flake of the resume test: that start read
            # the repository, correct but not what this test shows.)
            names.append(name := f"p2p-{os.getpid()}-{attempt}")
            tmpl = (Template(file_context_path=tmp_path).from_template("base").copy("counter.py", "/home/user/")
                    .run_cmd(f"echo built {attempt} > /home/user/built.txt")
                    .set_start_cmd("python3 /home/user/counter.py", ready))
            with only_on(c, "node0"):
                Template.build(tmpl, name, api_key=c.api_key, api_url=c.gateway_url)
                b = Sandbox.create(name, timeout=120, **c.sdk)  # where it was built: from its own cache
            assert c.owner(b.sandbox_id) == "node0" and counter(c, b) == 77
            b.kill()
            time.sleep(1.5)  # the peer tables list node0's template image
            got = {}
            for node in ("node1", "node2"):
                before = {node: _repo_metrics(c, node)}
                with only_on(c, node):
                    b = Sandbox.create(name, timeout=120, **c.sdk)
                try:
                    assert c.owner(b.sandbox_id) == node
                    assert counter(c, b) == 77 and b.files.read("/home/user/built.txt") == f"built {attempt}\n"
                finally:
                    b.kill()
                got[node] = _from_sources(c, (node,), before)
            if all(peers > repo for peers, repo, _ in got.values()) or attempt == 1:
                break
            print(f"\nattempt {attempt + 1}: a start read most chunks from the repository ({got}); once more\n"
                  f"{_p2p_log(c)}")
            time.sleep(p2psvc.BACKOFF_S)  # the failed peer is asked again
        for from_peers, from_repo, seen in got.values():
            assert from_peers > from_repo, (seen, _repo_metrics(c, "node0")["p2p"], _p2p_log(c))  # most from peers
    finally:
        with c.api() as api:
            for name in names:
                api.delete(f"/templates/{name}")


def test_p2p_off_reads_the_repository_as_before(base_template):
    """Without FORKYARD_P2P (the default): no node reports an iroh address or gets
    peers, the metrics have no p2p section, and a resume on another node reads its
    chunks from the repository."""
    with _cluster(None, nodes=2) as c:
        with c.sched() as s:
            assert all(n["report"].get("p2p") is None for n in s.get("/v1/nodes").json())
        moved, where = _pause_on_node0_resume_elsewhere(c)
        got = _repo_metrics(c, where)
        assert "p2p" not in got and got["restore"]["chunks_fetched"] > 0
        moved.kill()
