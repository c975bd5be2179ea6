"""What a gateway remembers so sandbox traffic outlives a control-plane outage.

The gateway routes by the bindings in Redis. When Redis cannot be read it keeps routing
by what it saw last (:class:`RouteBook`: every binding and node list it read, bounded),
and for a sandbox it never saw it asks the nodes (:func:`ask_nodes`: the node that holds
it answers ``GET /sandboxes/{id}``). Nodes are the source of truth for what runs on
them, so asking them is always right; the book only saves the round trips.
:class:`Ownership` is the gateway's owner lookup on top of both.

What still needs Redis or the scheduler answers 503 with a message saying so: creates,
forks across nodes, moving a paused sandbox to another node, and listing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx

from forkyard.cluster.config import SECRET_HEADER
from forkyard.cluster.store import ClusterStoreUnavailable
from forkyard.cluster.types import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, NODE_UP, NodeInfo

log = logging.getLogger("forkyard.gateway")

#: Sandbox owners remembered (most recently used kept): 100k entries ≈ 20 MB.
BOOK_ENTRIES = 100_000
#: How long one node may take to answer "do you hold this sandbox?" (s).
ASK_TIMEOUT_S = 2.0
#: How long a sandbox's resolved owner is reused for its traffic (s).
OWNER_TTL_S = 1.0
#: Redis state younger than this (s) may still miss bindings (it lost its data; nodes
#: publish theirs again within a heartbeat): an unknown sandbox is first asked of the nodes.
FRESH_STATE_S = HEARTBEAT_TIMEOUT_S + 2 * HEARTBEAT_INTERVAL_S


class Fail(Exception):
    """A gateway answer other than the node's: ``status`` and the message (E2B's error body)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Route:
    """A sandbox's owner as last seen: ``node_id``, the binding's ``state`` and when
    (``seen``, monotonic s)."""

    node_id: str
    state: str
    seen: float


class RouteBook:
    """Last known node list and sandbox → node owners of one gateway (in memory; a
    restarted gateway starts empty and asks the nodes).

    Args:
        max_entries: owners kept, least recently used dropped first.
    """

    def __init__(self, max_entries: int = BOOK_ENTRIES):
        self.max_entries = max_entries
        self._routes: OrderedDict[str, Route] = OrderedDict()
        self.nodes: dict[str, NodeInfo] = {}

    def remember_nodes(self, nodes: dict[str, NodeInfo]) -> None:
        """Keep ``nodes`` (by id) as the last known node list."""
        self.nodes = dict(nodes)

    def remember(self, sandbox_id: str, node_id: str, state: str) -> None:
        """Keep ``sandbox_id``'s owner."""
        self._routes[sandbox_id] = Route(node_id, state, time.monotonic())
        self._routes.move_to_end(sandbox_id)
        while len(self._routes) > self.max_entries:
            self._routes.popitem(last=False)

    def forget(self, sandbox_id: str) -> None:
        """Drop what is known of ``sandbox_id`` (it is gone)."""
        self._routes.pop(sandbox_id, None)

    def last(self, sandbox_id: str) -> Route | None:
        """The last known owner of ``sandbox_id``, or None."""
        route = self._routes.get(sandbox_id)
        if route is not None:
            self._routes.move_to_end(sandbox_id)
        return route

    def __len__(self) -> int:
        return len(self._routes)


class Unanswered(Exception):
    """No node said it holds the sandbox, but some did not answer at all."""


async def ask_nodes(client: httpx.AsyncClient, nodes: list[NodeInfo], sandbox_id: str, key,
                    timeout_s: float = ASK_TIMEOUT_S) -> tuple[NodeInfo, dict] | None:
    """Ask every node in ``nodes`` at once whether it holds ``sandbox_id``
    (``GET /sandboxes/{id}`` with that node's own key, ``key(node) -> str``). Returns
    ``(node, its answer's JSON)`` of the first that does, or None when every node said it does not.

    Raises:
        Unanswered: none said so but some did not answer within ``timeout_s`` (the
            sandbox may be there: not a 404).
    """
    if not nodes:
        return None

    async def one(node: NodeInfo):
        try:
            r = await client.get(f"{node.url}/sandboxes/{sandbox_id}", headers={SECRET_HEADER: key(node)},
                                 timeout=httpx.Timeout(timeout_s, connect=min(1.0, timeout_s)))
        except httpx.HTTPError:
            return False
        if r.status_code == 404:
            return None
        try:
            return (node, r.json()) if r.status_code == 200 else False
        except ValueError:
            return False

    tasks = [asyncio.ensure_future(one(n)) for n in nodes]
    silent = 0
    try:
        for fut in asyncio.as_completed(tasks):
            got = await fut
            if got:
                return got
            silent += got is False
    finally:
        for t in tasks:
            t.cancel()
    if silent:
        raise Unanswered(f"{silent} of {len(nodes)} node(s) did not answer")
    return None


