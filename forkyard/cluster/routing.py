"""What a gateway remembers so sandbox traffic outlives a control-plane outage.

The gateway routes by the bindings in Redis. When Redis cannot be read it keeps routing
by what it saw last (:class:`RouteBook`: every binding and node list it read, bounded),
and for a sandbox it never saw it asks the nodes (:func:`ask_nodes`: the node that holds
it answers ``GET /sandboxes/{id}``). Nodes are the source of truth for what runs on
them, so asking them is always right; the book only saves the round trips.

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
from forkyard.cluster.types import NodeInfo

log = logging.getLogger("forkyard.gateway")

#: Sandbox owners remembered (most recently used kept): 100k entries ≈ 20 MB.
BOOK_ENTRIES = 100_000
#: How long one node may take to answer "do you hold this sandbox?" (s).
ASK_TIMEOUT_S = 2.0


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


async def ask_nodes(client: httpx.AsyncClient, nodes: list[NodeInfo], sandbox_id: str, secret: str,
                    timeout_s: float = ASK_TIMEOUT_S) -> tuple[NodeInfo, dict] | None:
    """Ask every node in ``nodes`` at once whether it holds ``sandbox_id``
    (``GET /sandboxes/{id}`` with the cluster secret). Returns ``(node, its answer's
    JSON)`` of the first that does, or None when none does (or none answered within
    ``timeout_s``)."""
    if not nodes:
        return None

    async def one(node: NodeInfo):
        try:
            r = await client.get(f"{node.url}/sandboxes/{sandbox_id}", headers={SECRET_HEADER: secret},
                                 timeout=httpx.Timeout(timeout_s, connect=min(1.0, timeout_s)))
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        try:
            return node, r.json()
        except ValueError:
            return None

    tasks = [asyncio.ensure_future(one(n)) for n in nodes]
    try:
        for fut in asyncio.as_completed(tasks):
            got = await fut
            if got is not None:
                return got
    finally:
        for t in tasks:
            t.cancel()
    return None
