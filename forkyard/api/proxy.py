"""Sandbox traffic proxy (ASGI middleware in front of the REST app).

Routing (E2B's two forms, see shared/DESIGN.md §3):
* headers ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` (SDK with ``E2B_SANDBOX_URL``);
* host ``PORT-SANDBOXID.DOMAIN`` (e.g. ``49983-abc….localhost:3000``).

HTTP requests and responses are streamed in both directions (HTTP/1.1 chunked bodies,
so Connect server-streaming works over plain ``http://``); WebSocket upgrades are
relayed frame by frame.

Errors answer like E2B's proxy, because the SDKs decide on them (e2b 2.63
``e2b/exceptions.py``, ``Sandbox.is_running``): a sandbox that is not running (unknown,
killed, expired, paused) → 502 ``{"code": 502, "message": "The sandbox ID was not found",
"sandboxId": ID}`` (``is_running()`` is then false); a running sandbox whose port refuses
the connection → 502 "The sandbox is running but port is not open". A Connect stream
(``application/connect+*``) whose sandbox goes away mid-stream ends with a Connect
end-of-stream error ``unavailable`` (saying "was not found" when the sandbox is gone), so
the SDK reports the sandbox killed instead of a command that ended without an end event.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import posixpath
import urllib.parse
import weakref

import httpcore
import httpx
import websockets

from forkyard.api import fastpath
from forkyard.api.upstream import AsyncioBackend
from forkyard.config import ENVD_PORT
from forkyard.orchestrator.errors import NotFound
from forkyard.routing import route_of

log = logging.getLogger("forkyard.proxy")

#: E2B's header for the traffic access token of sandboxes without public traffic.
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"
#: Hop-by-hop headers (RFC 9110 §7.6.1) plus routing headers we consume.
_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    "x-forkyard-cluster-secret",  # never into a sandbox (forkyard.api.auth)
}
#: Also dropped from upstream responses: the server adds its own.
_HOP_OUT = _HOP | {"date", "server"}
_HOP_OUT_BYTES = frozenset(name.encode() for name in _HOP_OUT)
_WS_SKIP = _HOP | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                   "sec-websocket-accept", "sec-websocket-protocol"}


#: envd routes only the orchestrator may call (it reaches envd directly, never through
#: the proxy): ``/init`` sets the access token, env vars and default user, so a caller
#: reaching it could lock the owner out or plant their own token (issue 11, item 6).
ORCHESTRATOR_ONLY_PATHS = frozenset({"/init"})


def orchestrator_only(scope, port: int) -> bool:
    """True when a request for envd (``port`` = :data:`ENVD_PORT`) targets one of
    :data:`ORCHESTRATOR_ONLY_PATHS`, in any spelling envd's Go router would accept:
    percent-encoded, with repeated slashes, dot segments, a trailing slash or an
    absolute-form target (``http://host/init``); compared case-insensitively."""
    if port != ENVD_PORT:
        return False
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    candidates = {scope.get("path", ""), urllib.parse.unquote(raw.decode("latin-1").split("?")[0])}
    for path in candidates:
        if "://" in path:
            path = urllib.parse.urlsplit(path).path
        clean = posixpath.normpath("/" + urllib.parse.unquote(path)).lower()
        if clean.startswith("//"):
            clean = "/" + clean.lstrip("/")
        if clean in ORCHESTRATOR_ONLY_PATHS:
            return True
    return False


def _single_leading_slash(scope) -> dict:
    """``scope`` with its path's leading slashes made one: an SDK given
    ``E2B_SANDBOX_URL`` with a trailing ``/`` asks envd for ``//process.Process/Start``,
    which envd's Go router answers with a 307 the SDK reports as "Temporary Redirect"."""
    scope = dict(scope)
    scope["path"] = "/" + scope["path"].lstrip("/")
    raw = scope.get("raw_path")
    if raw is not None:
        scope["raw_path"] = b"/" + raw.lstrip(b"/")
    return scope


async def _send_json(send, status: int, message: str, **extra) -> None:
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class UpstreamCut(Exception):
    """A relayed response ended early (the sandbox was killed, paused or forked
    mid-transfer) where no clean end can be sent. Raised after the response started so
    the server aborts the connection: the client sees fewer bytes than announced (or an
    unterminated chunked body) and reports an incomplete body, never a shorter body
    passed off as complete."""


class _QuietCuts(logging.Filter):
    """Drop uvicorn's "Exception in ASGI application" traceback for :class:`UpstreamCut`
    (an expected event, logged by the proxy as one line) and for the CancelledError of
    requests uvicorn cancels when its graceful shutdown ends (a relayed stream that was
    still open: it logs that as "Cancel N running task(s)")."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (UpstreamCut, asyncio.CancelledError))


logging.getLogger("uvicorn.error").addFilter(_QuietCuts())


class SandboxConnections(httpcore.AsyncNetworkBackend):
    """The network backend of one sandbox's connection pool: it knows every connection it
    opened, so :meth:`aclose` closes them all — including one that was still connecting
    when the pool was closed. httpcore's ``AsyncConnectionPool.aclose`` only closes the
    connections it lists, and a connection whose TCP connect completes after that is
    used for its request and then kept open (idle, out of every list): ESTABLISHED to a
    sandbox that is gone, for the server's lifetime (found by bench/soak.py: 3 sockets
    after 200 cycles with sandboxes killed mid-request). After :meth:`aclose` every new
    connection is closed at once and raises ``httpcore.ConnectError`` (httpx: 502).
    ``backend`` makes the connections; by default
    :class:`~forkyard.api.upstream.AsyncioBackend` (plain asyncio sockets: the relay's
    CPU cost, see that module).
    """

    def __init__(self, backend: httpcore.AsyncNetworkBackend | None = None):
        self._backend = backend or AsyncioBackend()
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self.closed = False

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        """Connect like the wrapped backend, and remember the stream (weakly)."""
        stream = await self._backend.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                                 socket_options=socket_options)
        if self.closed:
            await stream.aclose()
            raise httpcore.ConnectError("the sandbox's connections were closed: it is gone")
        self._streams.add(stream)
        return stream

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("sandbox traffic goes over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)

    @property
    def open_streams(self) -> int:
        """Connections opened and not yet collected (closed ones may still count)."""
        return len(self._streams)

    async def aclose(self) -> None:
        """Close every connection this backend opened, and any it opens from now on."""
        self.closed = True
        for stream in list(self._streams):
            try:
                await stream.aclose()
            except Exception as e:  # noqa: BLE001 — closing what is already broken
                log.debug("closing a sandbox connection failed: %r", e)
        self._streams = weakref.WeakSet()


def sandbox_client(connections: SandboxConnections) -> httpx.AsyncClient:
    """An httpx client for one sandbox's traffic whose pool connects through
    ``connections`` (httpx takes no network backend, so its transport's pool is
    replaced by an equal one that does: no proxies from the environment, no timeouts
    but a 5 s connect, at most 32 idle connections)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    transport = httpx.AsyncHTTPTransport(trust_env=False, limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(  # noqa: SLF001 — see the docstring
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, network_backend=connections)
    client = httpx.AsyncClient(trust_env=False, transport=transport,
                               timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None))
    # Forward only what the client sent (see relay_http: httpx re-adds its defaults on
    # this setter, relay_http removes them per request).
    client.headers = httpx.Headers()
    return client


