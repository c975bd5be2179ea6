"""The P2P chunk read path (issue 24) between real snapshot stores over real iroh
endpoints on this host: two or three nodes' stores share one posix repository, each runs
a :class:`~forkyard.repository.p2p.ChunkService` on 127.0.0.1. What a node restores is
always the committed image, whatever its peers do: a peer serving corrupt bytes, a peer
going away mid-restore, or an endpoint outside the cluster asking.

No sandbox here (tests/test_p2p_cluster.py resumes real sandboxes across nodes).
"""

from __future__ import annotations

import filecmp
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from forkyard.repository import SnapshotMeta, SnapshotStore, new_snapshot_id
from forkyard.repository.config import RepoConfig
from forkyard.repository.p2p import ChunkService, Peer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nodes(tmp_path):
    """``nodes(n) -> [(store, service)]``: stores sharing one repository, each with a
    P2P service; every service lists the others as members. Closed at the end."""
    made: list[tuple[SnapshotStore, ChunkService]] = []

    def make(n: int = 2, timeout_s: float = 3.0) -> list[tuple[SnapshotStore, ChunkService]]:
        for i in range(n):
            st = SnapshotStore(tmp_path / f"n{i}", RepoConfig(url=str(tmp_path / "repository")), auto_gc=False)
            svc = ChunkService(st.cache, st.repo, bind="127.0.0.1:0", timeout_s=timeout_s)
            st.peers = svc
            made.append((st, svc))
        members = [Peer(f"n{i}", svc.endpoint_id, tuple(svc.address()["addrs"])) for i, (_, svc) in enumerate(made)]
        for _, svc in made:
            svc.set_peers(members)
        return made

    yield make
    for st, svc in made:
        svc.close()
        st.close()


def _image(root: Path, mb: int = 3) -> Path:
    img = root / "src-image"
    img.mkdir(parents=True)
    (img / "pages.img").write_bytes(os.urandom(mb << 20))
    (img / "checkpoint.img").write_bytes(os.urandom(100_000) * 3)
    return img


def _commit(store: SnapshotStore, image: Path) -> SnapshotMeta:
    sid = new_snapshot_id()
    staging = store.staging(sid)
    shutil.rmtree(staging / "image")
    shutil.copytree(image, staging / "image")
    return store.commit(staging, SnapshotMeta(sid, "snapshot", "base", "src", 1, 256))


