"""A node's chunk service: serve the chunks its cache holds to cluster members, and
fetch chunks from them before the repository.

**Who may fetch.** A connection is served only when the remote endpoint id (proven by
iroh's TLS handshake: the peer holds that Ed25519 key) is one the cluster's scheduler
vouches for: the scheduler lists in its heartbeat answers the endpoint ids that the
members reported in *their* heartbeats, which it takes only with each node's own key
(:mod:`forkyard.cluster.nodekeys`). :meth:`ChunkService.set_peers` installs that list;
any other endpoint is closed with :data:`~.transport.CLOSE_UNAUTHORIZED` before a
stream is read. Nodes hold no master secret, so this is how one member recognizes
another.

**What is served.** Only content-addressed chunks this node's cache holds: a cached
chunk as stored, or the bytes of a chunk inside a materialized image the cache holds,
located through that snapshot's committed manifest and compressed on the way out. The
requester verifies every chunk against its BLAKE3 name (:func:`~..chunks.decode`), so a
peer can make a chunk fail over to the repository but never change what is restored.

**Bounds.** Serving: at most ``max_serving`` transfers at once, and at most
``serve_per_peer`` of them for one member (counted by endpoint id over all its
connections), so one member flooding a node leaves the others served; more are answered
BUSY at once. What one member is sent is bounded to ``serve_bytes_per_s`` (a leaky
bucket per member, :mod:`aiolimiter`; each chunk waits for its stored size before it
is read out), so a member fetching from many streams cannot take more of this node's
uplink than that. A request names at most :data:`~.transport.MAX_BATCH` chunks, no hash
twice. Fetching: ``per_peer`` requests (of at most :data:`BATCH` chunks) in flight to
one peer; a request waits at most ``slot_wait_s`` for one of those slots (past it its
chunks go to the next peer or the repository; the peer is not blamed), a dial at most
:data:`CONNECT_S` (:data:`CONNECT_TRIES` times), and then ``timeout_s`` from the moment
it is sent to its answer's end; responses at most the chunks' sizes plus 1 KiB each
(:func:`~.transport.response_bound`). A peer that failed (connection, timeout, corrupt
chunk) or gave :data:`SLOW_STREAK` answers in a row slower than half ``timeout_s`` is
not asked again for :data:`BACKOFF_S`.

**Whom it dials.** A member's advertised addresses are checked by the scheduler and on
receipt (:func:`forkyard.cluster.p2p.valid_address`: unicast ``ip:port``); a loopback
address is dialled only when this node's own endpoint is bound to a loopback address
(a one-host cluster: tests, development) — else a member could make every node send
QUIC packets to a UDP port on that node's own host. At most :data:`MAX_ADDRS` per member.

**When it dials.** A member newly listed is dialled :data:`WARM_AFTER_S` later (then it
lists this node too) and the connection kept, so a restore finds it open: iroh rebinds its
UDP sockets at every network-interface change of the host — every sandbox start and stop
here, any node's — and a dial made meanwhile can stall for seconds (a restore starts a
sandbox at about the time it dials); an open connection outlives the rebinds. A warm
dial that fails is tried again (:data:`WARM_TRIES`) and is no peer failure. A member that
failed (its connection dropped) is dialled so again when its backoff ends, not by the
restore that next asks it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import iroh
from aiolimiter import AsyncLimiter

from forkyard.ids import is_name
from forkyard.repository import chunks as ck
from forkyard.repository.cache import NodeCache
from forkyard.repository.errors import ChunkCorrupt
from forkyard.repository.p2p import transport as tp
from forkyard.repository.repo import Repository

log = logging.getLogger("forkyard.p2p")

#: A peer that failed is skipped this long (s).
BACKOFF_S = 30.0
#: A peer that answered NOT_HELD for a snapshot is not asked for its chunks this long (s).
LACKS_S = 10.0
#: Peers asked for one chunk at most (then the repository).
MAX_TRIES = 2
#: Chunks per request (at most :data:`~.transport.MAX_BATCH`).
BATCH = 16
#: Snapshots whose chunk index (hash -> file, offset) the server keeps.
INDEX_CACHE = 32
#: Longest wait for a connection handshake from a dialling peer (s).
ACCEPT_S = 5.0
#: Longest wait for one dial of a peer (s), and dials per connection at most.
CONNECT_S, CONNECT_TRIES = 2.0, 2
#: Answers in a row slower than half the timeout after which a peer is skipped.
SLOW_STREAK = 8
#: Addresses of one member dialled at most.
MAX_ADDRS = 16
#: A member newly listed is dialled this long after (s; by then it lists this node too,
#: so the dial is no refusal), then every WARM_RETRY_S up to WARM_TRIES times until a
#: connection is open: restores then find it open instead of dialling.
WARM_AFTER_S, WARM_RETRY_S, WARM_TRIES = 5.0, 3.0, 5


def _why(e: BaseException) -> str:
    """``e`` for the log: an IrohError (whose ``str`` is empty) by its kind and the Rust
    error's debug text."""
    if isinstance(e, iroh.IrohError):
        try:
            return f"IrohError {e.kind().name}: {e.debug_message()}"
        except Exception:  # noqa: BLE001 — an older binding
            pass
    return f"{type(e).__name__}: {e}"


