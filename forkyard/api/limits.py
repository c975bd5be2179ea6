"""Bounds on what an unauthenticated client can make the server hold (issue 11, item 5).

Two layers:

* :func:`guarded_http_protocol` — a uvicorn HTTP protocol (httptools) that closes a
  connection whose request head (line + headers) does not arrive within
  ``header_timeout_s`` or grows past ``max_head_bytes`` (431), and refuses a client's
  connection beyond ``max_conns_per_client`` open ones from the same address (503).
  uvicorn itself arms no timer before a connection's first response, so an idle or
  slow-header connection would otherwise be held forever.
* :class:`RestGuard` — ASGI middleware in front of the REST app: refuses an ambiguous
  path (:func:`forkyard.relay.paths.path_problem`, 400), checks the API key
  (or cluster secret) from the headers *before any body byte is read*, caps each
  route's body (413 with a message, from ``Content-Length`` at once, else while
  reading) and times out a body that stops arriving (408).

Sandbox traffic (the proxy) does not pass through :class:`RestGuard`: envd checks its
own token, and the proxy bounds the body with ``FORKYARD_MAX_UPLOAD_MB``.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re

from starlette.exceptions import HTTPException
import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from forkyard.api.auth import cluster_secret_ok
from forkyard.config import ProxySettings
from forkyard.relay.paths import path_problem

log = logging.getLogger("forkyard.limits")

#: A request head must be complete this many seconds after the connection opened (or
#: after the previous response, for keep-alive connections), unless configured
#: (``FORKYARD_HEADER_TIMEOUT_S``, :class:`~forkyard.config.ProxySettings`). nginx's
#: ``client_header_timeout`` default is 60 s; clients send their head at once.
HEADER_TIMEOUT_S = 20.0
#: Largest request line + headers (nginx: 4 × 8 KiB buffers; here 64 KiB).
MAX_HEAD_BYTES = 64 * 1024
#: Open connections one client address may hold at once, unless configured
#: (``FORKYARD_MAX_CONNECTIONS_PER_CLIENT``).
MAX_CONNS_PER_CLIENT = 1024
#: A body must make progress: at most this many seconds between two chunks.
BODY_IDLE_TIMEOUT_S = 30.0

#: Body caps per REST route (bytes). JSON bodies are small (E2B's largest is a template
#: build's step list); uploads (``/templates/import``, ``/template-files/``) are bounded
#: by ``FORKYARD_MAX_UPLOAD_MB`` instead.
JSON_BODY_MAX = 1 << 20
BUILD_BODY_MAX = 8 << 20
_BUILD_RE = re.compile(r"^/(v2|v3)/templates(/|$)")
_UPLOAD_RE = re.compile(r"^/(templates/import|template-files/[^/]+|volumecontent/[^/]+/file)$")
#: Paths that need no API key: liveness, signed upload URLs (checked by their route),
#: the OpenAPI docs, the volume content API (the volume's token, checked by its route
#: before any body byte is read: :mod:`forkyard.api.routes_volume_content`).
_PUBLIC_RE = re.compile(r"^/(health|template-files/[^/]+|docs|docs/oauth2-redirect|redoc|openapi\.json"
                        r"|volumecontent/[^/]+/(path|dir|file))$")


def guarded_http_protocol(header_timeout_s: float = HEADER_TIMEOUT_S, max_head_bytes: int = MAX_HEAD_BYTES,
                          max_conns_per_client: int = MAX_CONNS_PER_CLIENT, base: type = HttpToolsProtocol) -> type:
    """A uvicorn ``http=`` protocol class (httptools-based: ``base`` is uvicorn's
    ``HttpToolsProtocol`` or a subclass, e.g.
    :class:`forkyard.relay.zerocopy.ZeroCopyHttpToolsProtocol`) with the bounds above."""
    per_client: dict[str, int] = {}

    class GuardedHttpToolsProtocol(base):
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _counted: str | None = None
        _head_done = False
        _head_len = 0

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if per_client.get(host, 0) >= max_conns_per_client:
                log.warning("refusing a connection from %s: %d already open", host, max_conns_per_client)
                body = json.dumps({"code": 503, "message": f"too many open connections from {host} "
                                   f"(at most {max_conns_per_client})"}).encode()
                transport.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                                b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                transport.close()
                return
            per_client[host] = per_client.get(host, 0) + 1
            self._counted = host
            self._arm()

        def _arm(self) -> None:
            self._head_bytes = 0
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                log.info("closing a connection from %s: no complete request head in %.0f s",
                         self.client and self.client[0], header_timeout_s)
                self.transport.close()

        def handle_websocket_upgrade(self) -> None:
            self._disarm()
            self._uncount()  # the WebSocket protocol takes the transport over
            super().handle_websocket_upgrade()

        def _uncount(self) -> None:
            if self._counted is not None:
                left = per_client.get(self._counted, 1) - 1
                if left > 0:
                    per_client[self._counted] = left
                else:
                    per_client.pop(self._counted, None)
                self._counted = None

        def connection_lost(self, exc) -> None:
            self._disarm()
            self._uncount()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            # Between requests of a keep-alive connection (not the unread rest of a
            # body answered early: that connection is closing).
            waiting_head = self.cycle is None or (self.cycle.response_complete and self.cycle.keep_alive)
            if not waiting_head:
                return super().data_received(data)
            if self._head_timer is None:
                self._arm()
            self._head_bytes += len(data)
            self._head_done = False
            super().data_received(data)
            if not self._head_done and self._head_bytes > max_head_bytes:
                self._refuse_head()

        def on_message_begin(self) -> None:
            self._head_len = 0
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            self._head_len += len(url)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._head_len += len(name) + len(value) + 4
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._head_done = True
            self._disarm()
            if self._head_len > max_head_bytes:  # a whole oversized head in one read
                self._refuse_head()
                raise httptools.HttpParserError("request head too large")
            super().on_headers_complete()

        def send_400_response(self, msg: str) -> None:
            if not self.transport.is_closing():  # not after our own 431
                super().send_400_response(msg)

        def _refuse_head(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\n"
                                     b"content-length: 0\r\n\r\n")
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and not self.pipeline:
                self._head_bytes = 0  # the keep-alive timer watches the idle wait

    return GuardedHttpToolsProtocol


def uvicorn_limits(zero_copy: bool = False, settings: ProxySettings | None = None) -> dict:
    """Keyword arguments for ``uvicorn.run``: the guarded protocol (with ``zero_copy``,
    over :class:`forkyard.relay.zerocopy.ZeroCopyHttpToolsProtocol`: the sandbox proxy's
    spliced response bodies) and a global bound on open connections + running requests
    (beyond it uvicorn answers 503). Bounds from ``settings`` (default: read now,
    :class:`~forkyard.config.ProxySettings`: ``FORKYARD_MAX_CONNECTIONS`` 4096,
    ``FORKYARD_MAX_CONNECTIONS_PER_CLIENT`` 1024, ``FORKYARD_HEADER_TIMEOUT_S`` 20)."""
    settings = settings or ProxySettings()
    return {
        "http": guarded_http_protocol(
            header_timeout_s=settings.header_timeout_s,
            max_conns_per_client=settings.max_connections_per_client,
            base=_zero_copy_protocol() if zero_copy else HttpToolsProtocol),
        "limit_concurrency": settings.max_connections,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
    }


def _zero_copy_protocol() -> type:
    from forkyard.relay.zerocopy import ZeroCopyHttpToolsProtocol

    return ZeroCopyHttpToolsProtocol


def body_limit(path: str, max_upload_bytes: int) -> int:
    """The largest body ``path`` accepts (bytes)."""
    if _UPLOAD_RE.match(path):
        return max_upload_bytes
    if _BUILD_RE.match(path):
        return BUILD_BODY_MAX
    return JSON_BODY_MAX


class RestGuard:
    """ASGI middleware for the REST app (see module doc). ``api_key`` is the expected
    ``X-API-Key``; ``cluster_secret`` (optional) is accepted instead (gateway → node)."""

    def __init__(self, app, api_key: str, max_upload_bytes: int, cluster_secret: str | None = None,
                 body_idle_timeout_s: float = BODY_IDLE_TIMEOUT_S):
        self.app = app
        self.api_key = api_key
        self.cluster_secret = cluster_secret
        self.max_upload_bytes = max_upload_bytes
        self.body_idle_timeout_s = body_idle_timeout_s

    async def _answer(self, send, status: int, message: str) -> None:
        body = json.dumps({"code": status, "message": message}).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if problem := path_problem(scope):  # the path routed is the path checked (issue 25)
            return await self._answer(send, 400, problem)
        path = scope["path"]
        if not _PUBLIC_RE.match(path):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            got = headers.get("x-api-key", "")
            secret = self.cluster_secret or getattr(getattr(self.app, "state", None), "cluster_secret", None)
            if not cluster_secret_ok(headers, secret) and not (
                    got and hmac.compare_digest(got.encode(), self.api_key.encode())):
                return await self._answer(send, 401, "Invalid API key, set X-API-Key header")
        limit = body_limit(path, self.max_upload_bytes)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._answer(send, 413, f"request body over the {limit} byte limit of {path}")
        got_bytes = 0
        idle = self.body_idle_timeout_s
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        done = not chunked and (declared is None or declared == b"0")  # no body to read

        async def bounded_receive():
            nonlocal got_bytes, done
            if done:  # body complete: the app now only waits for a disconnect
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), idle)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"request body stalled: no data for {idle:.0f} s") from None
            if msg["type"] == "http.request":
                got_bytes += len(msg.get("body", b""))
                if got_bytes > limit:
                    raise HTTPException(413, f"request body over the {limit} byte limit of {path}")
                done = not msg.get("more_body", False)
            else:
                done = True
            return msg

        async def closing_send(msg):
            if msg["type"] == "http.response.start" and not done:
                # Answered before the whole body arrived (413, 408, an early 4xx): close
                # the connection, or the rest of the body would be read as the next request.
                headers = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"connection"]
                msg = {**msg, "headers": [*headers, (b"connection", b"close")]}
            await send(msg)

        return await self.app(scope, bounded_receive, closing_send)