def _same(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def _chunks(store: SnapshotStore, sid: str) -> int:
    return len(store.repo.manifest(sid).chunk_hashes())


def test_restore_elsewhere_reads_every_chunk_from_the_peer(nodes, tmp_path):
    """Committed on a, restored on b: every chunk comes from a (verified), none from the
    repository; the image is the committed one and a's counters show what it served."""
    (a, pa), (b, pb) = nodes(2)
    src = _image(tmp_path)
    meta = _commit(a, src)
    n = _chunks(a, meta.snapshot_id)
    d = b.image(meta.snapshot_id)
    assert _same(d, src)
    mb = b.metrics()
    assert mb["p2p"]["chunks_from_peers"] == n, mb["p2p"]
    assert mb["restore"]["chunks_fetched"] == 0, mb["restore"]
    assert pa.stats()["served_chunks"] == n
    assert pa.stats()["refused_connections"] == 0


def test_corrupt_chunk_from_a_peer_falls_back_to_the_repository(nodes, tmp_path):
    """a's cached image is damaged on its disk: the chunks a serves from that region
    fail verification on b, which reads them from the repository; b's image is right."""
    (a, _), (b, pb) = nodes(2)
    src = _image(tmp_path)
    meta = _commit(a, src)
    held = a.cache.held_image(meta.snapshot_id)
    with open(held / "pages.img", "r+b") as f:  # flip bytes in the first MiB
        for off in range(0, 1 << 20, 200_000):
            f.seek(off)
            f.write(b"\xff\x00\xff\x00")
    d = b.image(meta.snapshot_id)
    assert _same(d, src)
    st = pb.stats()
    assert st["peer_corrupt"] >= 1, st
    assert b.metrics()["restore"]["chunks_fetched"] >= 1  # the damaged ones came from the repository


def test_peer_gone_mid_restore_still_restores_from_the_repository(nodes, tmp_path):
    """a's endpoint closes after it has served a few chunks of b's restore: b's restore
    completes from the repository with the committed image."""
    (a, pa), (b, pb) = nodes(2, timeout_s=2.0)
    src = _image(tmp_path, mb=12)  # several restore batches: the close lands mid-restore
    meta = _commit(a, src)
    n = _chunks(a, meta.snapshot_id)
    stop = threading.Event()

    def kill_after_some():
        while not stop.is_set():
            if pa.stats()["served_chunks"] >= 5:
                pa.transport.close()
                return
            time.sleep(0.001)

    t = threading.Thread(target=kill_after_some)
    t.start()
    try:
        d = b.image(meta.snapshot_id)
    finally:
        stop.set()
        t.join()
    assert _same(d, src)
    got = b.metrics()
    assert 5 <= got["p2p"]["chunks_from_peers"] < n, got["p2p"]
    assert got["restore"]["chunks_fetched"] == n - got["p2p"]["chunks_from_peers"]
    assert got["p2p"]["peer_failures"] >= 1


def test_an_endpoint_the_cluster_does_not_list_cannot_fetch(nodes, tmp_path):
    """c knows a's address and endpoint id, but a's member table (the scheduler's list)
    does not name c: a closes c's connection before reading a request, c's restore reads
    everything from the repository, and a counts the refusal."""
    (a, pa), (b, pb), (c, pc) = nodes(3)
    pa.set_peers([p for p in pa.peers() if p.endpoint_id != pc.endpoint_id])  # c is no member for a
    pb.set_peers([])
    src = _image(tmp_path)
    meta = _commit(a, src)
    n = _chunks(a, meta.snapshot_id)
    d = c.image(meta.snapshot_id)
    assert _same(d, src)
    assert pc.stats()["chunks_from_peers"] == 0
    assert c.metrics()["restore"]["chunks_fetched"] == n
    assert pa.stats()["refused_connections"] >= 1
    assert pa.stats()["served_chunks"] == 0


def test_a_member_the_scheduler_stops_listing_is_cut_off_at_its_next_request(nodes, tmp_path):
    """b fetched from a over an open connection; then a's member table (the scheduler's
    list) drops b: b's next restore gets nothing more from a over that connection — a
    closes it at the next request — and reads the repository (attack review: the
    membership was checked only when a connection opened)."""
    (a, pa), (b, pb) = nodes(2)
    first = _commit(a, _image(tmp_path / "one"))
    assert _same(b.image(first.snapshot_id), tmp_path / "one" / "src-image")
    got = pb.stats()["chunks_from_peers"]
    assert got == _chunks(a, first.snapshot_id)
    pa.set_peers([])  # b is no member for a any more; b still lists a
    second = _commit(a, _image(tmp_path / "two"))
    assert _same(b.image(second.snapshot_id), tmp_path / "two" / "src-image")
    assert pb.stats()["chunks_from_peers"] == got
    assert b.metrics()["restore"]["chunks_fetched"] == _chunks(a, second.snapshot_id)
    assert pa.stats()["refused_connections"] >= 1


def test_without_p2p_nothing_changes(tmp_path):
    """P2P off (the default): a store has no peer source, restores read the repository
    and the metrics carry no p2p section."""
    a = SnapshotStore(tmp_path / "a", RepoConfig(url=str(tmp_path / "repository")), auto_gc=False)
    b = SnapshotStore(tmp_path / "b", RepoConfig(url=str(tmp_path / "repository")), auto_gc=False)
    try:
        src = _image(tmp_path, mb=1)
        meta = _commit(a, src)
        assert a.peers is None and b.peers is None
        assert _same(b.image(meta.snapshot_id), src)
        m = b.metrics()
        assert "p2p" not in m and m["restore"]["chunks_fetched"] == _chunks(a, meta.snapshot_id)
    finally:
        a.close()
        b.close()