class SandboxProxy:
    """ASGI middleware: requests carrying a sandbox route go to the sandbox, the rest
    to ``app``. ``resolve(sandbox_id, port) -> (host, port)`` raises NotFound.

    ``max_body_bytes`` bounds one request body (uploads); a larger one gets 413.
    ``wake(sandbox_id) -> bool`` (async, optional) is asked when a sandbox is not
    running: True means it was resumed (E2B ``autoResume``) and the request goes on.
    ``signed(query, operation) -> sandbox_id | None`` (optional) routes ``/files``
    requests that carry a file-URL signature but no sandbox route (signed
    ``download_url``/``upload_url`` built on ``E2B_SANDBOX_URL``) to envd of the
    sandbox whose token signed them; a signature no sandbox made gets 401.
    ``rules(sandbox_id) -> (traffic token | None, Host mask | None)`` (optional): user
    ports of a sandbox with a traffic token answer 403 without it; a mask replaces the
    Host (``${PORT}`` = the port).
    """

    def __init__(self, app, resolve, max_body_bytes: int = 4 << 30, wake=None, signed=None, rules=None):
        self.app = app
        self.rules = rules
        self.resolve = resolve
        self.wake = wake
        self.signed = signed
        self.max_body_bytes = max_body_bytes
        # One connection pool per sandbox: outer addresses are reused by later
        # sandboxes, so a pooled connection must never outlive its sandbox.
        # Per sandbox: the general relay's httpx client and its connections, and the
        # fast path's sockets (forkyard.api.fastpath).
        self._clients: dict[str, tuple[httpx.AsyncClient, SandboxConnections, fastpath.FastConnections]] = {}

    def _pool(self, sid: str) -> tuple[httpx.AsyncClient, SandboxConnections, fastpath.FastConnections]:
        pool = self._clients.get(sid)
        if pool is None:
            if len(self._clients) >= 64:
                self._sweep()
            conns = SandboxConnections()
            pool = self._clients[sid] = (sandbox_client(conns), conns, fastpath.FastConnections())
        return pool

    def _client(self, sid: str) -> httpx.AsyncClient:
        return self._pool(sid)[0]

    @staticmethod
    async def _close(pool: tuple[httpx.AsyncClient, SandboxConnections, fastpath.FastConnections]) -> None:
        client, conns, fast = pool
        fast.close()
        await client.aclose()
        await conns.aclose()  # the connections the pool no longer lists

    async def forget(self, sid: str) -> None:
        """Close every connection to sandbox ``sid`` (killed, paused or dead), also ones
        still connecting: open streams end with an error for their clients instead of
        hanging, and no socket stays open to the sandbox."""
        pool = self._clients.pop(sid, None)
        if pool is not None:
            await self._close(pool)

    def _sweep(self) -> None:
        """Close the pools of sandboxes that are gone."""
        for sid in list(self._clients):
            try:
                self.resolve(sid, 0)
            except NotFound:
                asyncio.get_running_loop().create_task(self._close(self._clients.pop(sid)))

    async def aclose(self) -> None:
        """Close every pooled connection."""
        for pool in self._clients.values():
            await self._close(pool)
        self._clients.clear()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        try:
            route = route_of(scope)
        except ValueError as e:
            if scope["type"] == "http":
                return await _send_json(send, 400, str(e))
            return await send({"type": "websocket.close", "code": 1008})
        if route is None and self.signed is not None and scope["type"] == "http" and scope["path"] == "/files":
            route = self._signed_route(scope)
            if route is False:
                return await _send_json(send, 401, "invalid or expired file URL signature")
        if route is None:
            return await self.app(scope, receive, send)
        sid, port = route
        try:
            try:
                host, hport = self.resolve(sid, port)
            except NotFound:
                if self.wake is None or not await self._wake(sid):
                    raise
                host, hport = self.resolve(sid, port)
        except NotFound as e:
            await self.forget(sid)
            if scope["type"] == "http":
                return await _send_json(send, 502, str(e), sandboxId=sid)
            return await send({"type": "websocket.close", "code": 1008})
        if orchestrator_only(scope, port):
            if scope["type"] == "http":
                return await _send_json(send, 403, f"{scope['path']} is reserved to forkyard's orchestrator "
                                                   "and cannot be called through the sandbox proxy")
            return await send({"type": "websocket.close", "code": 1008})
        if port == ENVD_PORT and scope.get("path", "").startswith("//"):
            scope = _single_leading_slash(scope)
        if scope["type"] == "http":
            await self._http(scope, receive, send, host, hport, sid)
        else:
            await self._ws(scope, receive, send, host, hport, sid)

    def _signed_route(self, scope):
        """``(sandbox_id, envd port)`` for a signed ``/files`` URL, None when the request
        carries no signature, False when no running sandbox made it."""
        from urllib.parse import parse_qs

        q = {k: v[0] for k, v in parse_qs(scope.get("query_string", b"").decode("latin-1"),
                                          keep_blank_values=True).items()}
        if "signature" not in q:
            return None
        sid = self.signed(q, "write" if scope["method"] == "POST" else "read")
        return (sid, ENVD_PORT) if sid else False

    async def _wake(self, sid: str) -> bool:
        try:
            return await self.wake(sid)
        except Exception as e:  # noqa: BLE001 — the restore failed: answer as not running
            log.error("auto-resume of sandbox %s failed: %s", sid, e)
            return False

    def _user_port_rules(self, scope, sid: str, port: int) -> tuple[bool, str | None]:
        """(allowed, Host mask) for a request to ``port`` of ``sid``: the envd port is
        always allowed (envd has its own token); user ports of a sandbox created with
        ``allowPublicTraffic: false`` need its token in ``e2b-traffic-access-token``."""
        if self.rules is None or port == ENVD_PORT:
            return True, None
        token, mask = self.rules(sid)
        if token is not None:
            got = next((v for k, v in scope["headers"] if k.lower() == TRAFFIC_TOKEN_HEADER), b"")
            if not hmac.compare_digest(got, token.encode()):
                return False, None
        return True, mask.replace("${PORT}", str(port)) if mask else None

    async def _http(self, scope, receive, send, host, port, sid):
        allowed, mask = self._user_port_rules(scope, sid, port)
        if not allowed:
            return await _send_json(send, 403, f"sandbox {sid} requires its traffic access token in the "
                                               f"{TRAFFIC_TOKEN_HEADER.decode()} header for port {port}", sandboxId=sid)
        # The public Host goes along (E2B's proxy does the same): servers in the sandbox
        # build absolute URLs and check virtual hosts from it; a maskRequestHost replaces it.
        headers = [(k, v) for k, v in scope["headers"]
                   if (k.decode("latin-1").lower() not in _HOP or k.lower() == b"host")
                   and k.lower() != TRAFFIC_TOKEN_HEADER and not (mask and k.lower() == b"host")]
        if mask:
            headers.append((b"host", mask.encode()))

        def gone() -> str | None:
            try:
                self.resolve(sid, port)
            except NotFound as e:
                return str(e)
            return None

        client, conns, fast = self._pool(sid)
        message = gone()  # no await since _pool: a kill either ran before this check or will close this pool
        if message is not None:
            await self.forget(sid)
            return await _send_json(send, 502, message, sandboxId=sid)
        what = f"sandbox {sid} port {port}"
        try:
            if fastpath.has_no_body(scope) and await relay_bodyless(fast, scope, send, host, port, headers, what,
                                                                    gone=gone, sandbox_id=sid):
                return
            await relay_http(client, scope, receive, send, f"http://{host}:{port}", headers,
                             self.max_body_bytes, what, gone=gone, sandbox_id=sid, closed=lambda: conns.closed)
        finally:
            # A request that raced the sandbox's end (resolved before it was killed or
            # paused, pool made after ``forget``) must not leave a pool behind: its
            # connections would stay ESTABLISHED to a vanished netns (found by
            # bench/soak.py: 13 sockets after 300 cycles).
            try:
                self.resolve(sid, 0)
            except NotFound:
                await self.forget(sid)

    async def _ws(self, scope, receive, send, host, port, sid=None):
        allowed, _ = self._user_port_rules(scope, sid, port) if sid else (True, None)
        if not allowed:
            return await send({"type": "websocket.close", "code": 1008})
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                if k.decode("latin-1").lower() not in _WS_SKIP and k.lower() != TRAFFIC_TOKEN_HEADER]
        await relay_ws(scope, receive, send, f"ws://{host}:{port}", hdrs)