class Ownership:
    """Which node serves a sandbox, for the gateway (:class:`~.gateway.Gateway` mixes it
    in and provides ``store``, ``book``, ``node_key()``, ``_ask`` (an httpx client),
    ``_owners``, ``nodes()``, ``_schedule()`` and ``_node_call()``)."""

    async def owner(self, sandbox_id: str, move: bool = True, fresh: bool = False) -> NodeInfo:
        """The node serving ``sandbox_id``. A paused sandbox whose node is declared down,
        draining or silent is moved first when ``move`` (the scheduler rebinds it atomically),
        and a paused sandbox is always adopted by the node it is bound to before a REST call
        goes there (idempotent: a node that has it already keeps it) — so a move whose
        adopt never happened (a gateway died in between) heals on the next call; a paused
        sandbox whose node does not answer that adopt is moved at once. Without Redis the
        last known owner, or the node that says it holds it (:mod:`.routing`). ``fresh``:
        the node list is read now (a wake must see a drain that began a moment ago).

        Raises:
            Fail: 404 unknown or gone with its node; 503 no capacity / control plane down.
        """
        try:
            b = await self.store.binding(sandbox_id)
        except ClusterStoreUnavailable as e:
            return await self._owner_without_store(sandbox_id, e)
        if b is None:
            return await self._unbound(sandbox_id)
        self.book.remember(sandbox_id, b.node_id, b.state)
        node = (await self.nodes(fresh=fresh)).get(b.node_id)
        # A paused sandbox stays with a node that is up and heard from; one that is
        # draining, declared down or silent (cut off: it would refuse to resume it) moves.
        if node is not None and not node.declared_down and (
                b.state != "paused" or (node.status == NODE_UP and (node.alive() or not move))):
            if b.state == "paused" and move:
                try:
                    await self._adopt(node, b)
                except Fail as e:
                    if e.status != 502:
                        raise
                    return await self._move(b, unreachable=True)
            return node
        if b.state != "paused":
            raise Fail(404, f"sandbox {sandbox_id!r} not found (its node {b.node_id} is down)")
        if not move:
            raise Fail(404, f"sandbox {sandbox_id!r} is paused")
        try:
            return await self._move(b)
        except Fail as e:
            # No move (the scheduler is away — then every node is silent, its heartbeats go
            # there — or no other node has room): a node that is up and not declared down
            # keeps the call; it refuses a resume itself if it is cut off.
            if e.status != 503 or node is None or node.declared_down or node.status != NODE_UP:
                raise
            await self._adopt(node, b)
            return node

    async def _move(self, b, unreachable: bool = False) -> NodeInfo:
        """Resume-place paused binding ``b`` on another node (the scheduler decides: its
        node is down or draining, or — ``unreachable`` — does not answer it either) and
        have the target adopt it."""
        out = await self._schedule({"kind": "resume", "sandboxID": b.sandbox_id, "unreachable": unreachable})
        target_id = out["placements"][0]["nodeID"]
        target = (await self.nodes(fresh=True)).get(target_id)
        if target is None or target.declared_down:
            raise Fail(503, f"sandbox {b.sandbox_id!r} is paused on node {target_id}, which is unreachable; "
                             "retry shortly")
        if target_id == b.node_id and unreachable:
            raise Fail(503, f"node {target_id} holding paused sandbox {b.sandbox_id} did not answer this gateway "
                             "but answers the scheduler; retry shortly")
        await self._adopt(target, b)
        self.book.remember(b.sandbox_id, target_id, b.state)
        return target

    async def _unbound(self, sandbox_id: str) -> NodeInfo:
        """No binding: 404 with the cause a node recorded — unless a node holds it while
        the bindings may be behind: Redis's state is young (it lost its data: nodes are
        publishing theirs again) or some node's heartbeats are late (the scheduler is
        away, so what the nodes did meanwhile — a create answered just before it went —
        is not published yet). Then the nodes are asked; otherwise never (an unknown id
        costs one Redis read, not a call to every node) — except the node this gateway saw
        make it (its book), asked first: a create or fork answered just before the
        scheduler went away is not published, and the nodes' heartbeats are not late yet."""
        why = await self.store.death(sandbox_id)  # its node said why it died, if it did
        route = self.book.last(sandbox_id)
        if why is None and route is not None and route.node_id in self.book.nodes:
            # made through this gateway a moment ago, maybe not published yet (the
            # scheduler went away in between): its node is asked before any 404
            try:
                found = await self._ask_nodes_in([self.book.nodes[route.node_id]], sandbox_id, strict=True)
            except Unanswered as e:
                raise Fail(503, f"sandbox {sandbox_id!r} is not bound to a node yet and {e}; retry shortly") from e
            if found is not None:
                return found
        if why is None:
            age = await self.store.state_age()
            late = any(n.heartbeat_age() > 2 * HEARTBEAT_INTERVAL_S for n in (await self.nodes()).values()
                       if not n.declared_down)
            if age is None or age < FRESH_STATE_S or late:
                try:
                    found = await self._ask_nodes(sandbox_id, strict=True)
                except Unanswered as e:
                    raise Fail(503, f"sandbox {sandbox_id!r} is not bound to a node yet and {e}; retry shortly") from e
                if found is not None:
                    return found
        self.book.forget(sandbox_id)
        raise Fail(404, f"sandbox {sandbox_id!r} not found" + (f": {why}" if why else ""))

    async def _owner_without_store(self, sandbox_id: str, err: ClusterStoreUnavailable) -> NodeInfo:
        """Redis cannot be read: the owner last seen, else the node that says it holds
        ``sandbox_id``.

        Raises:
            Fail: 503 when neither is known.
        """
        route = self.book.last(sandbox_id)
        if route is not None and route.node_id in self.book.nodes:
            return self.book.nodes[route.node_id]
        found = await self._ask_nodes(sandbox_id)
        if found is not None:
            return found
        raise Fail(503, f"{err}; no node this gateway knows holds sandbox {sandbox_id}; retry when it is back")

    async def _ask_nodes(self, sandbox_id: str, strict: bool = False) -> NodeInfo | None:
        """The node (of those last known, not declared down) that holds ``sandbox_id``;
        None when none does. ``strict``: :class:`Unanswered` when some node did not
        answer (else that counts as "not there")."""
        try:
            nodes = {**self.book.nodes, **await self.nodes()}  # those Redis forgot too
        except ClusterStoreUnavailable:
            nodes = self.book.nodes
        return await self._ask_nodes_in(list(nodes.values()), sandbox_id, strict)

    async def _ask_nodes_in(self, nodes: list[NodeInfo], sandbox_id: str, strict: bool = False) -> NodeInfo | None:
        """:meth:`_ask_nodes` over ``nodes`` (those declared down are left out)."""
        try:
            got = await ask_nodes(self._ask, [n for n in nodes if not n.declared_down], sandbox_id,
                                  self.node_key)
        except Unanswered:
            if strict:
                raise
            got = None
        if got is None:
            return None
        node, info = got
        self.book.remember(sandbox_id, node.node_id, str(info.get("state", "running")))
        log.info("sandbox %s found by asking the nodes: node %s", sandbox_id, node.node_id)
        return node

    async def _adopt(self, node: NodeInfo, b) -> None:
        r = await self._node_call(node, "POST", "/cluster/adopt", b.record)
        if r.status_code not in (200, 409):  # 409: it runs there already
            raise Fail(r.status_code, f"node {node.node_id} could not take over paused sandbox "
                                       f"{b.sandbox_id}: {r.text[:300]}")

    async def _proxy_owner(self, sandbox_id: str) -> NodeInfo:
        """The node to relay ``sandbox_id``'s traffic to: its binding's node unless that
        one is declared down (a paused sandbox's own node answers for it, as a single
        node does). Without Redis, the owner last seen or asked (:meth:`owner`)."""
        hit = self._owners.get(sandbox_id)
        if hit is not None and time.monotonic() - hit[0] < OWNER_TTL_S:
            return hit[1]
        try:
            b = await self.store.binding(sandbox_id)
        except ClusterStoreUnavailable as e:
            node = await self._owner_without_store(sandbox_id, e)
        else:
            if b is None:
                node = await self._unbound(sandbox_id)
            else:
                self.book.remember(sandbox_id, b.node_id, b.state)
                node = (await self.nodes()).get(b.node_id)
                if node is None or node.declared_down:
                    raise Fail(404, f"sandbox {sandbox_id!r} " + ("is paused" if b.state == "paused" else
                                                                   f"not found (its node {b.node_id} is down)"))
        if len(self._owners) > 10_000:
            self._owners.clear()
        self._owners[sandbox_id] = (time.monotonic(), node)
        return node

