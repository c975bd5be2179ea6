"""The P2P chunk read path (issue 24) between real snapshot stores over real iroh
endpoints on this host: two or three nodes' stores share one posix repository, each runs
a :class:`~forkyard.repository.p2p.ChunkService` on 127.0.0.1. What a node restores is
always the committed image, whatever its peers do: a peer serving corrupt bytes, a peer
going away mid-restore, or an endpoint outside the cluster asking.

No sandbox here (tests/test_p2p_cluster.py resumes real sandboxes across nodes).
"""

from __future__ import annotations

import asyncio
import filecmp
import os
import struct
import shutil
import threading
import time
from pathlib import Path

import iroh
import pytest
from conftest import redis_server

from forkyard.cluster.p2p import MAX_ADDRS, PeerTable, parse_peers, valid_address
from forkyard.cluster.store import ClusterStore
from forkyard.cluster.types import HEARTBEAT_TIMEOUT_S, NodeReport
from forkyard.repository import SnapshotMeta, SnapshotStore, new_snapshot_id
from forkyard.repository.config import RepoConfig
from forkyard.repository.p2p import ChunkService, Peer
from forkyard.repository.p2p import service as p2psvc
from forkyard.repository.p2p import transport as tp

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def nodes(tmp_path):
    """``nodes(n, timeout_s, per={i: {...}}) -> [(store, service)]``: stores sharing one
    repository, each with a P2P service on 127.0.0.1 (``per[i]`` overrides node i's
    :class:`ChunkService` arguments; its ``cls`` the class); every service lists the
    others as members. Closed at the end."""
    made: list[tuple[SnapshotStore, ChunkService]] = []

    def make(n: int = 2, timeout_s: float = 10.0, per: dict | None = None) -> list[tuple[SnapshotStore, ChunkService]]:
        for i in range(n):
            st = SnapshotStore(tmp_path / f"n{i}", RepoConfig(url=str(tmp_path / "repository")), auto_gc=False)
            kw = {"bind": "127.0.0.1:0", "timeout_s": timeout_s, **(per or {}).get(i, {})}
            svc = kw.pop("cls", ChunkService)(st.cache, st.repo, **kw)
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
    """a's endpoint closes after b has got a few chunks of its restore from it: b's
    restore completes from the repository with the committed image, within about one
    request timeout (the requests queued for a's slots are not sent once one failed).
    (The close followed a's own count of chunks sent; those could still be in flight
    and dropped with the close, so b had fewer than 5 — a flake.)"""
    (a, pa), (b, pb) = nodes(2, timeout_s=2.0)
    src = _image(tmp_path, mb=12)  # several restore batches: the close lands mid-restore
    meta = _commit(a, src)
    n = _chunks(a, meta.snapshot_id)
    stop = threading.Event()

    def kill_after_some():
        while not stop.is_set():
            if pb.stats()["chunks_from_peers"] >= 5:
                pa.transport.close()
                return
            time.sleep(0.001)

    t = threading.Thread(target=kill_after_some)
    t.start()
    t0 = time.monotonic()
    try:
        d = b.image(meta.snapshot_id)
    finally:
        stop.set()
        t.join()
    took = time.monotonic() - t0
    assert _same(d, src)
    got = b.metrics()
    assert 5 <= got["p2p"]["chunks_from_peers"] < n, got["p2p"]
    assert took < 8, f"restore took {took:.1f} s after its peer went (timeout 2 s)"
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


# ---- hardening (attack review, issue 24) ----------------------------------------------

class SlowService(ChunkService):
    """A real chunk service that waits ``delay_s`` before answering each request (a
    loaded or hostile member answering just in time)."""

    delay_s = 0.0

    async def _serve_stream(self, bi, rid):
        await asyncio.sleep(self.delay_s)
        await super()._serve_stream(bi, rid)


def _want(store: SnapshotStore, sid: str) -> list[tuple[str, int]]:
    """Every distinct (hash, raw length) of ``sid``'s manifest, in file order."""
    return list(dict.fromkeys(hn for f in store.repo.manifest(sid).files for hn in f.chunks))