#: Headers httpx adds to every request unless told otherwise.
_HTTPX_DEFAULTS = ("accept", "accept-encoding", "user-agent")


def _target_path(scope) -> str:
    """The request's raw path and query string, as received."""
    url = scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?")[0]
    qs = scope.get("query_string", b"")
    return url + ("?" + qs.decode("latin-1") if qs else "")


class _ConnectFrames:
    """Tracks Connect envelope boundaries (1 flag byte + 4-byte big-endian length +
    payload; connectrpc.com/docs/protocol "Streaming") in a relayed byte stream, so an
    end-of-stream message can be appended only between two messages."""

    def __init__(self):
        self._need = 5          # bytes until the current header/payload is complete
        self._header = b""
        self._in_header = True

    def feed(self, data: bytes) -> None:
        while data:
            take = min(self._need, len(data))
            if self._in_header:
                self._header += data[:take]
            self._need -= take
            data = data[take:]
            if self._need == 0:
                if self._in_header:
                    self._need = int.from_bytes(self._header[1:5], "big")
                    self._in_header = self._need == 0
                    self._header = b""
                    if self._in_header:
                        self._need = 5
                else:
                    self._in_header, self._need = True, 5

    @property
    def at_boundary(self) -> bool:
        return self._in_header and self._need == 5


