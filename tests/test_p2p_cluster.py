"""P2P chunk transport in a real cluster on this host (issue 24): redis-server,
scheduler, gateway and 3 node processes with ``FORKYARD_P2P=on`` (iroh endpoints on
127.0.0.1, no relay), real gVisor sandboxes through the e2b SDK.

tests/test_p2p.py covers a corrupt chunk and a peer going away mid-restore between
real stores; here: a sandbox paused on node0 resumes on another node from node0's
cache, an iroh endpoint outside the cluster is refused, and P2P off stays as it was.
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

P2P_ENV = {"FORKYARD_P2P": "on", "FORKYARD_P2P_BIND": "127.0.0.1:0"}


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
        # shows; the cause is open (docs/architecture.md, P2P): then once more.)
        before = {n: _repo_metrics(c, n) for n in ("node1", "node2")}
        moved, where = _pause_on_node0_resume_elsewhere(c)
        got, served = _repo_metrics(c, where), _repo_metrics(c, "node0")
        from_peers = got["p2p"]["chunks_from_peers"] - before[where]["p2p"]["chunks_from_peers"]
        from_repo = got["restore"]["chunks_fetched"] - before[where]["restore"]["chunks_fetched"]
        if from_peers > 0 or attempt == 1:
            break
        print(f"\nattempt 1: no chunk from node0 ({got['p2p']}); once more")
        moved.kill()
        with c.sched() as s:
            assert s.post("/v1/nodes/node0/undrain").status_code == 200
    assert from_peers > 0 and from_peers >= 4 * from_repo, (got["p2p"], got["restore"])
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


def test_fork_children_on_other_nodes_read_the_image_from_the_source_node(base_template):
    """node0 has room for the source and 2 children: a fork of 6 puts 4 children on
    node1/node2, which start from the one exported checkpoint read from node0's cache
    (most chunks from the peer), each with the source's memory and files."""
    with _cluster(P2P_ENV, max_sandboxes={0: 3}) as c:
        with only_on(c, "node0"):
            src = Sandbox.create("base", timeout=300, **c.sdk)
        with_counter(c, src, 9)
        src.files.write("/home/user/who.txt", "source")
        time.sleep(1.5)  # every node has heard of its peers
        for attempt in range(2):  # (once more when a first dial timed out: see the resume test)
            before = {n: _repo_metrics(c, n) for n in ("node1", "node2")}
            with c.api() as api:
                r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 6, "timeout": 120}, timeout=600)
            assert r.status_code == 201, r.text
            kids = [x["sandbox"]["sandboxID"] for x in r.json()]
            placed = Counter(c.owner(k) for k in kids)
            assert placed["node0"] == 2 and placed["node1"] + placed["node2"] == 4, placed
            for k in kids:
                kid = Sandbox.connect(k, **c.sdk)
                assert counter(c, kid) == 9 and kid.files.read("/home/user/who.txt") == "source"
            remote = {n: _repo_metrics(c, n) for n in ("node1", "node2") if placed[n]}
            from_peers = sum(m["p2p"]["chunks_from_peers"] - before[n]["p2p"]["chunks_from_peers"]
                             for n, m in remote.items())
            from_repo = sum(m["restore"]["chunks_fetched"] - before[n]["restore"]["chunks_fetched"]
                            for n, m in remote.items())
            with c.api() as api:
                for k in kids:
                    assert api.delete(f"/sandboxes/{k}").status_code == 204
            if from_peers > 0:
                break
            print(f"\nattempt {attempt + 1}: no chunk from node0 ({[m['p2p'] for m in remote.values()]})")
        assert from_peers > 0 and from_peers >= 4 * from_repo, [(m["p2p"], m["restore"]) for m in remote.values()]
        src.kill()


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
