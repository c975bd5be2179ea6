"""ASGI application factory: REST routes + sandbox proxy + lifecycle wiring."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from forkyard.api import schemas
from forkyard.api.auth import load_or_create_key
from forkyard.api.limits import RestGuard
from forkyard.api.proxy import SandboxProxy
from forkyard.api.routes_lifecycle import router as lifecycle_router
from forkyard.api.routes_misc import router as misc_router
from forkyard.api.routes_sandboxes import router as sandboxes_router
from forkyard.api.routes_templates import router as templates_router
from forkyard.api.routes_volume_content import router as volume_content_router
from forkyard.api.routes_volumes import router as volumes_router
from forkyard.config import Settings
from forkyard.repository.errors import RepositoryError
from forkyard.orchestrator.errors import OrchestratorError
from forkyard.orchestrator.manager import Orchestrator

log = logging.getLogger("forkyard.api")


class _CatchAll:
    """ASGI middleware: an unexpected exception becomes a JSON 500 (``{code, message}``)
    and the connection stays usable. (Starlette's catch-all handler answers too, but
    then re-raises, so uvicorn logs the traceback a second time and drops a keep-alive
    connection the client may be about to reuse.)"""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:  # noqa: BLE001 — this is the last line of defence
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise
            response = JSONResponse(schemas.error(500, f"internal error: {exc!r}"), status_code=500)
            await response(scope, receive, send)


def create_app(settings: Settings, orch: Orchestrator):
    """Build the ASGI app serving ``orch`` (:func:`forkyard.node.build_node` puts the
    two together). Returns the proxy-wrapped app; the FastAPI instance is at
    ``.fastapi``. The orchestrator starts/stops with the app lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await orch.start()
        for hook in app.state.on_start:
            await hook()
        try:
            yield
        finally:
            for hook in app.state.on_stop:
                await hook()
            await orch.stop()
            await proxy.aclose()

    api = FastAPI(
        title="forkyard",
        summary="E2B-compatible API for forkable gVisor sandboxes",
        version="0.1.0",
        lifespan=lifespan,
    )
    api.state.settings = settings
    api.state.orchestrator = orch
    api.state.api_key = load_or_create_key(settings.api_key_file)
    #: ``async f()`` run after the orchestrator starts / before it stops (cluster agent).
    api.state.on_start, api.state.on_stop = [], []

    @api.exception_handler(OrchestratorError)
    async def _orch_error(request: Request, exc: OrchestratorError):
        # headers: e.g. the node holding a volume (VolumeHeld), for the cluster's gateway
        return JSONResponse(schemas.error(exc.status, str(exc)), status_code=exc.status,
                            headers=getattr(exc, "headers", None))

    @api.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(schemas.error(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
        return JSONResponse(schemas.error(400, "; ".join(parts) or "invalid request"), status_code=400)

    @api.exception_handler(RepositoryError)
    async def _repository_error(request: Request, exc: RepositoryError):
        log.error("snapshot repository error on %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse(schemas.error(503, f"snapshot repository unavailable: {exc}; retry when it is "
                                               "reachable again (see GET /metrics/repository)"), status_code=503)

    api.add_middleware(_CatchAll)

    api.include_router(misc_router)
    api.include_router(sandboxes_router)
    api.include_router(templates_router)  # before lifecycle: its DELETE /templates/{id} handles snapshots too
    api.include_router(lifecycle_router)
    api.include_router(volumes_router)
    api.include_router(volume_content_router)
    # Auth from headers and body caps before FastAPI reads any body (issue 11, item 5).
    guarded = RestGuard(api, api.state.api_key, settings.max_upload_mb << 20)
    proxy = SandboxProxy(guarded, orch.target, max_body_bytes=settings.max_upload_mb << 20, wake=orch.wake,
                         signed=orch.sandbox_for_file_signature, rules=orch.proxy_rules)
    orch.on_gone.append(proxy.forget)
    proxy.fastapi = api
    return _observed(proxy, api, orch)


def _observed(proxy, api: FastAPI, orch: Orchestrator):
    """``proxy`` behind :class:`~forkyard.obs.middleware.ObsMiddleware`: ``/metrics``
    (node state + process counters), ``/console``, request ids and access logs."""
    import asyncio

    from forkyard.obs.collect import node_families
    from forkyard.obs.middleware import ObsMiddleware

    async def collect():
        return await asyncio.to_thread(node_families, orch)

    return ObsMiddleware(proxy, "node", collect=collect, console=True,
                         keys=lambda: [api.state.api_key, getattr(api.state, "cluster_secret", None)])