def connect_end_error(code: str, message: str) -> bytes:
    """A Connect end-of-stream message (flag 0x02) carrying error ``code`` (a Connect
    code name such as ``"unavailable"``) and ``message``."""
    payload = json.dumps({"error": {"code": code, "message": message}}).encode()
    return b"\x02" + len(payload).to_bytes(4, "big") + payload


async def relay_http(client: httpx.AsyncClient, scope, receive, send, base: str, headers: list,
                     max_body_bytes: int, what: str, gone=None, sandbox_id: str | None = None,
                     closed=None) -> None:
    """Stream one HTTP request to ``base`` + the request's path (``headers`` as given:
    the caller has filtered hop-by-hop ones) and stream the answer back — bodies in both
    directions chunk by chunk, so Connect server-streaming works over HTTP/1.1.

    A request without ``Content-Length`` and ``Transfer-Encoding`` has no body (RFC 9112
    §6.3) and goes out without one; a declared length goes out as declared (never
    re-chunked). A body over ``max_body_bytes`` gets 413; an upstream refusing the
    connection gets 502 "... port is not open" (E2B's wording), other failures 502
    naming ``what``. When the upstream goes away mid-response: a Connect stream gets an
    ``unavailable`` end-of-stream error (message from ``gone()`` — str when the sandbox
    is gone, None when it still runs — else a "connection lost" one); any other
    response is aborted (:class:`UpstreamCut`), so the client sees the truncation.
    ``closed()`` (optional) is True once the client's connections were closed (the
    sandbox is gone): a body that ends with its connection then did not end by itself.
    An upstream status outside 100 … 599 gets 502 (an ASGI server has no status line for
    it).
    """
    url = base + _target_path(scope)
    req_headers = {k.lower(): v for k, v in scope["headers"]}
    declared = req_headers.get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
        if not declared.isdigit():
            return await _send_json(send, 400, "invalid Content-Length")
        return await _send_json(send, 413, f"request body over the {max_body_bytes} byte limit")
    has_body = declared is not None or b"transfer-encoding" in req_headers
    sent = 0

    async def body():
        nonlocal sent
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            if chunk:
                sent += len(chunk)
                if sent > max_body_bytes:
                    raise _TooLarge()
                yield chunk
            if not msg.get("more_body"):
                return

    if declared is not None:
        headers = [*headers, (b"content-length", declared)]
    req = client.build_request(scope["method"], url, headers=headers, content=body() if has_body else None)
    # httpx adds its defaults (Accept-Encoding: gzip, deflate, …) even when a client's
    # headers are emptied; forward only what the client sent, so envd never gzips a
    # body the client did not ask to be compressed.
    sent_names = {k.lower() if isinstance(k, bytes) else k.lower().encode() for k, _ in headers}
    for name in _HTTPX_DEFAULTS:
        if name.encode() not in sent_names:
            req.headers.pop(name, None)
    try:
        resp = await client.send(req, stream=True)
    except _TooLarge:
        return await _send_json(send, 413, f"request body over the {max_body_bytes} byte limit")
    except httpx.ConnectError as e:
        return await _connect_failed(send, what, e, refused=True, gone=gone, sandbox_id=sandbox_id)
    except httpx.HTTPError as e:
        return await _send_json(send, 502, f"{what} is not reachable: {e!r}")
    if resp.status_code >= 600:
        await resp.aclose()
        return await _send_json(send, 502, f"{what} answered status {resp.status_code}, not an HTTP status code")
    ctype = resp.headers.get("content-type", "")
    frames = _ConnectFrames() if ctype.startswith("application/connect+") else None
    try:
        out_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                       for k, v in resp.headers.multi_items() if k.lower() not in _HOP_OUT]
        length = resp.headers.get("content-length")
        chunked = "transfer-encoding" in resp.headers  # (it wins over a Content-Length, RFC 9112 §6.3)
        # Raw (undecoded) bytes are relayed, so the length stays exact. Not on a 204/304:
        # no body follows, but an ASGI server would wait for that many bytes.
        if length is not None and not chunked and resp.status_code not in (204, 304):
            out_headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
        async for chunk in resp.aiter_raw():
            if frames is not None:
                frames.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        if (closed is not None and closed() and length is None and not chunked
                and scope["method"] != "HEAD" and resp.status_code not in (204, 304)):
            raise OSError("the connection was closed under a body that ends with it")
        await send({"type": "http.response.body", "body": b""})
    except (httpx.HTTPError, OSError) as e:
        # The sandbox went away mid-stream (killed, paused, forked: gVisor resets
        # connections on checkpoint).
        log.info("response from %s ended early: %r", what, e)
        if frames is None or not frames.at_boundary or "content-length" in resp.headers:
            raise UpstreamCut(f"{what} ended the response early: {e!r}") from None  # the connection closes
        message = gone() if gone is not None else None
        if message is None:
            message = f"the connection to {what} ended before the stream completed"
        await send({"type": "http.response.body", "body": connect_end_error("unavailable", message)})
    finally:
        await resp.aclose()