class SlotWait(Exception):
    """No per-peer request slot came free within ``slot_wait_s``: those chunks go
    elsewhere; not the peer's fault."""


class Skipped(Exception):
    """The peer failed while this request waited for its slot: nothing was sent, the
    chunks go elsewhere at once (a peer gone mid-restore cost ``timeout_s`` for every
    queued request of the batch: ~20 s for 12 MiB, not one ``timeout_s``)."""


def _loopback(hostport: str) -> bool:
    """Whether ``ip:port`` / ``[ip]:port`` names a loopback IP (False when unparsable)."""
    host = hostport.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@dataclass(frozen=True)
class Peer:
    """Another member as the scheduler lists it: its ``node`` id, iroh ``endpoint_id``
    (64 hex), direct ``addrs`` (``ip:port``) and the ``snapshots`` whose image it caches."""

    node: str
    endpoint_id: str
    addrs: tuple[str, ...]
    snapshots: frozenset[str] = field(default_factory=frozenset)


class ChunkService:
    """Serve and fetch chunks over a :class:`~.transport.Transport`.

    Args:
        cache: this node's cache (what is served); repo: the repository (manifests, to
            find a chunk inside a cached image).
        bind: UDP address of the endpoint (``host:port``); a loopback host lets this node
            dial members' loopback addresses (module doc). timeout_s, slot_wait_s (s),
            max_serving, serve_per_peer, per_peer (counts), serve_bytes_per_s (bytes/s
            sent to one member; None or 0: unbounded): the bounds of the module doc
            (``forkyard.config.P2PSettings``); counts below 1 are taken as 1.

    Raises:
        RuntimeError: the endpoint could not be bound.
    """

    def __init__(self, cache: NodeCache, repo: Repository, bind: str = "0.0.0.0:0", timeout_s: float = 5.0,
                 max_serving: int = 16, per_peer: int = 4, serve_per_peer: int = 4, slot_wait_s: float = 5.0,
                 warm_after_s: float | None = WARM_AFTER_S, serve_bytes_per_s: float | None = None):
        self.cache, self.repo = cache, repo
        self.warm_after_s = warm_after_s  # None: no warm dials (a member is dialled when a restore asks it)
        self.timeout_s, self.per_peer = float(timeout_s), max(1, int(per_peer))
        self.slot_wait_s = float(slot_wait_s)
        self.dials_loopback = _loopback(bind)
        self.transport = tp.Transport(bind)
        self._peers: dict[str, Peer] = {}  # endpoint id -> peer
        self._lock = threading.Lock()
        self._down: dict[str, float] = {}  # endpoint id -> skipped until (monotonic)
        self._lacks: dict[tuple[str, str], float] = {}  # (endpoint id, sid) -> until
        self._index: OrderedDict[str, dict[str, tuple[str, int, int]]] = OrderedDict()
        self._conns: dict[str, iroh.Connection] = {}
        self._warming: set[asyncio.Task] = set()
        self._dial: dict[str, asyncio.Lock] = {}
        self._slots: dict[str, asyncio.Semaphore] = {}
        self._serving = 0
        self._serving_to: dict[str, int] = {}  # endpoint id -> transfers served to it now
        self.serve_bytes_per_s = float(serve_bytes_per_s) if serve_bytes_per_s else None
        self._rate: dict[str, AsyncLimiter] = {}  # endpoint id -> its bytes/s bucket (serving loop only)
        self._slow: dict[str, int] = {}  # endpoint id -> slow answers in a row
        self.max_serving = max(1, int(max_serving))
        self.serve_per_peer = max(1, int(serve_per_peer))
        self.counters = {"chunks_from_peers": 0, "bytes_from_peers": 0, "peer_misses": 0, "peer_failures": 0,
                         "peer_corrupt": 0, "peer_slow": 0, "peer_slot_waits": 0, "served_chunks": 0,
                         "served_bytes": 0, "served_not_held": 0, "served_busy": 0, "served_rate_wait_ms": 0,
                         "refused_connections": 0}
        self._accept_task = asyncio.run_coroutine_threadsafe(self._accept_loop(), self.transport.loop)

    # ---- membership -------------------------------------------------------------------
    @property
    def endpoint_id(self) -> str:
        """This node's iroh endpoint id (64 hex digits)."""
        return self.transport.endpoint_id

    def address(self) -> dict:
        """What the node advertises in its heartbeat: ``{"id": endpoint id, "addrs": [ip:port…]}``."""
        return {"id": self.endpoint_id, "addrs": self.transport.addresses()}

    def set_peers(self, peers: list[Peer]) -> None:
        """Replace the members this node serves and asks (this node's own id is ignored);
        this node's connections to members no longer listed are closed, and theirs to it
        at their next request (:meth:`_serve_conn` checks every one). Of each member's
        ``addrs`` (checked as :func:`forkyard.cluster.p2p.valid_address` does) at most
        :data:`MAX_ADDRS` are kept, loopback ones only when :attr:`dials_loopback`."""
        table: dict[str, Peer] = {}
        for p in peers:  # one node per endpoint id (the scheduler sends no more): the first
            if p.endpoint_id != self.endpoint_id and p.endpoint_id not in table:
                table[p.endpoint_id] = self._dialable(p)
        with self._lock:
            old = set(self._peers)
            gone = [eid for eid in self._peers if eid not in table]
            self._peers = table
            for eid in gone:  # what is kept per peer stays bounded by the members
                self._slow.pop(eid, None)
                self._down.pop(eid, None)
                self._rate.pop(eid, None)
            self._lacks = {k: t for k, t in self._lacks.items() if k[0] in table and t > time.monotonic()}
        for eid in gone:
            self.transport.loop.call_soon_threadsafe(self._drop_conn, eid, b"no longer a cluster member")
        if self.warm_after_s is not None:
            for eid in table.keys() - old:
                self.transport.loop.call_soon_threadsafe(self._warm_soon, eid)

    def _warm_soon(self, eid: str, after_s: float | None = None) -> None:
        task = self.transport.loop.create_task(self._warm(eid, self.warm_after_s if after_s is None else after_s))
        self._warming.add(task)  # (the loop keeps only a weak reference)
        task.add_done_callback(self._warming.discard)

    async def _warm(self, eid: str, after_s: float) -> None:
        """Open a connection to member ``eid``, ``after_s`` seconds from now, before a
        restore needs one (module doc: a first dial made while the host's links change —
        every sandbox start — can stall; an open connection outlives that). A member in
        backoff is dialled when its backoff ends (that wait is one of the
        :data:`WARM_TRIES`). A failure here is no peer failure: nothing is counted, the
        member is not skipped; a restore dials it as before."""
        await asyncio.sleep(after_s)
        for attempt in range(WARM_TRIES):
            with self._lock:
                peer, until = self._peers.get(eid), self._down.get(eid, 0)
            if peer is None or not peer.addrs:
                return
            if until > time.monotonic():  # in backoff (it failed again): dial when that ends
                await asyncio.sleep(until - time.monotonic() + 1.0)
                continue
            try:
                await self._conn(peer)
                return
            except Exception as e:  # noqa: BLE001 — tried again; a restore would dial anyway
                log.debug("P2P: warm dial %d of %s failed: %s", attempt + 1, peer.node, _why(e))
            await asyncio.sleep(WARM_RETRY_S)

    def _dialable(self, p: Peer) -> Peer:
        addrs = tuple(dict.fromkeys(a for a in p.addrs if self.dials_loopback or not _loopback(a)))[:MAX_ADDRS]
        return p if addrs == p.addrs else Peer(p.node, p.endpoint_id, addrs, p.snapshots)

    def peers(self) -> list[Peer]:
        """The members known now."""
        with self._lock:
            return list(self._peers.values())

    def _count(self, **add: int) -> None:
        with self._lock:
            for k, v in add.items():
                self.counters[k] += v

    def stats(self) -> dict:
        """Counters (chunks and stored bytes fetched from / served to peers, misses,
        failures, corrupt chunks, refusals) plus ``endpoint_id``, ``peers`` and
        ``serving`` (transfers in progress)."""
        with self._lock:
            return {**self.counters, "endpoint_id": self.endpoint_id, "peers": len(self._peers),
                    "serving": self._serving}

    # ---- serving ----------------------------------------------------------------------
    async def _accept_loop(self) -> None:
        ep = self.transport.endpoint
        while True:
            try:
                inc = await ep.accept_next()
            except Exception as e:  # noqa: BLE001 — the endpoint is closing
                log.debug("P2P accept loop ends: %s", e)
                return
            if inc is None:
                return
            asyncio.get_running_loop().create_task(self._serve_conn(inc))

    async def _serve_conn(self, inc) -> None:
        try:
            conn = await asyncio.wait_for(self._handshake(inc), ACCEPT_S)
        except Exception as e:  # noqa: BLE001 — a failed handshake concerns only that peer
            log.debug("P2P handshake failed: %s", e)
            return
        rid = str(conn.remote_id())
        with self._lock:
            member = rid in self._peers
        if not member:
            self._count(refused_connections=1)
            log.warning("P2P: refused a connection from endpoint %s: not a member the scheduler vouches for", rid[:16])
            conn.close(tp.CLOSE_UNAUTHORIZED, b"not a member of this cluster")
            return
        conn.set_max_concurrent_bi_streams(self.per_peer * 2)
        while True:
            try:
                bi = await conn.accept_bi()
            except Exception:  # noqa: BLE001 — the peer closed the connection
                return
            with self._lock:  # membership is checked again for every request: a member
                member = rid in self._peers  # the scheduler no longer lists is cut off
            if not member:
                self._count(refused_connections=1)
                log.warning("P2P: closed the connection of endpoint %s: no longer a member", rid[:16])
                conn.close(tp.CLOSE_UNAUTHORIZED, b"no longer a member of this cluster")
                return
            asyncio.get_running_loop().create_task(self._serve_stream(bi, rid))

    @staticmethod
    async def _handshake(inc):
        return await (await inc.accept()).connect()

    async def _serve_stream(self, bi, rid: str) -> None:
        """Answer one request of member ``rid`` (endpoint id) on stream ``bi``: BUSY for
        every chunk when this node serves ``max_serving`` transfers, or ``serve_per_peer``
        to ``rid``, already."""
        send = bi.send()
        try:
            req = await asyncio.wait_for(tp.read_request(bi.recv()), self.timeout_s)
            if req is None or not is_name(req[0]):  # the sid names a directory of the cache
                return await tp.write_response(send, [tp.encode_item(tp.BAD_REQUEST)])
            sid, want = req
            with self._lock:
                mine = self._serving_to.get(rid, 0)
                busy = self._serving >= self.max_serving or mine >= self.serve_per_peer
                if not busy:
                    self._serving += 1
                    self._serving_to[rid] = mine + 1
            if busy:
                self._count(served_busy=1)
                return await tp.write_response(send, [tp.encode_item(tp.BUSY)] * len(want))
            try:
                if sid not in self._index and self.cache.held_image(sid) is not None:
                    await asyncio.to_thread(self._chunk_index, sid)  # a manifest read (S3): not on the loop
                items, served, nbytes, missing, waited = [], 0, 0, 0, 0.0
                rate = self._bucket(rid)
                for h, n in want:  # page-cache reads and ~0.2 ms of zstd each: no thread hop
                    blob = self._lookup(sid, h, n)
                    if blob is None:
                        missing += 1
                        items.append(tp.encode_item(tp.NOT_HELD))
                        continue
                    if rate is not None:
                        size = min(len(blob), rate.max_rate)
                        if not rate.has_capacity(size):  # past this member's bytes/s: wait for room
                            t0 = time.monotonic()
                            await asyncio.wait_for(rate.acquire(size), self.timeout_s)
                            waited += time.monotonic() - t0
                        else:
                            await rate.acquire(size)  # returns at once: it has room
                    served, nbytes = served + 1, nbytes + len(blob)
                    items.append(tp.encode_item(tp.OK, blob))
                await asyncio.wait_for(tp.write_response(send, items), self.timeout_s)
                self._count(served_chunks=served, served_bytes=nbytes, served_not_held=missing,
                            served_rate_wait_ms=int(waited * 1000))
            finally:
                with self._lock:
                    self._serving -= 1
                    left = self._serving_to.pop(rid) - 1
                    if left:
                        self._serving_to[rid] = left
        except Exception as e:  # noqa: BLE001 — one stream; the requester falls back
            log.debug("P2P: serving chunks failed: %s", e)

    def _bucket(self, rid: str) -> AsyncLimiter | None:
        """Member ``rid``'s bytes/s bucket (made at its first request; dropped when the
        scheduler stops listing it), or None when serving is not bounded."""
        if self.serve_bytes_per_s is None:
            return None
        bucket = self._rate.get(rid)
        if bucket is None:
            with self._lock:
                if rid not in self._peers:  # not a member now: keep nothing for it
                    return AsyncLimiter(self.serve_bytes_per_s, 1.0)
                bucket = self._rate.setdefault(rid, AsyncLimiter(self.serve_bytes_per_s, 1.0))
        return bucket

    def _lookup(self, sid: str, h: str, n: int) -> bytes | None:
        """Stored (zstd) bytes of chunk ``h`` from this node's cache, else from the
        cached image of ``sid``; None when neither holds it."""
        blob = self.cache.peek_chunk(h)
        if blob is not None:
            return blob
        image = self.cache.held_image(sid)
        if image is None:
            return None
        where = self._index.get(sid, {}).get(h)
        if where is None or where[2] != n:
            return None
        rel, off, length = where
        try:
            fd = os.open(image / rel, os.O_RDONLY)
        except OSError:
            return None
        try:
            raw = os.pread(fd, length, off)
        finally:
            os.close(fd)
        return ck.compress(raw) if len(raw) == length else None

    def _chunk_index(self, sid: str) -> dict[str, tuple[str, int, int]]:
        with self._lock:
            idx = self._index.get(sid)
            if idx is not None:
                self._index.move_to_end(sid)
                return idx
        m = self.repo.manifest(sid, check=False)
        idx = {}
        for f in m.files if m is not None else ():
            off = 0
            for h, n in f.chunks:
                idx.setdefault(h, (f.path, off, n))
                off += n
        with self._lock:
            self._index[sid] = idx
            while len(self._index) > INDEX_CACHE:
                self._index.popitem(last=False)
        return idx

    # ---- fetching ---------------------------------------------------------------------
    def _candidates(self, sid: str) -> list[Peer]:
        """Peers to ask for a chunk of ``sid``: those caching its image first, then the
        others (the table may be a heartbeat old); none without a dialable address, in
        backoff or known to lack it."""
        now = time.monotonic()
        with self._lock:
            ok = [p for p in self._peers.values() if p.addrs and self._down.get(p.endpoint_id, 0) <= now
                  and self._lacks.get((p.endpoint_id, sid), 0) <= now]
        random.shuffle(ok)
        ok.sort(key=lambda p: sid not in p.snapshots)
        return ok[:MAX_TRIES]

    def fetch_many(self, sid: str, want: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[bytes, bytes]]:
        """Chunks ``want`` (``[(hash, raw length)]``) of snapshot ``sid`` from peers,
        verified: ``{(hash, length): (stored blob, raw bytes)}`` for those a peer gave
        intact in time; the caller reads the others from the repository. Asks in requests
        of :data:`BATCH` chunks (a hash once: a repeat is left to the repository), up to
        ``per_peer`` at once; what one peer lacks or botches goes to the next (at most
        :data:`MAX_TRIES`). Blocking, at most about ``slot_wait_s`` + 2 dials +
        ``timeout_s`` per peer asked; never raises for a peer's fault."""
        got: dict[tuple[str, int], tuple[bytes, bytes]] = {}
        seen: set[str] = set()
        left = [(h, n) for h, n in want if not (h in seen or seen.add(h))]  # each hash once, first length
        bound = self.slot_wait_s + 2 * CONNECT_S * CONNECT_TRIES + self.timeout_s + 1.0
        for peer in self._candidates(sid):
            if not left:
                break
            parts = [left[i:i + BATCH] for i in range(0, len(left), BATCH)]
            try:
                answers = self.transport.call(self._ask_all(peer, sid, parts), bound)
            except Exception as e:  # noqa: BLE001 — any failure of the peer: next one / repository
                self._fail(peer, _why(e))
                continue
            corrupt = misses = waits = 0
            for part, answer in zip(parts, answers):
                if isinstance(answer, SlotWait):
                    waits += 1
                    continue
                if isinstance(answer, BaseException):  # a failure :meth:`_ask` recorded, or Skipped
                    continue
                items, took = answer
                self._timed(peer, took)
                for (h, n), (status, blob) in zip(part, items):
                    if status != tp.OK:
                        misses += 1
                        continue
                    try:
                        got[(h, n)] = (blob, ck.decode(h, blob, n))
                    except ChunkCorrupt:
                        corrupt += 1
            served = [hn for hn in left if hn in got]
            self._count(chunks_from_peers=len(served), bytes_from_peers=sum(len(got[hn][0]) for hn in served),
                        peer_misses=misses, peer_corrupt=corrupt, peer_slot_waits=waits)
            if corrupt:
                self._fail(peer, f"{corrupt} chunk(s) of {sid} failed verification")
            elif misses and not served:
                with self._lock:
                    self._lacks[(peer.endpoint_id, sid)] = time.monotonic() + LACKS_S
            left = [hn for hn in left if hn not in got]
        return got

    def fetch(self, sid: str, h: str, n: int) -> tuple[bytes, bytes] | None:
        """One chunk (:meth:`fetch_many`): ``(stored blob, raw bytes)`` or None."""
        return self.fetch_many(sid, [(h, n)]).get((h, n))

    def _fail(self, peer: Peer, why: str) -> None:
        self._count(peer_failures=1)
        with self._lock:
            first = self._down.get(peer.endpoint_id, 0) <= time.monotonic()
            self._down[peer.endpoint_id] = time.monotonic() + BACKOFF_S
        if first:
            log.warning("P2P: peer %s failed (%s); reading from the repository, not asking it for %.0f s",
                        peer.node, why[:300], BACKOFF_S)
        self.transport.loop.call_soon_threadsafe(self._drop_conn, peer.endpoint_id, b"failed")
        if first and self.warm_after_s is not None:  # open again when the backoff ends (module doc)
            self.transport.loop.call_soon_threadsafe(self._warm_soon, peer.endpoint_id, BACKOFF_S + 1.0)

    def _drop_conn(self, eid: str, reason: bytes) -> None:
        conn = self._conns.pop(eid, None)
        if conn is not None:
            try:
                conn.close(0, reason)
            except Exception:  # noqa: BLE001 — already closed
                pass

    async def _conn(self, peer: Peer):
        eid = peer.endpoint_id
        lock = self._dial.setdefault(eid, asyncio.Lock())
        async with lock:
            conn = self._conns.get(eid)
            if conn is None or conn.close_reason() is not None:
                if self._down.get(eid, 0) > time.monotonic():  # the dial before this one failed
                    raise Skipped(f"{peer.node} failed meanwhile")
                addr = iroh.EndpointAddr(iroh.EndpointId.from_string(eid), None, list(peer.addrs))
                for attempt in range(CONNECT_TRIES):  # a dial was seen to hang now and then (under load)
                    try:
                        conn = await asyncio.wait_for(self.transport.endpoint.connect(addr, tp.ALPN), CONNECT_S)
                        break
                    except asyncio.TimeoutError:
                        if attempt == CONNECT_TRIES - 1:
                            raise TimeoutError(f"no connection to {peer.node} within {CONNECT_S:.0f} s "
                                               f"({CONNECT_TRIES} tries)") from None
                self._conns[eid] = conn
            return conn

    async def _ask(self, peer: Peer, sid: str, want: list[tuple[str, int]]) -> tuple[list[tuple[int, bytes]], float]:
        """One request to ``peer``: ``([(status, blob)] in ``want``'s order, seconds from
        sending it to its answer's end)``.

        A failure puts the peer in backoff at once (:meth:`_fail`), so the requests
        still queued for its slots are not sent.

        Raises:
            SlotWait: no per-peer slot within ``slot_wait_s`` (nothing was sent).
            Skipped: the peer failed while this request waited (nothing was sent).
            TimeoutError: no connection (:meth:`_conn`), or no full answer within
                ``timeout_s`` of sending.
            IrohError, ValueError: the stream failed, or the answer is malformed.
        """
        slots = self._slots.setdefault(peer.endpoint_id, asyncio.Semaphore(self.per_peer))
        try:
            await asyncio.wait_for(slots.acquire(), self.slot_wait_s)
        except asyncio.TimeoutError:
            raise SlotWait(f"no request slot for {peer.node} within {self.slot_wait_s:.1f} s") from None
        try:
            if self._down.get(peer.endpoint_id, 0) > time.monotonic():
                raise Skipped(f"{peer.node} failed meanwhile")
            conn = await self._conn(peer)  # its own bound: CONNECT_S x CONNECT_TRIES
            t0 = time.monotonic()

            async def exchange():
                bi = await conn.open_bi()
                send = bi.send()
                await send.write_all(tp.encode_request(sid, want))
                await send.finish()
                return await tp.read_response(bi.recv(), want)

            try:
                items = await asyncio.wait_for(exchange(), self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer from {peer.node} within {self.timeout_s:.1f} s") from None
            return items, time.monotonic() - t0
        except Skipped:
            raise
        except Exception as e:
            self._fail(peer, _why(e))
            raise
        finally:
            slots.release()

    def _timed(self, peer: Peer, took: float) -> None:
        """Count an answer that took ``took`` seconds: :data:`SLOW_STREAK` in a row slower
        than half ``timeout_s`` skip ``peer`` like a failure; a faster one resets the count."""
        eid = peer.endpoint_id
        with self._lock:
            if took <= self.timeout_s / 2:
                self._slow.pop(eid, None)
                return
            self.counters["peer_slow"] += 1
            streak = self._slow[eid] = self._slow.get(eid, 0) + 1
            if streak >= SLOW_STREAK:
                del self._slow[eid]
        if streak >= SLOW_STREAK:
            self._fail(peer, f"{streak} answers in a row slower than {self.timeout_s / 2:.1f} s (last {took:.1f} s)")

    async def _ask_all(self, peer: Peer, sid: str, parts: list[list[tuple[str, int]]]) -> list:
        return await asyncio.gather(*(self._ask(peer, sid, p) for p in parts), return_exceptions=True)

    def close(self) -> None:
        """Stop serving and close every connection and the endpoint."""
        self.transport.close()  # its connections end with it; the accept loop is cancelled
