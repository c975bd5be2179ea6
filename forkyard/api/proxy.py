"""Sandbox traffic proxy (ASGI middleware in front of the REST app).

Routing (E2B's two forms, see shared/DESIGN.md §3):
* headers ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` (SDK with ``E2B_SANDBOX_URL``);
* host ``PORT-SANDBOXID.DOMAIN`` (e.g. ``49983-abc….localhost:3000``).

HTTP requests and responses are streamed in both directions (HTTP/1.1 chunked bodies,
so Connect server-streaming works over plain ``http://``); WebSocket upgrades are
relayed frame by frame. Unknown sandbox → 404 JSON; connection failure → 502 JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import posixpath
import re
import urllib.parse

import httpx
import websockets

from forkyard.config import ENVD_PORT
from forkyard.orchestrator.errors import NotFound

log = logging.getLogger("forkyard.proxy")

_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.")
#: Hop-by-hop headers (RFC 9110 §7.6.1) plus routing headers we consume.
_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    "x-forkyard-cluster-secret",  # never into a sandbox (forkyard.api.auth)
}
#: Also dropped from upstream responses: the server adds its own.
_HOP_OUT = _HOP | {"date", "server"}
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


def route_of(scope) -> tuple[str, int] | None:
    """``(sandbox_id, port)`` a request is addressed to, or None for the REST API.

    Raises:
        ValueError: routing header present but the port is not a number in 1 … 65535,
            or the request target is not a path (``*``, ``http://…``).
    """
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    sid = headers.get("e2b-sandbox-id")
    if sid:
        raw = headers.get("e2b-sandbox-port", "49983")
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"invalid E2b-Sandbox-Port {raw!r}")
        sid, port = sid.strip(), int(raw)
    else:
        m = _HOST_RE.match(headers.get("host", ""))
        if not (m and 0 < int(m.group(1)) < 65536):
            return None
        sid, port = m.group(2), int(m.group(1))
    if not scope.get("path", "").startswith("/"):  # `OPTIONS *`, absolute-form targets
        raise ValueError(f"request target {scope.get('path')!r} cannot be sent to a sandbox: use an origin-form path")
    return sid, port


async def _send_json(send, status: int, message: str) -> None:
    body = json.dumps({"code": status, "message": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


class UpstreamCut(Exception):
    """A relayed response with a ``Content-Length`` ended early (the sandbox was killed,
    paused or forked mid-transfer). Raised after the response started so the server
    closes the connection: the client sees fewer bytes than announced and reports an
    incomplete body, never a shorter body passed off as complete."""


class _QuietCuts(logging.Filter):
    """Drop uvicorn's "Exception in ASGI application" traceback for :class:`UpstreamCut`
    (an expected event, logged by the proxy as one line)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, UpstreamCut)


logging.getLogger("uvicorn.error").addFilter(_QuietCuts())