async def relay_bodyless(fast: fastpath.FastConnections, scope, send, host: str, port: int, headers: list,
                         what: str, gone=None, sandbox_id: str | None = None) -> bool:
    """Relay a request without a body (:func:`forkyard.api.fastpath.has_no_body`) on the
    fast path to ``host:port`` (``headers`` as given: the caller has filtered hop-by-hop
    ones). Returns False, having sent nothing, when the request must take
    :func:`relay_http` instead. Answers like :func:`relay_http`: a refused connection is
    502 "The sandbox is running but port is not open" (or ``gone()``'s message when the
    sandbox is gone), other failures before the answer 502 naming ``what``; a response
    that ends early is aborted (:class:`UpstreamCut`)."""
    try:
        await fastpath.relay(fast, scope, send, host, port, headers, _target_path(scope), _HOP_OUT_BYTES, what)
    except fastpath.NotEligible:
        return False
    except (fastpath.RefusedError, ConnectionError) as e:
        await _connect_failed(send, what, e, refused=isinstance(e, fastpath.RefusedError), gone=gone,
                              sandbox_id=sandbox_id)
    except (TimeoutError, OSError) as e:
        await _send_json(send, 502, f"{what} is not reachable: {e!r}")
    return True


async def _connect_failed(send, what: str, e: BaseException, refused: bool, gone=None,
                          sandbox_id: str | None = None) -> None:
    """The 502 of both relays when connecting to the sandbox failed: the sandbox's own
    "not found" message when ``gone()`` says it is gone, E2B's "The sandbox is running
    but port is not open" when the port ``refused``, else "``what`` is not reachable"."""
    if sandbox_id is not None and gone is not None and (msg := gone()) is not None:
        return await _send_json(send, 502, msg, sandboxId=sandbox_id)
    if refused:
        extra = {"sandboxId": sandbox_id} if sandbox_id else {}
        return await _send_json(send, 502, f"The sandbox is running but port is not open ({what}: {e!r})", **extra)
    await _send_json(send, 502, f"{what} is not reachable: {e!r}")


async def relay_ws(scope, receive, send, base: str, headers: list[tuple[str, str]]) -> None:
    """Relay a WebSocket session to ``base`` (``ws://host:port``) + the request's path,
    frame by frame in both directions, until either side closes."""
    url = base + _target_path(scope)
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    try:
        upstream = await websockets.connect(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                                            open_timeout=5, max_size=None)
    except Exception as e:  # noqa: BLE001 — any failure to reach the sandbox
        log.info("websocket to %s failed: %r", url, e)
        return await send({"type": "websocket.close", "code": 1011})
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

    async def client_to_up():
        while True:
            m = await receive()
            if m["type"] == "websocket.disconnect":
                await upstream.close()
                return
            if m.get("bytes") is not None:
                await upstream.send(m["bytes"])
            elif m.get("text") is not None:
                await upstream.send(m["text"])

    async def up_to_client():
        try:
            async for m in upstream:
                if isinstance(m, bytes):
                    await send({"type": "websocket.send", "bytes": m})
                else:
                    await send({"type": "websocket.send", "text": m})
        finally:
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})

    tasks = [asyncio.create_task(client_to_up()), asyncio.create_task(up_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await upstream.close()
