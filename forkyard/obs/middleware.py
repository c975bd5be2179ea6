"""ASGI middleware put in front of every component (node, gateway, scheduler):

* ``GET /metrics``: Prometheus text (:mod:`forkyard.obs.metrics`; who may scrape:
  :func:`~forkyard.obs.metrics.scrape_allowed`);
* ``/console``: the web console's static files (:mod:`forkyard.obs.console`), when enabled;
* every other request gets a request id (``X-Request-Id``: the client's when sane, else
  new; set in the request headers passed on — so the gateway's calls to nodes carry it,
  though a sandbox never gets one its client did not send — and echoed in the reply), is counted (API vs sandbox traffic, bytes, open streams,
  errors) and logged once it ends (``forkyard.access``: INFO for API calls, DEBUG for
  sandbox traffic) with method, path (no query string), status, operation and duration.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from forkyard.ids import SANDBOX_ID
from forkyard.obs import logs, metrics, tracing
from forkyard.routing import route_of

log = logging.getLogger("forkyard.access")

_SANDBOX_PATH = re.compile(rf"^/(?:v2/|cluster/)?sandboxes/({SANDBOX_ID})(/[a-z]+)?")
_OPS = {"pause": "pause", "resume": "resume", "connect": "connect", "fork": "fork", "snapshots": "snapshot",
        "timeout": "set_timeout", "refreshes": "refresh", "metrics": "sandbox_metrics", "logs": "sandbox_logs"}


def operation(method: str, path: str) -> str | None:
    """The lifecycle operation a REST call performs (``create``, ``kill``, ``pause``,
    ``fork``, …) or None for other calls."""
    if method == "POST" and path in ("/sandboxes", "/v2/sandboxes"):
        return "create"
    m = _SANDBOX_PATH.match(path)
    if not m:
        return None
    if m.group(2) is None:
        return {"DELETE": "kill", "GET": "get"}.get(method)
    return _OPS.get(m.group(2)[1:])


def _status_class(status: int) -> str:
    return f"{status // 100}xx"


class ObsMiddleware:
    """See the module docstring.

    Args:
        app: the component's ASGI app.
        component: ``node``, ``gateway`` or ``scheduler`` (for logs).
        collect: ``async () -> list[MetricFamily]`` of scrape-time gauges, or None.
        keys: ``() -> list[str]`` of credentials also accepted for a scrape (API key,
            cluster secret) besides the metrics token.
        console: serve the web console at ``/console``.
    """

    def __init__(self, app, component: str, collect: Callable[[], Awaitable[list]] | None = None,
                 keys: Callable[[], list[str]] | None = None, console: bool = False):
        self.app, self.component, self.collect, self.keys, self.console = app, component, collect, keys, console
        self.fastapi = getattr(app, "fastapi", None)
        self._token = metrics.metrics_token()

    def __getattr__(self, name):  # the wrapped app's attributes (``forget``, ``aclose``, …)
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        try:
            route = route_of(scope)
            malformed = False
        except ValueError:
            route, malformed = None, True
        # /metrics and /console live on the API host only: on a sandbox's host
        # (PORT-ID.DOMAIN, or routing headers) every path is the sandbox's (issue 25, item 7).
        if kind == "http" and route is None and not malformed and path == "/metrics":
            return await self._metrics(scope, receive, send)
        if (kind == "http" and route is None and not malformed and self.console
                and (path == "/console" or path.startswith("/console/"))):
            from forkyard.obs import console

            return await console.serve(scope, receive, send)
        headers = scope.get("headers", [])
        offered = next((v.decode("latin-1") for k, v in headers if k.lower() == b"x-request-id"), None)
        rid = logs.new_request_id(offered)
        traffic = route is not None
        if offered != rid and not traffic:  # a sandbox gets only the headers its client sent
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in headers if k.lower() != b"x-request-id"] + \
                [(b"x-request-id", rid.encode())]
        sid = route[0] if route else (m.group(1) if (m := _SANDBOX_PATH.match(path)) else None)
        t_rid, t_sid = logs.request_id.set(rid), logs.sandbox_id.set(sid)
        t0 = time.perf_counter()
        status = 0
        if kind == "websocket":
            status = 101
            metrics.OPEN_WS.inc()

            async def ws_receive():
                msg = await receive()
                if msg["type"] == "websocket.receive":
                    metrics.BYTES_IN.inc(len(msg.get("bytes") or b"") + len((msg.get("text") or "").encode()))
                return msg

            async def ws_send(msg):
                if msg["type"] == "websocket.send":
                    metrics.BYTES_OUT.inc(len(msg.get("bytes") or b"") + len((msg.get("text") or "").encode()))
                await send(msg)

            try:
                return await self.app(scope, ws_receive, ws_send)
            finally:
                metrics.OPEN_WS.dec()
                logs.request_id.reset(t_rid), logs.sandbox_id.reset(t_sid)

        if traffic:
            metrics.OPEN_HTTP.inc()

        async def counted_receive():
            msg = await receive()
            if traffic and msg["type"] == "http.request":
                metrics.BYTES_IN.inc(len(msg.get("body", b"")))
            return msg

        async def tagged_send(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = dict(msg)
                msg["headers"] = [(k, v) for k, v in msg.get("headers", []) if k.lower() != b"x-request-id"] + \
                    [(b"x-request-id", rid.encode())]  # one, also when relaying a node's answer
            elif traffic and msg["type"] == "http.response.body":
                metrics.BYTES_OUT.inc(len(msg.get("body", b"")))
            elif traffic and msg["type"] == "http.response.zerocopysend":  # forkyard.relay.zerocopy
                await send(msg)
                metrics.BYTES_OUT.inc(msg["count"])
                metrics.PROXY_SPLICED.inc(msg["count"])
                return
            await send(msg)

        failed = False
        op = None if traffic else operation(scope["method"], path)
        try:
            if traffic or not tracing.enabled():
                await self.app(scope, counted_receive, tagged_send)
            else:
                await self._traced(scope, counted_receive, tagged_send, op, rid, sid, lambda: status)
        except Exception:
            failed = True
            raise
        finally:
            ms = round((time.perf_counter() - t0) * 1000, 1)
            code = _status_class(status or 500)
            metrics.HTTP_REQUESTS.labels("sandbox" if traffic else "api", code).inc()
            if traffic:
                metrics.OPEN_HTTP.dec()
                if failed:
                    metrics.PROXY_ERRORS.labels("exception").inc()
                elif status in (400, 404, 502, 503, 504):
                    metrics.PROXY_ERRORS.labels({400: "bad_request", 404: "not_found"}.get(status, "unreachable")).inc()
            log.log(logging.DEBUG if traffic or path == "/health" else logging.INFO,
                    "%s %s %s %.1fms", scope["method"], path, status or "-", ms,
                    extra={"method": scope["method"], "path": path, "status": status or None,
                           "duration_ms": ms, "operation": op})
            logs.request_id.reset(t_rid), logs.sandbox_id.reset(t_sid)

    async def _traced(self, scope, receive, send, op: str | None, rid: str, sid: str | None, status) -> None:
        """Serve a REST request inside a server span (:mod:`forkyard.obs.tracing`) whose
        ``traceparent`` replaces the client's in the headers passed on (gateway → node)."""
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        name = f"{scope['method']} {op or '/' + path.split('/')[1]}"
        with tracing.request_span(name, headers, {"http.request.method": scope["method"], "url.path": path,
                                                  "forkyard.request_id": rid, "forkyard.sandbox_id": sid,
                                                  "forkyard.component": self.component}) as set_attr:
            scope = dict(scope)
            scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() != b"traceparent"] + \
                [(k.encode(), v.encode()) for k, v in tracing.outgoing().items()]
            try:
                await self.app(scope, receive, send)
            finally:
                set_attr("http.response.status_code", status() or 500)

    async def _metrics(self, scope, receive, send) -> None:
        from starlette.responses import JSONResponse, Response

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        client = (scope.get("client") or (None, None))[0]
        keys = [k for k in (self.keys() if self.keys else []) if k]
        allowed = metrics.scrape_allowed(headers, client, self._token, None) or any(
            metrics.scrape_allowed(headers, client, self._token, k) for k in keys)
        if scope.get("method") != "GET":
            resp = JSONResponse({"code": 405, "message": "use GET /metrics"}, status_code=405)
        elif not allowed:
            resp = JSONResponse({"code": 401, "message": "GET /metrics needs Authorization: Bearer <metrics token "
                                 "or API key> (or a loopback client while FORKYARD_METRICS_TOKEN is unset)"},
                                status_code=401)
        else:
            families = await self.collect() if self.collect else []
            resp = Response(metrics.render(families), media_type=CONTENT_TYPE_LATEST)
        await resp(scope, receive, send)
