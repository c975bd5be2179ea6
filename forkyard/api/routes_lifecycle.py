"""E2B lifecycle routes: pause, resume, connect, fork, snapshots (paths, bodies and
status codes from E2B's OpenAPI spec as shipped in the ``e2b`` SDK)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from forkyard.api import schemas
from forkyard.api.auth import require_key
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import OrchestratorError
from forkyard.orchestrator.manager import Orchestrator

router = APIRouter(dependencies=[Depends(require_key)])


def _orch(request: Request) -> Orchestrator:
    return request.app.state.orchestrator


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause(request: Request, sandbox_id: str, body: schemas.PauseBody | None = None):
    """Pause (checkpoint + stop): 204; 404 unknown; 409 already paused; 503 when
    ``requireHealthyGuest`` and envd does not answer. ``memory: false``: a
    filesystem-only pause (resume cold-boots over the saved files); 409 when the
    changed files are too large to lay back at resume (the sandbox keeps running).
    ``Server-Timing``: ``freeze`` (hot or filesystem-only pause), ``checkpoint``
    (memory) or ``scan`` + ``export`` (filesystem-only), and ``commit`` in a cluster (ms)."""
    phases = timing.start()
    await _orch(request).pause(sandbox_id, require_healthy=bool(body and body.require_healthy_guest),
                               memory=not (body is not None and body.memory is False))
    return Response(status_code=204, headers=timing.header(phases))


@router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
async def resume(request: Request, sandbox_id: str, body: schemas.ResumeBody | None = None):
    """Resume a paused sandbox under the same id: 201 ``Sandbox``; 409 when running.
    ``Server-Timing``: ``thaw`` (its frozen runtime was still kept: hot pause),
    ``restore`` (from its memory image) or ``boot`` (a cold boot over its
    filesystem-only image), ms, with its parts: ``lookup`` (the pause image's manifest),
    ``slot`` (with the row written), ``image`` (image directory from the node cache
    or materialized), ``runtime`` (of which ``disk``, ``runsc``, ``rearm``), ``envd``
    (until it answers), and ``total`` (the whole request in the server)."""
    t0 = time.perf_counter()
    phases = timing.start()
    rec = await _orch(request).resume(sandbox_id, body.timeout if body else None,
                                      body.auto_pause if body else None)
    timing.add("total", (time.perf_counter() - t0) * 1000)
    return JSONResponse(schemas.sandbox_created(rec, _domain(request)), status_code=201, headers=timing.header(phases))


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect(request: Request, sandbox_id: str, body: schemas.ConnectBody | None = None):
    """Connect: a running sandbox gets its timeout extended (never shortened), 200; a
    paused one is resumed, 201 (``Server-Timing`` as for resume). Waits for a
    pause/resume in progress. ``memory: false`` (SDK ``on_resume="reboot"``): accepted
    for a running or filesystem-only paused sandbox (nothing to drop), 400 for one
    paused with memory."""
    phases = timing.start()
    rec, resumed = await _orch(request).connect(sandbox_id, body.timeout if body else 300,
                                                body.memory if body else None)
    return JSONResponse(schemas.sandbox_created(rec, _domain(request)), status_code=201 if resumed else 200,
                        headers=timing.header(phases))


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(request: Request, sandbox_id: str, body: schemas.ForkBody | None = None):
    """Fork into ``count`` children: 201 with one ``{sandbox}`` or ``{error}`` per child."""
    body = body or schemas.ForkBody()
    phases = timing.start()
    results = await _orch(request).fork(sandbox_id, body.count, body.timeout)
    return JSONResponse(fork_results(results, _domain(request)), status_code=201, headers=timing.header(phases))


def _domain(request: Request) -> str:
    return request.app.state.settings.public_domain


def fork_results(results: list, domain: str | None = None) -> list[dict]:
    """E2B fork answer entries: ``{"sandbox": Sandbox}`` per child that runs, or
    ``{"error": Error}`` with the status of what stopped it."""
    out = []
    for r in results:
        if isinstance(r, Exception):
            status = r.status if isinstance(r, OrchestratorError) else 500
            out.append({"error": schemas.error(status, str(r))})
        else:
            out.append({"sandbox": schemas.sandbox_created(r, domain)})
    return out


@router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
async def create_snapshot(request: Request, sandbox_id: str, body: schemas.SnapshotBody | None = None):
    """Snapshot a running sandbox (it keeps running): 201 ``SnapshotInfo``.
    ``memory: false``: its filesystem only (sandboxes created from it cold-boot); 409
    when the changed files are too large to lay back (see the pause).
    ``Server-Timing``: ``checkpoint`` (how long the source was stopped; filesystem-only:
    ``scan`` before, then ``freeze`` + ``export``) and ``commit`` (ms)."""
    phases = timing.start()
    meta = await _orch(request).snapshot(sandbox_id, body.name if body else None,
                                         memory=not (body is not None and body.memory is False))
    return JSONResponse(schemas.snapshot_info(meta), status_code=201, headers=timing.header(phases))


@router.get("/snapshots")
async def list_snapshots(
    request: Request,
    response: Response,
    sandbox_id: str | None = Query(default=None, alias="sandboxID"),
    name: str | None = None,
    limit: int = Query(default=100, ge=1, le=100),
    next_token: str | None = Query(default=None, alias="nextToken"),
):
    """Snapshots, oldest first, filtered by source ``sandboxID`` / ``name``, paginated
    by ``limit`` and ``nextToken`` (``x-next-token`` header)."""
    metas = _orch(request).list_snapshots(sandbox_id, name)
    return [schemas.snapshot_info(m) for m in schemas.paginate(metas, limit, next_token, response)]


@router.delete("/templates/{template_id}", status_code=204)
async def delete_template(request: Request, template_id: str):
    """Delete a snapshot (E2B deletes snapshots through the templates path): 204/404."""
    _orch(request).delete_snapshot(template_id)
    return Response(status_code=204)
