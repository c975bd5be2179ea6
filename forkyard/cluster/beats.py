"""The scheduler's heartbeat route, answered in front of the web framework (issue 26).

Every node sends ``POST /v1/nodes/{id}/heartbeat`` every second, so at 300 nodes this
is most of a scheduler's requests; a profile of one replica at 300 nodes put ~48 % of
its samples in the request path around it (the observability middleware, FastAPI's
routing and dependency stack) rather than in the heartbeat itself. :class:`LeanHeartbeats`
answers that one route as a bare ASGI handler before any of that: the same checks in the
same order as the scheduler's guard (:class:`~.scheduler._Guard`: the path rule, the
node's key for the URL it sends, checked from the headers before any body is read, and
the body bounded by :data:`~.scheduler.MAX_BODY` while it is read), the body validated
by the same pydantic model (:class:`Heartbeat`, pydantic-core parsing the JSON
directly), then one Redis script when nothing changed on the node. Bad input gets a 4xx
with a message, as from FastAPI: 403 for a body URL other than the key's, 413 for a body
over the bound, 422 for a body that does not validate, 503 while Redis is away.

Heartbeats do not go through :class:`~forkyard.obs.middleware.ObsMiddleware`: they get
no request id, no access-log line and no trace span; they are counted in
``forkyard_http_requests_total`` (``kind="api"``) as before.

**The stream** (:mod:`.beatstream`, a node with ``FORKYARD_BEAT_STREAM=on``):
``/v1/nodes/{id}/beats`` upgraded to a WebSocket after the same guard (the node's key for
the URL it sends, checked before the upgrade; a refusal is answered as HTTP, with its
status and message, where the server supports it, else a plain 403). Each text message
is one heartbeat body, answered by one message: the route's answer, or ``{code, message}``
where the route would have answered that status (422, 503; a 403 — the body's URL is
not the key's — closes the stream, 1008, as does a message over ``max_body``, 1009).
A stream silent for :data:`STREAM_IDLE_S` is closed (1001); a node holds one stream:
its newer one closes the older (1000). Stream heartbeats are counted in
``forkyard_heartbeat_stream_messages_total``, not as HTTP requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re

from pydantic import BaseModel, Field, ValidationError
from starlette.responses import JSONResponse

from forkyard.cluster.leanroute import error_response, problem
from forkyard.cluster.nodekeys import NODE_URL_HEADER, normal_url
from forkyard.cluster.p2p import PeerTable, valid_address
from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable
from forkyard.cluster.types import NODE_UP, NodeReport
from forkyard.obs import metrics
from forkyard.relay.body import BodyTooLarge, read_body

#: The heartbeat route: node id.
BEAT_ROUTE = re.compile(r"^/v1/nodes/([^/]+)/heartbeat$")
#: The heartbeat stream route (a WebSocket): node id.
STREAM_ROUTE = re.compile(r"^/v1/nodes/([^/]+)/beats$")
#: A stream without a message this long is closed (s): 3 heartbeat timeouts.
STREAM_IDLE_S = 15.0
#: Longest wait to hand one message to a stream's connection (s): past it the stream ends.
STREAM_SEND_S = 5.0

log = logging.getLogger("forkyard.cluster")


class Heartbeat(BaseModel):
    """A heartbeat's body (:func:`forkyard.cluster.messages.heartbeat_body` builds it)."""

    url: str = Field(max_length=512)
    #: the node's own view of its status (``up``/``draining``), used only when it
    #: registers anew (or Redis lost its data): otherwise the operator's status stands
    status: str = Field(default=NODE_UP, pattern="^(up|draining)$")
    report: dict = Field(default_factory=dict)
    #: the ids the node holds; None: only their ``digest`` is sent (nothing changed)
    held: list[str] | None = Field(default=None, max_length=200_000)
    #: those of ``held`` the node holds paused
    paused: list[str] = Field(default_factory=list, max_length=200_000)
    #: :func:`~forkyard.cluster.messages.held_digest` of the held ids (None: an older node)
    digest: str | None = Field(default=None, pattern="^[0-9a-f]{16}$")
    #: placement ids whose requests ended on the node before ``report`` was built
    placements: list[str] = Field(default_factory=list, max_length=10_000)


