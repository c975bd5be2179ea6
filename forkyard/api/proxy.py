"""Sandbox traffic proxy (ASGI middleware in front of the REST app).

Routing (E2B's two forms, see shared/DESIGN.md §3):
* headers ``E2b-Sandbox-Id`` + ``E2b-Sandbox-Port`` (SDK with ``E2B_SANDBOX_URL``);
* host ``PORT-SANDBOXID.DOMAIN`` (e.g. ``49983-abc….localhost:3000``).

HTTP requests and responses are streamed in both directions (HTTP/1.1 chunked bodies,
so Connect server-streaming works over plain ``http://``); WebSocket upgrades are
relayed frame by frame.

Errors answer like E2B's proxy, because the SDKs decide on them (e2b 2.63
``e2b/exceptions.py``, ``Sandbox.is_running``): a sandbox that is not running (unknown,
killed, expired, paused) → 502 ``{"code": 502, "message": "The sandbox was not found",
"sandboxId": ID}`` (``is_running()`` is then false); a running sandbox whose port refuses
the connection → 502 "The sandbox is running but port is not open". A Connect stream
(``application/connect+*``) whose sandbox goes away mid-stream ends with a Connect
end-of-stream error ``unavailable`` naming the cause but not the "was not found" phrase
(:func:`forkyard.relay.http.stream_cut_message`), so the SDK probes the sandbox and reports
it "killed or reached its end of life", as with E2B, instead of a command that ended
without an end event.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

import httpx

from forkyard.config import ENVD_PORT
from forkyard.orchestrator.errors import NotFound
from forkyard.relay.errors import send_error, send_json
from forkyard.relay.fastpath import FastConnections, has_no_body, relay_bodyless
from forkyard.relay.headers import HOP, WS_SKIP, client_headers
from forkyard.relay.http import relay_http
from forkyard.relay.paths import orchestrator_only
from forkyard.relay.upstream import SandboxConnections, sandbox_client
from forkyard.relay.websocket import relay_ws
from forkyard.routing import route_of

log = logging.getLogger("forkyard.proxy")

#: E2B's header for the traffic access token of sandboxes without public traffic.
TRAFFIC_TOKEN_HEADER = b"e2b-traffic-access-token"


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
        # fast path's sockets (forkyard.relay.fastpath).
        self._clients: dict[str, tuple[httpx.AsyncClient, SandboxConnections, FastConnections]] = {}

    def _pool(self, sid: str) -> tuple[httpx.AsyncClient, SandboxConnections, FastConnections]:
        pool = self._clients.get(sid)
        if pool is None:
            if len(self._clients) >= 64:
                self._sweep()
            conns = SandboxConnections()
            pool = self._clients[sid] = (sandbox_client(conns), conns, FastConnections())
        return pool

    def _client(self, sid: str) -> httpx.AsyncClient:
        return self._pool(sid)[0]

    @staticmethod
    async def _close(pool: tuple[httpx.AsyncClient, SandboxConnections, FastConnections]) -> None:
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
                return await send_json(send, 400, str(e))
            return await send({"type": "websocket.close", "code": 1008})
        if route is None and self.signed is not None and scope["type"] == "http" and scope["path"] == "/files":
            route = self._signed_route(scope)
            if route is False:
                return await send_json(send, 401, "invalid or expired file URL signature")
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
                return await send_error(send, scope, 502, str(e), sandboxId=sid)
            return await send({"type": "websocket.close", "code": 1008})
        if orchestrator_only(scope, port):
            if scope["type"] == "http":
                return await send_json(send, 403, f"{scope['path']} is reserved to forkyard's orchestrator "
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
            return await send_json(send, 403, f"sandbox {sid} requires its traffic access token in the "
                                               f"{TRAFFIC_TOKEN_HEADER.decode()} header for port {port}", sandboxId=sid)
        # The public Host goes along (E2B's proxy does the same): servers in the sandbox
        # build absolute URLs and check virtual hosts from it; a maskRequestHost replaces it.
        # Header names keep the case the client sent (client_headers), as with E2B.
        headers = [(k, v) for k, v in client_headers(scope)
                   if (k.decode("latin-1").lower() not in HOP or k.lower() == b"host")
                   and k.lower() != TRAFFIC_TOKEN_HEADER and not (mask and k.lower() == b"host")]
        if mask:
            headers.append((b"Host", mask.encode()))

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
            return await send_error(send, scope, 502, message, sandboxId=sid)
        what = f"sandbox {sid} port {port}"
        try:
            if has_no_body(scope) and await relay_bodyless(fast, scope, send, host, port, headers, what,
                                                                    gone=gone, sandbox_id=sid):
                return
            await relay_http(client, scope, receive, send, f"http://{host}:{port}", headers,
                             self.max_body_bytes, what, gone=gone, sandbox_id=sid, closed=lambda: conns.closed,
                             watch_disconnect=True)
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
                if k.decode("latin-1").lower() not in WS_SKIP and k.lower() != TRAFFIC_TOKEN_HEADER]
        await relay_ws(scope, receive, send, f"ws://{host}:{port}", hdrs)