async def _connect(client: ChunkService, server: ChunkService):
    addr = iroh.EndpointAddr(iroh.EndpointId.from_string(server.endpoint_id), None, list(server.address()["addrs"]))
    return await asyncio.wait_for(client.transport.endpoint.connect(addr, tp.ALPN), 10)


async def _send(conn, payload: bytes):
    bi = await conn.open_bi()
    send = bi.send()
    await send.write_all(payload)
    await send.finish()
    return bi


def _raw(client: ChunkService, server: ChunkService, payloads: list[bytes]) -> list[list[tuple[int, bytes]]]:
    """Send each of ``payloads`` (request bytes, as a member may frame them) from
    ``client``'s endpoint to ``server`` on its own stream: the parsed answers."""
    async def go():
        conn = await _connect(client, server)
        out = []
        for p in payloads:
            data = await asyncio.wait_for((await _send(conn, p)).recv().read_to_end(1 << 26), 20)
            items, at = [], 0
            while at < len(data):
                (size,) = struct.unpack(">I", data[at + 1:at + 5])
                items.append((data[at], data[at + 5:at + 5 + size]))
                at += 5 + size
            out.append(items)
        return out
    return client.transport.call(go(), 60)


def test_one_member_flooding_a_node_leaves_serving_slots_to_the_others(nodes, tmp_path):
    """c (a member) holds a's serving slots with requests whose answers it never reads,
    over two connections (each answer is ~4 MiB, past QUIC's per-stream flow-control
    window, so a's write of it blocks until a's timeout); a serves at most
    ``serve_per_peer`` of them, so b's restore still gets every chunk from a instead of
    "busy" (attack review: serving was bounded per node only; one member could take
    every slot — here 8 of 8 before)."""
    hold = {"timeout_s": 20.0, "max_serving": 8, "serve_per_peer": 4}  # c's answers block this long
    (a, pa), (b, pb), (c, pc) = nodes(3, per={0: hold})
    pb.set_peers([p for p in pb.peers() if p.endpoint_id == pa.endpoint_id])  # b asks a only
    big = _commit(a, _image(tmp_path / "big", mb=8))
    flood = tp.encode_request(big.snapshot_id, _want(a, big.snapshot_id)[:tp.MAX_BATCH])  # ~4 MiB to send each

    async def open_flood():
        streams = []
        for _ in range(2):
            conn = await _connect(pc, pa)
            streams += [(conn, await _send(conn, flood)) for _ in range(6)]
        return streams

    streams = pc.transport.call(open_flood(), 30)  # kept referenced: the streams stay open, unread
    deadline = time.monotonic() + 15
    while pa.stats()["serving"] + pa.stats()["served_busy"] < 12 and time.monotonic() < deadline:
        time.sleep(0.05)
    st = pa.stats()
    assert st["serving"] == 4 and st["served_busy"] == 8, st  # c got its share, no more
    src = _image(tmp_path / "small")
    meta = _commit(a, src)
    busy = pa.stats()["served_busy"]
    assert _same(b.image(meta.snapshot_id), src)
    assert pb.stats()["chunks_from_peers"] == _chunks(a, meta.snapshot_id), pb.stats()
    assert pa.stats()["served_busy"] == busy  # b was never answered busy
    assert len(streams) == 12