async def refuse_upgrade(scope, send, bad: JSONResponse) -> None:
    """Refuse a WebSocket upgrade (its ``websocket.connect`` already received) with
    ``bad``'s status and body as HTTP where the server supports that ASGI extension,
    else with a close (1008, which servers answer as a plain 403)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": bad.status_code, "headers": bad.raw_headers})
        return await send({"type": "websocket.http.response.body", "body": bad.body})
    await send({"type": "websocket.close", "code": 1008})


class Refused(Exception):
    """A heartbeat answered with ``status`` and ``message`` (a 4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def heartbeat(store: ClusterStore, node_id: str, body: Heartbeat, key_url: str,
                    peer_table: PeerTable | None = None) -> dict:
    """Record ``body``, the heartbeat of ``node_id`` whose key is bound to ``key_url``
    (checked by the caller). Returns ``{status, foreign, missing, adopt[, resend][, peers]}``:
    without ``held`` (nothing changed on the node) one script and, when the node's digest
    agrees with its bindings', nothing else; ``resend`` asks for the ids; ``peers`` (from
    ``peer_table``) only to a node whose report carries a P2P address (:mod:`.p2p`).

    Raises:
        Refused: 403, the body's URL is not the key's.
        ClusterStoreUnavailable: Redis failed.
    """
    if normal_url(body.url) != normal_url(key_url):
        raise Refused(403, f"heartbeat url {body.url!r} is not the one node {node_id}'s key is bound to")
    # acks in the same script as the report that shows their sandboxes
    digests: dict[str, str] = {}
    status = await store.heartbeat(node_id, normal_url(body.url), NodeReport.from_dict(body.report),
                                   own_status=body.status, acked=body.placements, digests=digests)
    # a P2P node learns the other members' iroh addresses here (.p2p: the scheduler vouches)
    peers = {"peers": await peer_table.answer(store, node_id)} \
        if peer_table is not None and valid_address(body.report.get("p2p")) else {}
    if body.held is None:  # only the digest: O(1) when the bindings agree, else ask for the ids
        same = body.digest is not None and body.digest == digests[node_id]
        return {"status": status, "foreign": [], "missing": [], "adopt": [], **peers,
                **({} if same else {"resend": True})}
    foreign, missing, adopt = await store.reconcile(node_id, set(body.held), set(body.paused))
    if body.digest and not (foreign or missing or adopt) and body.digest != digests[node_id]:
        await store.redigest(node_id)  # the sets agree: heal a digest kept before digests existed
    return {"status": status, "foreign": foreign, "missing": missing, "adopt": adopt, **peers}


async def _send(scope, receive, send, resp: JSONResponse) -> None:
    metrics.HTTP_REQUESTS.labels("api", f"{resp.status_code // 100}xx").inc()
    await resp(scope, receive, send)


class LeanHeartbeats:
    """ASGI app: ``POST /v1/nodes/{id}/heartbeat`` answered here (see the module
    docstring), every other request passed to ``app``.

    Args:
        app: the scheduler's app with its middlewares.
        guard: the scheduler's guard; its ``refusal(scope, headers)`` checks the path,
            the credential and the announced length before the body is read.
        store: the cluster state.
        max_body: the largest body read (bytes).
        peer_table: the P2P members' addresses sent to P2P nodes (:mod:`.p2p`).
    """

    def __init__(self, app, guard, store: ClusterStore, max_body: int, peer_table: PeerTable | None = None):
        self.app, self.guard, self.store, self.max_body, self.peer_table = app, guard, store, max_body, peer_table
        self._streams: dict[str, asyncio.Task] = {}  # node id -> the task serving its stream

    def __getattr__(self, name):  # the wrapped app's attributes
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and (m := STREAM_ROUTE.match(scope["path"])):
            return await self._stream(scope, receive, send, m.group(1))
        if scope["type"] != "http" or scope["method"] != "POST" or not (m := BEAT_ROUTE.match(scope["path"])):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (bad := self.guard.refusal(scope, headers)) is not None:
            return await bad(scope, receive, send)
        try:
            try:
                raw = await read_body(receive, self.max_body)
            except BodyTooLarge as e:
                raise Refused(413, str(e)) from e
            if raw is None:
                return
            try:
                body = Heartbeat.model_validate_json(raw)
            except ValidationError as e:
                raise Refused(422, problem(e, "heartbeat")) from e
            out = await heartbeat(self.store, m.group(1), body, headers.get(NODE_URL_HEADER, ""), self.peer_table)
        except Refused as e:
            return await _send(scope, receive, send, error_response(e.status, str(e)))
        except ClusterStoreUnavailable as e:
            return await _send(scope, receive, send, error_response(503, f"{e}; retry when Redis is back"))
        await _send(scope, receive, send, JSONResponse(out))

    async def _stream(self, scope, receive, send, node_id: str) -> None:
        """Serve one node's heartbeat stream (module docstring)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if (await receive())["type"] != "websocket.connect":
            return
        if (bad := self.guard.refusal(scope, headers)) is not None:
            return await refuse_upgrade(scope, send, bad)
        await send({"type": "websocket.accept"})
        me = asyncio.current_task()
        if (older := self._streams.get(node_id)) is not None:  # one stream a node: the newer stands
            older.cancel()  # (it closes itself: below)
        self._streams[node_id] = me
        key_url = headers.get(NODE_URL_HEADER, "")

        async def out(msg: dict) -> None:  # a node that reads no answer holds nothing long
            async with asyncio.timeout(STREAM_SEND_S):
                await send(msg)

        try:
            while True:
                try:
                    async with asyncio.timeout(STREAM_IDLE_S):
                        msg = await receive()
                except TimeoutError:
                    return await out({"type": "websocket.close", "code": 1001, "reason": "no heartbeat"})
                if msg["type"] != "websocket.receive":
                    return
                raw = msg.get("text") or msg.get("bytes") or b""
                # (uvicorn bounds a message to the same in bytes: ws_max_size, cli/cluster.py;
                # this holds under any server, encoding only a text that could be over)
                if len(raw) > self.max_body or (isinstance(raw, str) and 4 * len(raw) > self.max_body
                                                and len(raw.encode()) > self.max_body):
                    return await out({"type": "websocket.close", "code": 1009, "reason": "heartbeat over the bound"})
                metrics.BEAT_STREAM_MESSAGES.inc()
                try:
                    answer = await heartbeat(self.store, node_id, Heartbeat.model_validate_json(raw), key_url,
                                             self.peer_table)
                except ValidationError as e:
                    answer = {"code": 422, "message": problem(e, "heartbeat")}
                except Refused as e:
                    await out({"type": "websocket.send", "text": json.dumps({"code": e.status, "message": str(e)})})
                    return await out({"type": "websocket.close", "code": 1008})
                except ClusterStoreUnavailable as e:
                    answer = {"code": 503, "message": f"{e}; retry when Redis is back"}
                await out({"type": "websocket.send", "text": json.dumps(answer, separators=(",", ":"))})
        except asyncio.CancelledError:
            if self._streams.get(node_id) is me or me.cancelling() > 1:
                raise  # not replaced by a newer stream (the server is stopping): as asked
            me.uncancel()
            with contextlib.suppress(Exception):
                await out({"type": "websocket.close", "code": 1000, "reason": "a newer stream of this node"})
        except (TimeoutError, OSError) as e:  # an answer not taken in time; the connection gone
            log.info("heartbeat stream of node %s ended: %s", node_id, type(e).__name__)
        finally:
            if self._streams.get(node_id) is me:
                del self._streams[node_id]
