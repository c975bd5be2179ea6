"""The gateway's own REST routes: what it answers from Redis instead of forwarding to a
node (:class:`~.gateway.Gateway` mounts :func:`rest_app` as its ``api``): health, the
cluster-wide sandbox list one page at a time, and the cluster's counts."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import Protocol

from fastapi import Depends, FastAPI, Response
from fastapi.responses import JSONResponse

from forkyard.api import schemas
from forkyard.api.routes_sandboxes import ListQuery, filter_records, list_filters, parse_metadata
from forkyard.cluster.listing import decode_cursor, encode_cursor, record_of
from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable
from forkyard.cluster.types import NodeInfo
from forkyard.ids import micros
from forkyard.orchestrator.errors import OrchestratorError
from forkyard.orchestrator.store import SandboxRecord

_RECORD_FIELDS = {f.name for f in fields(SandboxRecord)}


def _record(d: dict) -> SandboxRecord:
    return SandboxRecord(**{k: v for k, v in d.items() if k in _RECORD_FIELDS})


class GatewayView(Protocol):
    """What these routes use of the gateway (:class:`~.gateway.Gateway` has it)."""

    store: ClusterStore

    async def nodes(self, fresh: bool = False, stale_ok: bool = True) -> dict[str, NodeInfo]:
        """The nodes with a valid record by id (reused ≤ 0.5 s unless ``fresh``; while Redis
        cannot be read, the last list read if ``stale_ok``, else ClusterStoreUnavailable)."""

    async def aclose(self) -> None:
        """Close the gateway's clients."""


async def page(gw: GatewayView, metadata: str | None, states: set[str], template: str | None, after: int | None,
                before: int | None, desc: bool, next_token: str | None, limit: int
                ) -> tuple[list[dict], str | None]:
    """One page of the sandboxes a client can see, cluster-wide, from the list
    indexes (:mod:`.listing`: reads only the page): bindings whose node is not
    declared down, and paused ones whatever their node; filters and order as a
    node's list (:func:`~forkyard.api.routes_sandboxes.filter_records`). Returns the
    listed items (with ``nodeID``) and the next page's token (None: last page).
    ``after``/``before``: :func:`~forkyard.api.routes_sandboxes.list_filters`' bounds (µs).

    Raises:
        ClusterStoreUnavailable: listing needs Redis (503).
        BadRequest: a token the gateway did not issue (400).
    """
    nodes = await gw.nodes(stale_ok=False)
    want = parse_metadata(metadata)
    recs: dict[str, SandboxRecord] = {}  # by the binding's record text: decoded once a page

    def rec_of(row: dict) -> SandboxRecord:
        text = row.get("record", "")
        if (rec := recs.get(text)) is None:
            rec = recs[text] = _record(record_of(row))
        return rec

    def accept(row: dict) -> bool:
        n = nodes.get(row.get("node", ""))
        if row.get("state") != "paused" and (n is None or n.declared_down):
            return False
        rec = rec_of(row)
        at = micros(rec.started_at)
        return bool(filter_records([rec], metadata, states, template)) and \
            (after is None or at >= after) and (before is None or at <= before)

    cursor = decode_cursor(next_token) if next_token else None
    # the index's bounds (s) hold every match (1 µs wider); accept() compares exactly
    lo = None if after is None else after / 1e6 - 1e-6
    hi = None if before is None else before / 1e6 + 1e-6
    got, more = await gw.store.page(states, want, template, lo, hi, desc, cursor, limit, accept)
    items = []
    for _, sid, row in got:
        item = schemas.sandbox_listed(rec_of(row))
        item["nodeID"] = row.get("node")  # which node holds it (forkyard ls shows it; SDKs ignore it)
        items.append(item)
    return items, encode_cursor(got[-1][0], got[-1][1]) if more and got else None


def rest_app(gw: GatewayView) -> FastAPI:
    """The routes the gateway answers on its own (``Gateway.api``): ``/health``, the
    cluster-wide sandbox lists (E2B's ``GET /sandboxes`` and ``GET /v2/sandboxes``, from
    the list indexes: :func:`page`) and ``/metrics/node`` = ``/metrics/cluster`` (counts
    and every node). Errors: an :class:`OrchestratorError` answers its status, Redis
    away 503."""

    async def lifespan(app):
        yield
        await gw.aclose()

    app = FastAPI(title="forkyard gateway", lifespan=asynccontextmanager(lifespan))

    @app.exception_handler(OrchestratorError)
    async def _orch_error(request, exc: OrchestratorError):
        return JSONResponse(schemas.error(exc.status, str(exc)), status_code=exc.status)

    @app.exception_handler(ClusterStoreUnavailable)
    async def _unavailable(request, exc):
        return JSONResponse(schemas.error(503, f"{exc}; retry when it is back"), status_code=503)

    @app.get("/health")
    async def health():
        ok = await gw.store.ping()
        return JSONResponse({"status": "ok" if ok else "degraded", "redis": ok}, status_code=200 if ok else 503)

    @app.get("/sandboxes")
    async def list_v1(metadata: str | None = None):
        list_filters(metadata, None, None, None)
        out, token = [], None
        while True:  # E2B's v1 list has no pages: every running match, read a page at a time
            items, token = await page(gw, metadata, {"running"}, None, None, None, True, token, 1000)
            out += items
            if token is None:
                return JSONResponse(out)  # JSON-native dicts: no jsonable_encoder walk over every item

    @app.get("/v2/sandboxes")
    async def list_v2(q: ListQuery = Depends()):
        states, after, before = list_filters(q.metadata, q.state, q.started_after, q.started_before)
        items, token = await page(gw, q.metadata, states, q.template, after, before, q.order != "asc",
                                  q.next_token, q.limit)
        # JSON-native dicts, sent as they are: FastAPI's jsonable_encoder walking every item
        # of a page was a fifth of the gateway's CPU while a client listed (issue 26)
        return JSONResponse(items, headers={"x-next-token": token} if token else None)

    nodes_json = _NodesJSON(gw)

    @app.get("/metrics/node")
    @app.get("/metrics/cluster")
    async def cluster_metrics():
        counts = await gw.store.counts()
        body = b'{"sandboxes":' + json.dumps(counts).encode() + b',"nodes":' + await nodes_json.get() + b"}"
        return Response(body, media_type="application/json")

    return app


#: ``/metrics/cluster``'s node list is at most this old (s): read and serialized once
#: per interval however often it is asked (at 300 nodes that is 300 hashes and ~1 MB of
#: JSON), the same age as the node reports themselves (one heartbeat a second). The
#: sandbox counts are read on every request.
CLUSTER_NODES_MAX_AGE_S = 1.0


class _NodesJSON:
    """The JSON array of every node (``NodeInfo.to_dict``, by id), refreshed when older
    than :data:`CLUSTER_NODES_MAX_AGE_S`; concurrent requests wait for one refresh."""

    def __init__(self, gw: GatewayView):
        self.gw, self._at, self._body, self._lock = gw, -1e9, b"[]", asyncio.Lock()

    async def get(self) -> bytes:
        """The array (bytes). Raises ClusterStoreUnavailable when a refresh is due and
        Redis cannot be read."""
        async with self._lock:
            if time.monotonic() - self._at > CLUSTER_NODES_MAX_AGE_S:
                nodes = await self.gw.nodes(fresh=True, stale_ok=False)
                self._body = json.dumps([n.to_dict() for _, n in sorted(nodes.items())],
                                        separators=(",", ":")).encode()
                self._at = time.monotonic()
            return self._body
