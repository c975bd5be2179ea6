"""``forkyard gateway`` (:8080): the cluster's one E2B-compatible endpoint.

Stateless: it reads bindings and nodes from Redis and asks the scheduler to place; any
number of gateways can run behind a load balancer. What goes where:

* sandbox traffic (``E2b-Sandbox-Id``/``-Port`` headers or host ``PORT-ID.DOMAIN``; HTTP,
  streaming, WebSocket) → the owning node's proxy, with the routing headers set so the
  host form works too. No API key (envd checks its own token), as on a node;
* ``POST /sandboxes`` ``/v2/sandboxes`` → the node the scheduler places it on;
* ``GET /sandboxes`` ``/v2/sandboxes`` → the bindings in Redis (every node's sandboxes,
  E2B's filters and pagination); ``GET /metrics/node`` → the cluster's counts and nodes;
* ``/sandboxes/{id}/…``, ``/v2/sandboxes/{id}/connect`` → the owning node; a paused
  sandbox whose node is down or draining is first moved (scheduler rebinds it, the new
  node adopts it) and then served there — it resumes from the shared repository;
* ``POST /sandboxes/{id}/fork`` → the source's node; children that do not fit there are
  started on other nodes from the one checkpoint, exported to the repository;
* ``/volumes/{id}`` and the volume content API (``/volumecontent/{id}/…``, the volume's
  own token, no API key) → the node that holds the volume's lease, else any node
  (:mod:`.volumes`); a create whose ``volumeMounts`` name a held volume is placed on its
  holder;
* everything else (templates, snapshots, repository metrics, ``/volumes``) → one node
  (the lowest id that is up), since templates and snapshots live in the shared
  repository and volumes in the shared volumes directory.

Calls to nodes carry that node's own key (:mod:`.nodekeys`: derived from the cluster
secret, bound to the node's id and URL) instead of the user's API key — never the
secret itself — and go only to nodes whose Redis record carries a valid binding tag
(:meth:`~.store.ClusterStore.nodes`), so a record planted in Redis or a node posing as
another receives no traffic and no credential. Sandbox answers
carry the gateway's own ``domain`` (``FORKYARD_DOMAIN``, else ``localhost:PORT``), so the
SDKs' ``get_host()`` comes back here.

**Outages** (issue 19): a node counts as gone only once the scheduler declared it down
(:mod:`.liveness`), never because its heartbeats are late — they are late whenever the
scheduler or Redis is away. While Redis is down, routing goes on from the last bindings
seen and by asking the nodes (:mod:`.routing`); creates, moves and listings answer 503.
A paused sandbox whose node does not answer is moved at once (the scheduler checks the
node first), and a ``connect``/``resume`` a draining node refuses is resumed elsewhere.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time

import httpx
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from forkyard.api import schemas
from forkyard.cluster.gateway_rest import rest_app
from forkyard.cluster.config import DRAINING_HEADER, PLACEMENT_HEADER, SECRET_HEADER
from forkyard.cluster.nodekeys import NodeKeys
from forkyard.cluster.routing import Fail as _Fail
from forkyard.cluster.routing import Ownership, RouteBook
from forkyard.cluster.schedclient import SchedulerClient
from forkyard.cluster.store import ClusterStore, ClusterStoreUnavailable
from forkyard.cluster.types import NODE_DRAINING, NODE_UP, NodeInfo
from forkyard.ids import SANDBOX_ID
from forkyard.obs import logs
from forkyard.orchestrator.volumes.store import HOLDER_HEADER
from forkyard.relay import fastpath, paths
from forkyard.relay.errors import send_error
from forkyard.relay.body import BodyTooLarge, read_body
from forkyard.relay.fastpath import relay_bodyless
from forkyard.relay.headers import HOP, HOP_OUT, WS_SKIP, client_headers, target_path
from forkyard.relay.http import relay_http
from forkyard.relay.paths import orchestrator_only
from forkyard.relay.websocket import relay_ws
from forkyard.routing import route_of

log = logging.getLogger("forkyard.gateway")

_SCOPED = re.compile(rf"^/(?:v2/)?sandboxes/({SANDBOX_ID})(/.*)?$")
_FORK = re.compile(rf"^/sandboxes/({SANDBOX_ID})/fork$")
#: A volume's own routes, and its content API (``Authorization: Bearer <its token>``).
_VOLUME = re.compile(r"^/volumes/([^/]+)$")
_VOLUME_CONTENT = re.compile(r"^/volumecontent/([^/]+)/")
#: The one key-less REST route: a template build's signed COPY upload URL.
_UPLOAD = re.compile(r"^/template-files/[0-9a-f]{64}$")
#: Calls that may resume a sandbox (retried on another node when a draining node refuses).
_WAKE = re.compile(rf"^/(?:v2/)?sandboxes/({SANDBOX_ID})/(?:connect|resume)$")
#: How often a connect/resume is sent again after a draining node refused it.
WAKE_ATTEMPTS = 3
#: Largest JSON body the gateway itself parses (create, fork): bytes.
MAX_JSON_BODY = 1 << 20
#: How long resolved node lists / sandbox owners are reused for sandbox traffic (s).
NODES_TTL_S = 0.5
#: Placements tried for one create whose nodes refuse it for capacity (503) or fail it
#: (500, 502, 507: e.g. a full disk there).
CREATE_ATTEMPTS = 3
_REPLACE = {500, 502, 503, 507}
_NODE_SKIP = HOP | {"x-api-key", SECRET_HEADER, PLACEMENT_HEADER, DRAINING_HEADER}  # the last three: only ours


def _replay(body: bytes):
    """An ASGI ``receive`` that yields ``body`` once (a body the gateway already read)."""
    done = False

    async def receive():
        nonlocal done
        if done:
            return {"type": "http.disconnect"}
        done = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class Gateway(Ownership):
    """The gateway's ASGI app (ownership and routing of sandboxes: :class:`~.routing.Ownership`).

    Args:
        store: cluster state (Redis).
        scheduler_url: the scheduler's base URL (several replicas: comma-separated);
            secret: the cluster's master secret (scheduler calls; node keys derive from it).
        api_key: the users' API key (``X-API-Key``), the same on every node.
        max_body_bytes: largest body forwarded to a sandbox or node (uploads), bytes.
        domain: the ``domain`` sandbox answers carry (``host[:port]``; None: the
            node's own, which bypasses the gateway).
    """

    def __init__(self, store: ClusterStore, scheduler_url: str, secret: str, api_key: str,
                 max_body_bytes: int = 4 << 30, domain: str | None = None):
        self.store, self.api_key = store, api_key
        self.keys = store.keys = NodeKeys(secret)  # node records count only with their binding tag
        self.max_body_bytes = max_body_bytes
        self.domain = domain
        self.sched = SchedulerClient(scheduler_url, secret, timeout_s=30.0)
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._fast: dict[str, fastpath.FastConnections] = {}  # per node URL: bodyless sandbox traffic
        self._nodes: tuple[float, dict[str, NodeInfo]] = (0.0, {})
        self._owners: dict[str, tuple[float, NodeInfo]] = {}
        #: last known bindings and nodes, for routing while Redis is away (.routing)
        self.book = RouteBook()
        self._ask = httpx.AsyncClient(trust_env=False)
        self.api = rest_app(self)

    # ---- plumbing ---------------------------------------------------------------------
    def _client(self, node: NodeInfo) -> httpx.AsyncClient:
        client = self._clients.get(node.url)
        if client is None:
            client = self._clients[node.url] = httpx.AsyncClient(
                trust_env=False, timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            client.headers = httpx.Headers()  # forward only what the client sent
        return client

    async def aclose(self) -> None:
        """Close every connection and the Redis pool."""
        for c in self._clients.values():
            await c.aclose()
        for fast in self._fast.values():
            fast.close()
        await self.sched.aclose()
        await self._ask.aclose()
        await self.store.aclose()

    async def nodes(self, fresh: bool = False, stale_ok: bool = True) -> dict[str, NodeInfo]:
        """Registered nodes by id (reused for :data:`NODES_TTL_S` unless ``fresh``).
        While Redis cannot be read, the last list read (``stale_ok``).

        Raises:
            ClusterStoreUnavailable: Redis failed and no list was read before.
        """
        ts, nodes = self._nodes
        if fresh or time.monotonic() - ts > NODES_TTL_S:
            try:
                nodes = {n.node_id: n for n in await self.store.nodes()}
            except ClusterStoreUnavailable:
                if not (stale_ok and self.book.nodes):
                    raise
                return self.book.nodes
            self._nodes = (time.monotonic(), nodes)
            if nodes:  # an empty list (Redis lost its data) does not erase what was known
                self.book.remember_nodes(nodes)
        return nodes

    async def any_node(self) -> NodeInfo:
        """The node that serves cluster-wide calls: the lowest id that is up (heard
        from lately if any is; a silent one is not declared gone)."""
        nodes = sorted((await self.nodes()).items())
        for want_alive in (True, False):
            for _, n in nodes:
                if n.status == NODE_UP and (n.alive() or not want_alive):
                    return n
        raise _Fail(503, "no node is up in the cluster; start `forkyard node --scheduler URL` on a host")

    async def _volume_node(self, volume_id: str) -> NodeInfo:
        """The node that holds ``volume_id``'s lease (:mod:`.volumes`), else (none, or
        Redis cannot tell) :meth:`any_node`: it takes the lease for the call."""
        try:
            (holder,) = await self.store.volume_holders(ids=[volume_id[:64]])
        except ClusterStoreUnavailable:
            holder = ""
        node = (await self.nodes()).get(holder) if holder else None
        return node if node is not None else await self.any_node()

    async def _schedule(self, body: dict) -> dict:
        try:
            # Sent again to another replica also when a connection broke mid-call: a
            # placement made twice only holds room until it expires (PLACING_TTL_S).
            r = await self.sched.post("/v1/placements", json=body, headers=logs.outgoing())
        except httpx.HTTPError as e:
            raise _Fail(503, f"scheduler unreachable ({e!r}): creates, forks and moves to another node wait "
                             "for it; running sandboxes are still served; retry shortly") from e
        if r.status_code != 200:
            try:
                msg = r.json().get("message", r.text)
            except ValueError:
                msg = r.text
            raise _Fail(r.status_code if r.status_code < 500 else 503, msg)
        return r.json()

    async def _node_call(self, node: NodeInfo, method: str, path: str, body=None,
                         placement: str | None = None) -> httpx.Response:
        headers = {SECRET_HEADER: self.node_key(node), **logs.outgoing()}
        if placement:
            headers[PLACEMENT_HEADER] = placement
        try:
            return await self._client(node).request(method, node.url + path, json=body, headers=headers,
                                                    timeout=httpx.Timeout(300.0, connect=5.0))
        except httpx.HTTPError as e:
            raise _Fail(502, f"node {node.node_id} is not reachable: {e!r}") from e

    # ---- ASGI -----------------------------------------------------------------------------
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self.api(scope, receive, send)
        try:
            await self._dispatch(scope, receive, send)
        except _Fail as e:
            await self._fail(scope, receive, send, e.status, str(e))
        except ClusterStoreUnavailable as e:
            await self._fail(scope, receive, send, 503, f"{e}; retry when it is back")

    async def _fail(self, scope, receive, send, status: int, message: str) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1011 if status >= 500 else 1008})
        else:
            await JSONResponse(schemas.error(status, message), status_code=status)(scope, receive, send)

    async def _dispatch(self, scope, receive, send):
        try:
            route = route_of(scope)
        except ValueError as e:
            raise _Fail(400, str(e)) from e
        if route is not None:
            return await self._sandbox_traffic(scope, receive, send, *route)
        if scope["type"] != "http":
            return await send({"type": "websocket.close", "code": 1008})
        if problem := paths.path_problem(scope):  # decide on exactly what is forwarded (issue 25)
            raise _Fail(400, problem)
        path, method = scope["path"], scope["method"]
        if path == "/health":
            return await self.api(scope, receive, send)
        if method == "PUT" and _UPLOAD.match(path):  # signed URL, checked by the node: no key, no secret
            return await self._forward(await self.any_node(), scope, receive, send, secret=False)
        if m := _VOLUME_CONTENT.match(path):  # the volume's token, checked by the node: no key, no secret
            return await self._forward(await self._volume_node(m.group(1)), scope, receive, send, secret=False)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        got = headers.get("x-api-key", "")
        if not got or not hmac.compare_digest(got.encode(), self.api_key.encode()):
            raise _Fail(401, "Invalid API key, set X-API-Key header")
        if path == "/cluster" or path.startswith("/cluster/"):  # gateway-to-node calls only (a node key)
            raise _Fail(404, f"{path} is not part of the API")
        if method == "GET" and path in ("/sandboxes", "/v2/sandboxes", "/metrics/node", "/metrics/cluster"):
            return await self.api(scope, receive, send)
        if method == "POST" and path in ("/sandboxes", "/v2/sandboxes"):
            return await self._create(scope, receive, send)
        m = _FORK.match(path)
        if m and method == "POST":
            return await self._fork(m.group(1), scope, receive, send)
        m = _WAKE.match(path)
        if m and method == "POST":
            return await self._wake(m.group(1), scope, receive, send)
        if m := _VOLUME.match(path):
            return await self._forward(await self._volume_node(m.group(1)), scope, receive, send)
        m = _SCOPED.match(path)
        if m:
            node = await self.owner(m.group(1))
            self._owners.pop(m.group(1), None)
            if method == "GET" and m.group(2) is None:  # the sandbox's details: our domain in them
                return await self._reply(send, await self._call_as_client(node, scope, b"", None))
            return await self._forward(node, scope, receive, send)
        return await self._forward(await self.any_node(), scope, receive, send)

    async def _sandbox_traffic(self, scope, receive, send, sandbox_id: str, port: int):
        if orchestrator_only(scope, port):  # the node's proxy refuses it too
            raise _Fail(403, f"{scope['path']} is reserved to forkyard's orchestrator and cannot be called "
                             "through the sandbox proxy")
        try:
            node = await self._proxy_owner(sandbox_id)
        except _Fail as e:
            if e.status != 404:
                raise
            # E2B's proxy answer for a sandbox that is not running (see forkyard.api.proxy),
            # with the cause when one is known (paused, its node down, why it died).
            if scope["type"] == "http":
                why = str(e)
                plain = why == f"sandbox {sandbox_id!r} not found"
                message = "The sandbox was not found" + ("" if plain else f" ({why})")
                return await send_error(send, scope, 502, message, sandboxId=sandbox_id)
            return await send({"type": "websocket.close", "code": 1008})
        base = node.url.replace("http://", "", 1)
        route_hdrs = [(b"e2b-sandbox-id", sandbox_id.encode()), (b"e2b-sandbox-port", str(port).encode())]
        if scope["type"] == "http":
            headers = [(k, v) for k, v in client_headers(scope)  # names in the client's case
                       if k.decode("latin-1").lower() not in HOP | _NODE_SKIP | {"e2b-sandbox-id", "e2b-sandbox-port"}
                       or k.lower() == b"host"]  # the public Host reaches the sandbox; keys and ours never
            what = f"sandbox {sandbox_id} on node {node.node_id}"
            host, _, nport = base.partition(":")
            if fastpath.has_no_body(scope) and nport.isdigit() and node.url.startswith("http://"):
                fast = self._fast.get(node.url) or self._fast.setdefault(node.url, fastpath.FastConnections())
                if await relay_bodyless(fast, scope, send, host.strip("[]"), int(nport), headers + route_hdrs, what):
                    return
            return await relay_http(self._client(node), scope, receive, send, f"http://{base}", headers + route_hdrs,
                                    self.max_body_bytes, what)
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                if k.decode("latin-1").lower() not in WS_SKIP | _NODE_SKIP | {"e2b-sandbox-id", "e2b-sandbox-port"}]
        hdrs += [(k.decode(), v.decode()) for k, v in route_hdrs]
        return await relay_ws(scope, receive, send, f"ws://{base}", hdrs)

    async def _forward(self, node: NodeInfo, scope, receive, send, body: bytes | None = None,
                       placement: str | None = None, secret: bool = True):
        """Relay a REST call to ``node`` (streaming), the user's key swapped for the
        secret (none when not ``secret``: a key-less call carries no credential), with
        the scheduler's ``placement`` id when the call starts sandboxes it placed. The
        client's ``Host`` goes along, so URLs the node builds from it (the template
        build's signed upload URL) point back at the gateway."""
        await relay_http(self._client(node), scope, _replay(body) if body is not None else receive, send,
                         node.url, self._node_headers(node, scope, placement, secret), self.max_body_bytes,
                         f"node {node.node_id}")

    def node_key(self, node: NodeInfo) -> str:
        """``node``'s own key for its URL (what the gateway's calls to it carry)."""
        return self.keys.key(node.node_id, node.url)

    def _node_headers(self, node: NodeInfo, scope, placement: str | None,
                      secret: bool = True) -> list[tuple[bytes, bytes]]:
        """The client's headers for ``node``: the API key and our own headers dropped, its
        ``Host`` kept, the node's key (when ``secret``) and the scheduler's
        ``placement`` id added."""
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _NODE_SKIP]
        headers += [(k, v) for k, v in scope["headers"] if k.lower() == b"host"][:1]
        if secret:
            headers.append((SECRET_HEADER.encode(), self.node_key(node).encode()))
        if placement:
            headers.append((PLACEMENT_HEADER.encode(), placement.encode()))
        return headers

    async def _json_body(self, scope, receive) -> tuple[bytes, dict]:
        try:
            raw = await read_body(receive, MAX_JSON_BODY)
        except BodyTooLarge as e:
            raise _Fail(413, str(e)) from e
        if raw is None:  # nobody reads the answer; nothing is forwarded
            raise _Fail(400, "the client went away before its request body was complete")
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except RecursionError:
            raise _Fail(400, "request body is nested too deeply") from None
        except ValueError as e:
            raise _Fail(400, f"request body is not JSON: {e}") from e
        if not isinstance(parsed, dict):
            raise _Fail(400, "request body must be a JSON object")
        return raw, parsed

    async def _create(self, scope, receive, send):
        """Place a create and forward it. A node that refuses it for capacity (503: its
        memory admission or host-memory floor, which the scheduler's sandbox counts do
        not see), fails it (500/502/507: e.g. its disk is full; the node removes what it
        half made) or cannot be reached is excluded and the create placed again, at most
        :data:`CREATE_ATTEMPTS` times; the last refusal reaches the client."""
        raw, body = await self._json_body(scope, receive)
        template = body.get("templateID")
        if not isinstance(template, str) or not template:
            raise _Fail(400, "templateID: Field required")
        mounts = body.get("volumeMounts")
        volumes = sorted({m["name"][:64] for m in mounts if isinstance(m, dict) and isinstance(m.get("name"), str)}
                         )[:16] if isinstance(mounts, list) else []
        refused: list[str] = []
        r, failed = None, None
        for attempt in range(CREATE_ATTEMPTS):
            try:
                out = (await self._schedule({"kind": "create", "snapshot": template[:128],
                                             "exclude": refused, "volumes": volumes}))["placements"][0]
            except _Fail as e:
                if not refused:
                    raise
                failed = failed or e
                break  # no other node: the last node's refusal is the answer
            node = (await self.nodes(fresh=True)).get(out["nodeID"])
            if node is None:
                raise _Fail(503, "the placed node left the cluster; retry")
            try:
                r = await self._call_as_client(node, scope, raw, out.get("placementID"), connect_error=True)
            except httpx.ConnectError as e:  # never reached the node: place it elsewhere
                failed = _Fail(502, f"node {node.node_id} is not reachable: {e!r}")
                log.info("%s; placing the create again", failed)
                refused.append(node.node_id)
                continue
            if r.status_code == 409 and HOLDER_HEADER in r.headers and attempt < CREATE_ATTEMPTS - 1:
                # another node took a volume's lease meanwhile: placed again, on it
                log.info("a volume of a create is held by node %s; placing it again", r.headers[HOLDER_HEADER])
                continue
            if r.status_code not in _REPLACE or attempt == CREATE_ATTEMPTS - 1:
                break
            log.info("node %s refused a create (%d: %s); placing it again", node.node_id, r.status_code, r.text[:200])
            refused.append(node.node_id)
        if r is None:
            raise failed or _Fail(503, "no node took the create; retry")
        self._remember_made(node.node_id, r)
        await self._reply(send, r)

    def _remember_made(self, node_id: str, r: httpx.Response | list) -> None:
        """Keep the sandboxes a create or fork answer ``r`` (a node's answer, or a fork's
        results list) made as bound to ``node_id`` in the book: until its node has
        published them (not while the scheduler is away) Redis has no binding, and the next
        call must not be a 404 (:meth:`~.routing.Ownership._unbound` asks that node)."""
        if isinstance(r, httpx.Response):
            if r.status_code != 201:
                return
            try:
                r = r.json()
            except ValueError:
                return
        for item in r if isinstance(r, list) else [r]:
            made = item.get("sandbox", item) if isinstance(item, dict) else None
            if isinstance(made, dict) and isinstance(made.get("sandboxID"), str):
                self.book.remember(made["sandboxID"], node_id, "running")

    async def _wake(self, sandbox_id: str, scope, receive, send):
        """``connect``/``resume``: to the owner; a draining node refuses it (409 with
        :data:`~.config.DRAINING_HEADER`) once the sandbox is paused there, and it is
        then moved and sent again — never resumed on the draining node."""
        raw, _ = await self._json_body(scope, receive)
        for attempt in range(WAKE_ATTEMPTS):
            node = await self.owner(sandbox_id, fresh=True)
            self._owners.pop(sandbox_id, None)
            # The gateway may learn of a drain (or an undrain) before the node's next heartbeat does: tell it.
            r = await self._call_as_client(node, scope, raw, None, draining=node.status == NODE_DRAINING)
            if r.status_code != 409 or DRAINING_HEADER not in r.headers:
                break
            log.info("node %s is draining: sandbox %s resumes elsewhere", node.node_id, sandbox_id)
        await self._reply(send, r)

    def _with_domain(self, content: bytes) -> bytes:
        """A node's JSON answer with every sandbox's ``domain`` made the gateway's."""
        if not self.domain or b'"domain"' not in content:
            return content
        try:
            data = json.loads(content)
        except ValueError:
            return content
        items = data if isinstance(data, list) else [data]
        for item in items:
            for d in (item, item.get("sandbox") if isinstance(item, dict) else None):
                if isinstance(d, dict) and "domain" in d:
                    d["domain"] = self.domain
        return json.dumps(data).encode()

    async def _reply(self, send, r: httpx.Response) -> None:
        """Send a node's buffered answer ``r`` to the client (the gateway's domain in it)."""
        body = self._with_domain(r.content)
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers.multi_items()
                   if k.lower() not in HOP_OUT]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": r.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _call_as_client(self, node: NodeInfo, scope, body: bytes, placement: str | None,
                              connect_error: bool = False, draining: bool | None = None) -> httpx.Response:
        """The client's REST call (``body`` read already) sent to ``node`` as
        :meth:`_forward` sends it, answer buffered (small JSON answers only). Raises
        _Fail(502) when the node cannot be reached (``connect_error``: httpx.ConnectError
        itself when the connection could not be opened, so nothing reached the node).
        ``draining``: whether the node is draining as the cluster store said just now
        (:data:`~.config.DRAINING_HEADER` ``1``/``0`` sent along; None: not sent)."""
        headers = self._node_headers(node, scope, placement)
        if draining is not None:
            headers.append((DRAINING_HEADER.encode(), b"1" if draining else b"0"))
        try:
            return await self._client(node).request(scope["method"], node.url + target_path(scope),
                                                    headers=headers, content=body,
                                                    timeout=httpx.Timeout(300.0, connect=5.0))
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            if connect_error:
                raise httpx.ConnectError(str(e)) from e
            raise _Fail(502, f"node {node.node_id} is not reachable: {e!r}") from e
        except httpx.HTTPError as e:
            raise _Fail(502, f"node {node.node_id} is not reachable: {e!r}") from e

    async def _fork(self, sandbox_id: str, scope, receive, send):
        raw, body = await self._json_body(scope, receive)
        try:
            fb = schemas.ForkBody.model_validate(body)
        except ValidationError as e:
            raise _Fail(400, "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())) from e
        node = await self.owner(sandbox_id)
        b = await self.store.binding(sandbox_id)
        if b is None or b.state != "running":
            return await self._forward(node, scope, receive, send, body=raw)  # the node answers 404/409
        plan = (await self._schedule({"kind": "fork", "sandboxID": sandbox_id, "count": fb.count,
                                      "vcpus": int(b.record.get("vcpus", 2))}))["placements"]
        if len(plan) == 1 and plan[0]["nodeID"] == node.node_id:
            r = await self._call_as_client(node, scope, raw, plan[0].get("placementID"))
            self._remember_made(node.node_id, r)
            return await self._reply(send, r)
        here = [p for p in plan if p["nodeID"] == node.node_id]
        local = sum(p["count"] for p in here)
        log.info("fork of %s (%d) spread over nodes: %s", sandbox_id, fb.count,
                 ", ".join(f"{p['nodeID']}={p['count']}" for p in plan))
        r = await self._node_call(node, "POST", f"/cluster/sandboxes/{sandbox_id}/fork",
                                  {"count": local, "timeout": fb.timeout},
                                  placement=here[0].get("placementID") if here else None)
        if r.status_code != 200:
            return await JSONResponse(r.json(), status_code=r.status_code)(scope, receive, send)
        first = r.json()
        results, image = list(first["results"]), first["image"]
        self._remember_made(node.node_id, results)
        nodes = await self.nodes(fresh=True)

        async def remote(p: dict) -> list[dict]:
            target = nodes.get(p["nodeID"])
            try:
                if target is None:
                    raise _Fail(503, f"node {p['nodeID']} left the cluster")
                rr = await self._node_call(target, "POST", "/cluster/fork-children",
                                           {"image": image, "count": p["count"], "timeout": fb.timeout,
                                            "autoPause": bool(b.record.get("auto_pause", True)),
                                            "egress": b.record.get("egress") or None},
                                           placement=p.get("placementID"))
                if rr.status_code == 200:
                    self._remember_made(target.node_id, rr.json()["results"])
                    return rr.json()["results"]
                err = schemas.error(rr.status_code, rr.text[:300])
            except _Fail as e:
                err = schemas.error(e.status, str(e))
            return [{"error": err}] * p["count"]

        for part in await asyncio.gather(*(remote(p) for p in plan if p["nodeID"] != node.node_id)):
            results.extend(part)
        try:
            await self._node_call(node, "DELETE", f"/cluster/images/{image}")
        except _Fail as e:
            log.warning("fork image %s of %s not deleted: %s", image, sandbox_id, e)
        headers = {"Server-Timing": r.headers["server-timing"]} if "server-timing" in r.headers else None
        results = json.loads(self._with_domain(json.dumps(results).encode()))
        await JSONResponse(results, status_code=201, headers=headers)(scope, receive, send)