class SandboxProxy:
    """ASGI middleware: requests carrying a sandbox route go to the sandbox, the rest
    to ``app``. ``resolve(sandbox_id, port) -> (host, port)`` raises NotFound.

    ``max_body_bytes`` bounds one request body (uploads); a larger one gets 413.
    """

    def __init__(self, app, resolve, max_body_bytes: int = 4 << 30):
        self.app = app
        self.resolve = resolve
        self.max_body_bytes = max_body_bytes
        # One connection pool per sandbox: outer addresses are reused by later
        # sandboxes, so a pooled connection must never outlive its sandbox.
        self._clients: dict[str, httpx.AsyncClient] = {}

    def _client(self, sid: str) -> httpx.AsyncClient:
        client = self._clients.get(sid)
        if client is None:
            if len(self._clients) >= 64:
                self._sweep()
            client = self._clients[sid] = httpx.AsyncClient(
                trust_env=False,
                timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
            )
            # Forward only what the client sent (see relay_http: httpx re-adds its
            # defaults on this setter, relay_http removes them per request).
            client.headers = httpx.Headers()
        return client

    async def forget(self, sid: str) -> None:
        """Close every connection to sandbox ``sid`` (killed, paused or dead): open
        streams end with an error for their clients instead of hanging."""
        client = self._clients.pop(sid, None)
        if client is not None:
            await client.aclose()

    def _sweep(self) -> None:
        """Close the pools of sandboxes that are gone."""
        for sid in list(self._clients):
            try:
                self.resolve(sid, 0)
            except NotFound:
                client = self._clients.pop(sid)
                asyncio.get_running_loop().create_task(client.aclose())

    async def aclose(self) -> None:
        """Close every pooled connection."""
        for client in self._clients.values():
            await client.aclose()
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
        if route is None:
            return await self.app(scope, receive, send)
        sid, port = route
        try:
            host, hport = self.resolve(sid, port)
        except NotFound as e:
            stale = self._clients.pop(sid, None)
            if stale is not None:
                await stale.aclose()
            if scope["type"] == "http":
                return await _send_json(send, 404, str(e))
            return await send({"type": "websocket.close", "code": 1008})
        if orchestrator_only(scope, port):
            if scope["type"] == "http":
                return await _send_json(send, 403, f"{scope['path']} is reserved to forkyard's orchestrator "
                                                   "and cannot be called through the sandbox proxy")
            return await send({"type": "websocket.close", "code": 1008})
        if scope["type"] == "http":
            await self._http(scope, receive, send, host, hport, sid)
        else:
            await self._ws(scope, receive, send, host, hport)

    async def _http(self, scope, receive, send, host, port, sid):
        headers = [(k, v) for k, v in scope["headers"] if k.decode("latin-1").lower() not in _HOP]
        client = self._client(sid)
        try:  # no await since _client: a kill either ran before this check or will close this pool
            self.resolve(sid, port)
        except NotFound as e:
            await self.forget(sid)
            return await _send_json(send, 404, str(e))
        try:
            await relay_http(client, scope, receive, send, f"http://{host}:{port}", headers,
                             self.max_body_bytes, f"sandbox {sid} port {port}")
        finally:
            # A request that raced the sandbox's end (resolved before it was killed or
            # paused, pool made after ``forget``) must not leave a pool behind: its
            # connections would stay ESTABLISHED to a vanished netns (found by
            # bench/soak.py: 13 sockets after 300 cycles).
            try:
                self.resolve(sid, 0)
            except NotFound:
                await self.forget(sid)

    async def _ws(self, scope, receive, send, host, port):
        hdrs = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]
                if k.decode("latin-1").lower() not in _WS_SKIP]
        await relay_ws(scope, receive, send, f"ws://{host}:{port}", hdrs)


#: Headers httpx adds to every request unless told otherwise.
_HTTPX_DEFAULTS = ("accept", "accept-encoding", "user-agent")


def _target_path(scope) -> str:
    """The request's raw path and query string, as received."""
    url = scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?")[0]
    qs = scope.get("query_string", b"")
    return url + ("?" + qs.decode("latin-1") if qs else "")


async def relay_http(client: httpx.AsyncClient, scope, receive, send, base: str, headers: list,
                     max_body_bytes: int, what: str) -> None:
    """Stream one HTTP request to ``base`` + the request's path (``headers`` as given:
    the caller has filtered hop-by-hop ones) and stream the answer back — bodies in both
    directions chunk by chunk, so Connect server-streaming works over HTTP/1.1. A body
    over ``max_body_bytes`` gets 413; an upstream that cannot be reached gets 502 naming
    ``what``; an upstream that goes away mid-stream ends the response early."""
    url = base + _target_path(scope)
    declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        return await _send_json(send, 413, f"request body over the {max_body_bytes} byte limit")
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

    req = client.build_request(scope["method"], url, headers=headers, content=body())
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
    except httpx.HTTPError as e:
        return await _send_json(send, 502, f"{what} is not reachable: {e!r}")
    length, relayed = None, 0
    try:
        out_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                       for k, v in resp.headers.multi_items() if k.lower() not in _HOP_OUT]
        length = resp.headers.get("content-length")
        if length is not None:  # raw bytes are relayed, so it stays exact
            out_headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})
        relayed = 0
        async for chunk in resp.aiter_raw():
            relayed += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    except (httpx.HTTPError, OSError) as e:
        # The sandbox went away mid-stream (killed, paused, forked: gVisor resets
        # connections on checkpoint).
        log.info("response from %s ended early: %r", what, e)
        if length is not None and length.isdigit() and relayed < int(length):
            raise UpstreamCut(f"{what}: {relayed} of {length} bytes") from None  # the connection closes
        # Chunked: end the response; the client sees a truncated stream (Connect: no
        # end message) and reports an error.
        await send({"type": "http.response.body", "body": b""})
    finally:
        await resp.aclose()


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