def test_what_one_member_is_sent_is_bounded_in_bytes_per_second(nodes, tmp_path):
    """a serves each member at most 1 MB/s (``serve_bytes_per_s``; FORKYARD_P2P_PEER_MBIT
    8): b and c, restoring ~4.3 MB each from a at once, each take at least the time that
    bound allows past its 1 s burst, every chunk still from a; the bound is per member,
    so a sends the two together faster than one member's bound."""
    rate = 1_000_000
    (a, pa), (b, pb), (c, pc) = nodes(3, timeout_s=20.0, per={0: {"serve_bytes_per_s": rate}})
    for p in (pb, pc):  # b and c ask a only
        p.set_peers([q for q in p.peers() if q.endpoint_id == pa.endpoint_id])
    src = _image(tmp_path, mb=4)
    meta = _commit(a, src)
    took: dict[str, float] = {}

    def restore(name, store):
        t0 = time.monotonic()
        assert _same(store.image(meta.snapshot_id), src)
        took[name] = time.monotonic() - t0

    t0 = time.monotonic()
    threads = [threading.Thread(target=restore, args=(n, s)) for n, s in (("b", b), ("c", c))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    wall = time.monotonic() - t0
    n = _chunks(a, meta.snapshot_id)
    assert pb.stats()["chunks_from_peers"] == n and pc.stats()["chunks_from_peers"] == n
    sent = pa.stats()["served_bytes"]
    each = sent / 2
    assert each > 4e6, sent
    floor = (each - rate) / rate  # what the bucket allows past its burst of one second
    assert min(took.values()) >= 0.9 * floor, (took, floor)
    assert pa.stats()["served_rate_wait_ms"] > 1000, pa.stats()
    assert sent / wall > 1.2 * rate, (sent, wall)  # per member: more than one member's bound


def test_a_request_naming_one_hash_many_times_is_refused(nodes, tmp_path):
    """A member's request naming one chunk 64 times (one read, 64 sends: amplification)
    is answered BAD_REQUEST with nothing served; the same chunk named once is served;
    a requester asks for a hash once even when its caller lists it twice."""
    (a, pa), (b, pb) = nodes(2)
    meta = _commit(a, _image(tmp_path))
    sid = meta.snapshot_id
    h, n = _want(a, sid)[0]
    dup, once = _raw(pb, pa, [tp.encode_request(sid, [(h, n)] * tp.MAX_BATCH), tp.encode_request(sid, [(h, n)])])
    assert dup == [(tp.BAD_REQUEST, b"")]
    assert [s for s, _ in once] == [tp.OK]
    assert pa.stats()["served_chunks"] == 1
    got = pb.fetch_many(sid, [(h, n), (h, n + 1), (h, n)])  # (h, n + 1) cannot be right: never asked
    assert list(got) == [(h, n)]
    assert pa.stats()["served_chunks"] == 2 and pb.stats()["peer_corrupt"] == 0 and pb.stats()["peer_failures"] == 0


def test_advertised_addresses_that_are_not_unicast_ip_port_are_ignored():
    """Of a member's advertised addresses only unicast ``ip:port`` are kept (canonical,
    once), from the first MAX_ADDRS looked at: multicast, unspecified, broadcast,
    link-local (the metadata address), "this network", port 0, names and junk are
    dropped, by the scheduler (valid_address) and again on receipt (parse_peers)."""
    eid = "ab" * 32
    bad = ["224.0.0.1:5000", "[ff02::1]:5000", "0.0.0.0:5000", "[::]:5000", "255.255.255.255:5000",
           "169.254.169.254:80", "[fe80::1]:5000", "[fe80::1%eth0]:5000", "0.1.2.3:5000", "10.0.0.1:0",
           "10.0.0.1:70000", "999.1.1.1:5000", "[::ffff:10.0.0.1]:5000", "[10.0.0.1]:5000", "host.example:5000",
           "10.0.0.1", 7, None, "10.0.0.1:5000 ", "x" * 100000]
    good = ["10.0.0.1:5000", "[2001:DB8::1]:7800", "127.0.0.1:6000", "10.0.0.1:5000"]
    got = valid_address({"id": eid, "addrs": bad[:10] + good + bad[10:]})
    assert got == {"id": eid, "addrs": ["10.0.0.1:5000", "[2001:db8::1]:7800", "127.0.0.1:6000"]}
    assert valid_address({"id": eid, "addrs": bad}) is None
    many = [f"10.0.{i // 250}.{i % 250 + 1}:5000" for i in range(1000)]
    assert valid_address({"id": eid, "addrs": many})["addrs"] == many[:MAX_ADDRS]
    assert valid_address({"id": eid, "addrs": bad[:MAX_ADDRS] + good}) is None  # only the first MAX_ADDRS
    (peer,) = parse_peers([{"node": "n1", "id": eid, "addrs": bad[:4] + good + bad[4:]}])
    assert peer.addrs == ("10.0.0.1:5000", "[2001:db8::1]:7800", "127.0.0.1:6000")


def test_a_node_not_bound_to_loopback_does_not_dial_a_members_loopback_address(nodes, tmp_path):
    """b's endpoint is bound to 0.0.0.0: a member advertising 127.0.0.1 would make b send
    QUIC packets to a port of b's own host, so b drops that address (a member left with
    no address is still served, never asked) and reads the repository; a node bound to
    loopback (every other test here: a one-host cluster) dials it."""
    (a, pa), (b, pb) = nodes(2, per={1: {"bind": "0.0.0.0:0"}})
    assert pa.dials_loopback and not pb.dials_loopback
    (seen,) = pb.peers()
    assert seen.endpoint_id == pa.endpoint_id and seen.addrs == ()
    src = _image(tmp_path)
    meta = _commit(a, src)
    assert _same(b.image(meta.snapshot_id), src)
    assert pb.stats()["chunks_from_peers"] == 0 and pb.stats()["peer_failures"] == 0
    assert b.metrics()["restore"]["chunks_fetched"] == _chunks(a, meta.snapshot_id)
    assert pa.stats()["served_chunks"] == 0


def test_a_peer_answering_just_under_the_timeout_is_skipped_like_a_failing_one(nodes, tmp_path):
    """a answers every request after 2.6 s, under b's 4 s timeout but over half of it:
    after SLOW_STREAK such answers b skips a for the backoff, like a failing peer — the
    rest of that restore and the next one read the repository instead of waiting on a
    (attack review: a peer just under the timeout was never skipped)."""
    (a, pa), (b, pb) = nodes(2, timeout_s=4.0, per={0: {"cls": SlowService}})
    pa.delay_s = 2.6
    src = _image(tmp_path / "one", mb=12)  # 3 restore batches of 64 chunks: 12 requests, 8 slow skip a
    meta = _commit(a, src)
    assert _same(b.image(meta.snapshot_id), src)
    st = pb.stats()
    assert st["peer_slow"] >= p2psvc.SLOW_STREAK and st["peer_failures"] >= 1, st
    assert 0 < st["chunks_from_peers"] < _chunks(a, meta.snapshot_id), st
    served = pa.stats()["served_chunks"]
    again = _commit(a, _image(tmp_path / "two"))
    assert _same(b.image(again.snapshot_id), tmp_path / "two" / "src-image")
    assert pa.stats()["served_chunks"] == served  # skipped: not asked at all


def test_the_timeout_counts_from_sending_not_from_waiting_for_a_slot(nodes, tmp_path):
    """b asks a for ~20 requests' worth of chunks with one request in flight at a time;
    a answers each in 0.5 s (well within half b's 4 s timeout). The queue behind the slot
    takes ~10 s, longer than the whole old bound (timeout + dials): every chunk still
    comes from a and a is not blamed (before: the call timed out, a was marked failed
    and skipped for 30 s — the suspected flaky first dial of test_p2p_cluster)."""
    (a, pa), (b, pb) = nodes(2, timeout_s=4.0, per={0: {"cls": SlowService}, 1: {"per_peer": 1, "slot_wait_s": 60}})
    pa.delay_s = 0.5
    meta = _commit(a, _image(tmp_path, mb=20))
    want = _want(a, meta.snapshot_id)
    assert len(want) > 18 * p2psvc.BATCH
    t0 = time.monotonic()
    got = pb.fetch_many(meta.snapshot_id, want)
    assert time.monotonic() - t0 > 4.0 + p2psvc.CONNECT_S * p2psvc.CONNECT_TRIES
    st = pb.stats()
    assert len(got) == len(want) and st["peer_failures"] == 0 and st["peer_slot_waits"] == 0, st


def test_a_request_that_waits_too_long_for_a_slot_goes_elsewhere_without_blaming_the_peer(nodes, tmp_path):
    """Same queue, but b waits at most 1 s for a slot: the requests still queued then go
    to the repository (counted in ``peer_slot_waits``), a is not marked failed and the
    next fetch asks it again."""
    (a, pa), (b, pb) = nodes(2, timeout_s=4.0, per={0: {"cls": SlowService}, 1: {"per_peer": 1, "slot_wait_s": 1.0}})
    pa.delay_s = 0.5
    meta = _commit(a, _image(tmp_path, mb=6))
    want = _want(a, meta.snapshot_id)
    got = pb.fetch_many(meta.snapshot_id, want)
    st = pb.stats()
    assert 0 < len(got) < len(want) and st["peer_slot_waits"] >= 1 and st["peer_failures"] == 0, st
    rest = [hn for hn in want if hn not in got][:p2psvc.BATCH]
    assert len(pb.fetch_many(meta.snapshot_id, rest)) == len(rest)


async def test_an_endpoint_id_is_vouched_for_the_first_node_that_reported_it(tmp_path):
    """n1 reports the endpoint id n0 reported first (real redis-server, the scheduler's
    peer table): the scheduler keeps listing that id with n0 and its addresses — in a
    second replica too — while n0 beats; once n0 stops, n1 gets it and keeps it while
    it beats, n0 back or not (attack review: a member could claim another's endpoint id
    and have the others dial its addresses for that id, or two nodes listed for one)."""
    eid = "cd" * 32

    def report(port: int) -> NodeReport:
        return NodeReport(p2p={"id": eid, "addrs": [f"10.0.0.{port}:7800"]})

    async def listed(table: PeerTable) -> list[tuple[str, str, list[str]]]:
        return [(p["node"], p["id"], p["addrs"]) for p in await table.answer(store, "observer")]

    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as url:
        store = ClusterStore(url)
        try:
            one, two = PeerTable(ttl_s=0), PeerTable(ttl_s=0)  # two scheduler replicas
            await store.heartbeat("n0", "http://n0", report(1))
            assert await listed(one) == [("n0", eid, ["10.0.0.1:7800"])]
            await store.heartbeat("n1", "http://n1", report(2))  # n1 claims n0's id
            assert await listed(one) == [("n0", eid, ["10.0.0.1:7800"])]
            assert await listed(two) == [("n0", eid, ["10.0.0.1:7800"])]
            stale = await store.now() - HEARTBEAT_TIMEOUT_S - 1  # n0 stops beating
            await store.heartbeat("n0", "http://n0", report(1), now=stale)
            await store.heartbeat("n1", "http://n1", report(2))
            assert await listed(two) == [("n1", eid, ["10.0.0.2:7800"])]
            await store.heartbeat("n0", "http://n0", report(1))  # n0 beats again: n1 keeps it
            assert await listed(one) == [("n1", eid, ["10.0.0.2:7800"])]
            assert await store.p2p_owners() == {eid: "n1"}
            await store.heartbeat("n1", "http://n1", NodeReport())  # n1 stops reporting it
            await store.heartbeat("n0", "http://n0", NodeReport())
            assert await listed(one) == [] and await store.p2p_owners() == {}
        finally:
            await store.aclose()


async def test_an_endpoint_id_written_into_redis_by_another_hand_is_not_vouched_for(tmp_path):
    """A node's endpoint id is tagged under the master secret beside its report
    (nodekeys.NodeKeys.p2p_tag): a Redis writer who swaps its own endpoint id and address
    into n0's report gets nothing listed — n0 stays a node (its binding tag holds), only
    its P2P address is dropped — until n0's next heartbeat writes its own again (attack
    review: the scheduler would have vouched for the writer's endpoint)."""
    import json

    from forkyard.cluster.nodekeys import NodeKeys

    eid, theirs = "ab" * 32, "ef" * 32
    (tmp_path / "redis").mkdir()
    with redis_server(tmp_path / "redis") as url:
        store = ClusterStore(url, keys=NodeKeys("m" * 32))
        try:
            table = PeerTable(ttl_s=0)
            mine = NodeReport(p2p={"id": eid, "addrs": ["10.0.0.1:7800"]})
            await store.heartbeat("n0", "http://n0", mine)
            assert [(p["node"], p["id"]) for p in await table.answer(store, "observer")] == [("n0", eid)]
            row = json.loads(await store._r.hget("fy:node:n0", "report"))
            row["p2p"] = {"id": theirs, "addrs": ["10.9.9.9:7800"]}
            await store._r.hset("fy:node:n0", "report", json.dumps(row))  # the tag is left as it was
            assert await table.answer(store, "observer") == []
            assert [n.node_id for n in await store.nodes()] == ["n0"]  # still a node, without its P2P address
            await store.heartbeat("n0", "http://n0", mine)
            assert [(p["node"], p["id"], p["addrs"]) for p in await table.answer(store, "observer")] == \
                [("n0", eid, ["10.0.0.1:7800"])]
        finally:
            await store.aclose()


def test_a_member_is_dialled_when_listed_so_a_restore_finds_the_connection_open(nodes, tmp_path):
    """A first dial made while the host's links change (every sandbox start) can stall
    for seconds, and the restore that made it then read the repository (the flaky first
    dial of tests/test_p2p_cluster): a newly listed member is dialled soon after it is
    listed, and a restore uses that connection — no dial of its own, every chunk from the
    peer. A warm dial counts as no peer failure."""
    (a, pa), (b, pb) = nodes(2, per={0: {"warm_after_s": 0.2}, 1: {"warm_after_s": 0.2}})
    deadline = time.monotonic() + 30
    while pa.endpoint_id not in pb._conns and time.monotonic() < deadline:
        time.sleep(0.1)
    warm = pb._conns.get(pa.endpoint_id)
    assert warm is not None and warm.close_reason() is None
    dials = []
    real = pb.transport.endpoint.connect
    pb.transport.endpoint = _Counting(pb.transport.endpoint, lambda *a: dials.append(a) or real(*a))
    src = _image(tmp_path)
    meta = _commit(a, src)
    assert _same(b.image(meta.snapshot_id), src)
    assert dials == [] and pb._conns[pa.endpoint_id] is warm
    st = pb.stats()
    assert st["chunks_from_peers"] == _chunks(a, meta.snapshot_id) and st["peer_failures"] == 0, st


def test_a_member_that_failed_is_dialled_again_when_its_backoff_ends(nodes, tmp_path, monkeypatch):
    """a answers too late once: b's restore reads the repository, drops its connection to
    a and skips a for the backoff (CI, stop 33: the restore after that backoff dialled a
    itself amid the links of 24 starting sandboxes, and that dial failed too). When the
    backoff ends b dials a again on its own, so the next restore finds a connection open
    — no dial of its own, every chunk from a."""
    monkeypatch.setattr(p2psvc, "BACKOFF_S", 2.0)
    (a, pa), (b, pb) = nodes(2, timeout_s=1.0, per={0: {"cls": SlowService, "warm_after_s": 0.2},
                                                     1: {"warm_after_s": 0.2}})
    deadline = time.monotonic() + 30
    while pa.endpoint_id not in pb._conns and time.monotonic() < deadline:
        time.sleep(0.1)
    first = pb._conns.get(pa.endpoint_id)
    assert first is not None
    pa.delay_s = 2.0  # over b's timeout
    src = _image(tmp_path / "one")
    meta = _commit(a, src)
    assert _same(b.image(meta.snapshot_id), src)
    assert pb.stats()["peer_failures"] >= 1 and b.metrics()["restore"]["chunks_fetched"] > 0
    pa.delay_s = 0.0
    deadline = time.monotonic() + p2psvc.BACKOFF_S + 15
    while time.monotonic() < deadline:
        again = pb._conns.get(pa.endpoint_id)
        if again is not None and again is not first and again.close_reason() is None:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"b did not dial a again after its backoff: {pb._conns}")
    dials = []
    real = pb.transport.endpoint.connect
    pb.transport.endpoint = _Counting(pb.transport.endpoint, lambda *x: dials.append(x) or real(*x))
    before = pb.stats()
    meta2 = _commit(a, _image(tmp_path / "two"))
    assert _same(b.image(meta2.snapshot_id), tmp_path / "two" / "src-image")
    got = pb.stats()
    assert dials == [] and pb._conns[pa.endpoint_id] is again
    assert got["chunks_from_peers"] - before["chunks_from_peers"] == _chunks(a, meta2.snapshot_id), got
    assert got["peer_failures"] == before["peer_failures"], got


class _Counting:
    """An endpoint whose ``connect`` goes through ``connect`` (the rest as it was)."""

    def __init__(self, endpoint, connect):
        self._endpoint, self.connect = endpoint, connect

    def __getattr__(self, name):
        return getattr(self._endpoint, name)
