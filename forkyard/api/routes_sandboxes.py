"""E2B sandbox REST routes (paths, fields and codes from E2B's OpenAPI spec)."""

from __future__ import annotations

import asyncio

import time
import urllib.parse
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from forkyard.api import schemas
from forkyard.api.auth import require_key
from forkyard.ids import micros, micros_of, rfc3339
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import BadRequest, NotFound
from forkyard.orchestrator.manager import Orchestrator

router = APIRouter(dependencies=[Depends(require_key)])


def _orch(request: Request) -> Orchestrator:
    return request.app.state.orchestrator


def parse_metadata(raw: str | None) -> dict[str, str]:
    """``metadata`` query: URL-encoded ``k=v&…`` whose keys/values are themselves
    URL-quoted by the SDK."""
    if not raw:
        return {}
    try:
        pairs = urllib.parse.parse_qsl(raw, keep_blank_values=True, strict_parsing=True)
    except ValueError as e:
        raise BadRequest(f"invalid metadata filter {raw!r}: {e}") from e
    return {urllib.parse.unquote(k): urllib.parse.unquote(v) for k, v in pairs}


def filter_records(recs, metadata: str | None, states: set[str], template: str | None) -> list:
    """The records of ``recs`` a list request selects: visible ``state`` in ``states``
    (``running`` covers every state but paused and pausing), ``template`` (``name[:tag]``) and every
    ``metadata`` pair (URL-encoded query, as the SDK sends it).

    Raises:
        BadRequest: malformed metadata filter.
    """
    want = parse_metadata(metadata)
    out = []
    for rec in recs:
        if schemas.visible_state(rec) not in states:
            continue
        if template and rec.template_id != template.split(":", 1)[0]:
            continue
        if any(rec.metadata.get(k) != v for k, v in want.items()):
            continue
        out.append(rec)
    return out


async def _create(request: Request, body: schemas.NewSandbox) -> JSONResponse:
    """Create; the answer's ``Server-Timing`` says how: ``pool`` (handed out from the
    warm pool) or ``slot``/``runtime``/``envd`` (a cold start), and ``total`` (ms in
    this handler)."""
    t0 = time.perf_counter()
    phases = timing.start()
    refused = schemas.unsupported_create_fields(body)
    if refused:
        raise BadRequest("; ".join(refused))
    net = body.network
    egress = schemas.egress_policy(net.allow_out if net else None, net.deny_out if net else None,
                                   body.allow_internet_access)
    orch = _orch(request)
    rec = await orch.create(
        template_id=_tagged(request, body.template_id),
        timeout_s=body.timeout,
        metadata=body.metadata,
        env_vars=body.env_vars,
        auto_pause=body.auto_pause,  # None: the node's default (settings.default_auto_pause)
        # E2B secures envd access for every sandbox (its spec: "secure: Ignored. All
        # system communication with the sandbox is always secured"). forkyard does the
        # same unless the client explicitly sends ``secure: false`` (an open envd, for
        # old clients that cannot send a token).
        secure=body.secure is not False,
        auto_resume=bool(body.auto_resume and body.auto_resume.enabled),
        egress=egress,
        public_traffic=not (net is not None and net.allow_public_traffic is False),
        mask_host=net.mask_request_host if net is not None else None,
        auto_pause_memory=body.auto_pause_memory,
        volume_mounts=[(m.name, m.path) for m in body.volume_mounts or []],
    )
    timing.add("total", (time.perf_counter() - t0) * 1000)
    return JSONResponse(schemas.sandbox_created(rec, request.app.state.settings.public_domain), status_code=201,
                        headers=timing.header(phases))


def _tagged(request: Request, template_id: str) -> str:
    """``name:tag`` of a built template → the snapshot of the build the tag names
    (:meth:`forkyard.templates.build.TemplateBuilds.snapshot_for`); anything else as given.

    Raises:
        NotFound: a built template's tag that names no build.
    """
    builds = getattr(request.app.state, "template_builds", None)
    name, _, tag = (template_id or "").partition(":")
    if builds is None or builds.template_snapshot(name) is None:
        return template_id
    snap = builds.snapshot_for(name, tag or None)
    if snap is None:
        raise NotFound(f"template {template_id!r} not found (no build has tag {tag or 'default'!r})")
    return name if snap == builds.template_snapshot(name).snapshot_id else snap  # the newest build: by name


@router.post("/sandboxes", status_code=201)
async def create_sandbox(request: Request, body: schemas.NewSandbox):
    """Create a sandbox (E2B v1). envd access is secured with a per-sandbox token
    (``envdAccessToken`` in the answer) unless the body says ``"secure": false``."""
    return await _create(request, body)


@router.post("/v2/sandboxes", status_code=201)
async def create_sandbox_v2(request: Request, body: schemas.NewSandbox):
    """Create a sandbox (E2B v2); envd access as for ``POST /sandboxes``."""
    return await _create(request, body)


@router.get("/sandboxes")
async def list_sandboxes(request: Request, metadata: str | None = None):
    """Running sandboxes (E2B v1 list)."""
    return [schemas.sandbox_listed(r) for r in filter_records(_orch(request).list(), metadata, {"running"}, None)]


@dataclass
class ListQuery:
    """The query of E2B's ``GET /v2/sandboxes``, defined once for a node's route and the
    cluster gateway's (a FastAPI dependency: ``q: ListQuery = Depends()``): ``state``
    (running/paused; default both), ``metadata`` (``k=v&…``, URL-encoded), ``template``,
    start time (``startedAfter`` / ``startedBefore``: ISO 8601, inclusive), ``order``
    (by start time, default desc), ``limit`` (1-100, default 100) and the opaque
    ``nextToken`` (answered in the ``x-next-token`` header)."""

    metadata: str | None = None
    state: list[str] | None = Query(default=None)
    template: str | None = None
    order: str | None = Query(default=None, pattern="^(asc|desc)$")
    next_token: str | None = Query(default=None, alias="nextToken")
    limit: int = Query(default=100, ge=1, le=100)
    started_after: str | None = Query(default=None, alias="startedAfter")
    started_before: str | None = Query(default=None, alias="startedBefore")


@router.get("/v2/sandboxes")
async def list_sandboxes_v2(request: Request, response: Response, q: ListQuery = Depends()):
    """Sandboxes filtered, ordered and paginated as :class:`ListQuery` says."""
    return list_page(_orch(request).list(), response, q.metadata, q.state, q.template, q.order, q.next_token,
                     q.limit, q.started_after, q.started_before)


def _when(name: str, raw: str | None) -> int | None:
    """UNIX time in whole microseconds (:func:`~forkyard.ids.micros_of`) of an ISO 8601
    query value (a naive one is UTC).

    Raises:
        BadRequest: not ISO 8601 (naming ``name``).
    """
    if raw is None or raw == "":
        return None
    from datetime import datetime, timezone

    try:
        t = datetime.fromisoformat(raw.replace("Z", "+00:00").replace(" ", "+"))
    except ValueError as e:
        raise BadRequest(f"{name}: {raw!r} is not an ISO 8601 time") from e
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return micros_of(t)


def list_filters(metadata: str | None, state: list[str] | str | None, started_after: str | None,
                 started_before: str | None) -> tuple[set[str], int | None, int | None]:
    """The ``GET /v2/sandboxes`` filters checked (shared by node and gateway): the
    states asked for (``?state=a,b`` or ``?state=a&state=b``; default both) and the
    start-time bounds (whole UNIX microseconds, compared with :func:`~forkyard.ids.micros`
    of a start time; inclusive; None: open).

    Raises:
        BadRequest: bad state filter, metadata filter or time.
    """
    if isinstance(state, list):  # ?state=a,b (E2B's form) or ?state=a&state=b
        state = ",".join(state) or None
    states = set((state or "running,paused").split(","))
    if not states <= {"running", "paused"}:
        raise BadRequest(f"invalid state filter {state!r}: use running and/or paused")
    parse_metadata(metadata)
    return states, _when("startedAfter", started_after), _when("startedBefore", started_before)


def list_page(recs, response: Response, metadata: str | None, state: list[str] | str | None, template: str | None,
              order: str | None, next_token: str | None, limit: int,
              started_after: str | None = None, started_before: str | None = None) -> list[dict]:
    """One page of ``GET /v2/sandboxes`` over ``recs`` (shared by node and gateway):
    filtered (:func:`filter_records`, then start time within ``started_after`` …
    ``started_before``, ISO 8601, inclusive), newest first unless ``order=asc``, paginated.

    Raises:
        BadRequest: bad state filter, metadata filter, time or nextToken.
    """
    states, after, before = list_filters(metadata, state, started_after, started_before)
    recs = filter_records(recs, metadata, states, template)
    # In the microseconds ``startedAt`` shows: a client passing back a sandbox's own
    # ``startedAt`` (the SDK's ``SandboxQuery(started_after=info.started_at)``) selects it.
    recs = [r for r in recs if (after is None or micros(r.started_at) >= after)
            and (before is None or micros(r.started_at) <= before)]
    recs.sort(key=lambda r: (r.started_at, r.id), reverse=(order != "asc"))
    page = schemas.paginate(recs, limit, next_token, response)
    return [schemas.sandbox_listed(r) for r in page]


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(request: Request, sandbox_id: str):
    """One sandbox's details."""
    return schemas.sandbox_detail(_orch(request).get(sandbox_id), request.app.state.settings.public_domain)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(request: Request, sandbox_id: str):
    """Kill a sandbox (204; 404 when unknown)."""
    await _orch(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(request: Request, sandbox_id: str, body: schemas.TimeoutBody):
    """Set the sandbox to expire ``timeout`` seconds from now."""
    await _orch(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def refresh(request: Request, sandbox_id: str, body: schemas.RefreshBody | None = None):
    """Keep the sandbox alive for at least ``duration`` more seconds."""
    await _orch(request).refresh(sandbox_id, body.duration if body else None)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(request: Request, sandbox_id: str, start: int | None = Query(default=None, ge=0),
                  end: int | None = Query(default=None, ge=0)):
    """CPU / memory / disk usage as a ``SandboxMetric`` list. forkyard keeps no history:
    the list holds the current sample when it lies in ``start`` … ``end`` (UNIX seconds,
    inclusive; open ends when omitted), else is empty. A paused sandbox has no samples.

    Raises:
        BadRequest: ``start`` after ``end``.
    """
    if start is not None and end is not None and start > end:
        raise BadRequest(f"start ({start}) is after end ({end})")
    rec = _orch(request).get(sandbox_id)
    now = time.time()
    if rec.state == "paused" or (start is not None and now < start) or (end is not None and int(now) > end):
        return []
    m = await _orch(request).metrics(sandbox_id)
    return [
        {
            "timestamp": rfc3339(now),
            "timestampUnix": int(now),
            "cpuCount": m.get("cpu_count", 0),
            "cpuUsedPct": m.get("cpu_used_pct", 0.0),
            "memUsed": m.get("mem_used", 0),
            "memTotal": m.get("mem_total", 0),
            "memCache": m.get("mem_cache", 0),
            "diskUsed": m.get("disk_used", 0),
            "diskTotal": m.get("disk_total", 0),
        }
    ]


@router.put("/sandboxes/{sandbox_id}/network", status_code=204)
async def update_network(request: Request, sandbox_id: str, body: schemas.NetworkUpdate):
    """Replace a sandbox's egress rules (E2B ``update_network``): 204; 404 unknown; 400
    for entries or fields forkyard does not enforce (domains, DNS servers, proxies,
    request rules). A paused sandbox gets them when it resumes."""
    refused = schemas.unsupported_egress(body)
    if refused:
        raise BadRequest("; ".join(refused))
    policy = schemas.egress_policy(body.allow_out, body.deny_out, body.allow_internet_access)
    await _orch(request).set_network(sandbox_id, policy)
    return Response(status_code=204)


@router.get("/sandboxes/{sandbox_id}/logs")
async def logs_v1(request: Request, sandbox_id: str, start: int | None = Query(default=None, ge=0),
                  limit: int = Query(default=1000, ge=1, le=10000)):
    """E2B ``SandboxLogs``: ``logs`` (``{timestamp, line}``, ``line`` being a JSON object
    with ``level``, ``logger`` and ``message`` as in E2B's, which the E2B CLI parses) and
    ``logEntries`` (``{timestamp, level, message, fields}``) from ``start`` (UNIX ms) on,
    oldest first, at most ``limit``. Sources (``logger``): ``forkyard`` (the node's own
    entries) and ``sandbox`` (its console: envd's log, with each process it started and
    how it ended, and anything written to it inside; always ``info``), see
    :mod:`forkyard.orchestrator.logs`."""
    import json

    from forkyard.orchestrator.logs import select

    entries = select(await asyncio.to_thread(_orch(request).log_entries, sandbox_id), start, limit)
    lines = [json.dumps({"level": e["level"], "logger": e["fields"]["source"], "message": e["message"],
                         **{k: v for k, v in e["fields"].items() if k != "source"}}) for e in entries]
    return {"logs": [{"timestamp": e["timestamp"], "line": line} for e, line in zip(entries, lines)],
            "logEntries": [_entry(e) for e in entries]}


@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def logs_v2(request: Request, sandbox_id: str, cursor: int | None = Query(default=None, ge=0),
                  limit: int = Query(default=1000, ge=1, le=10000),
                  direction: str = Query(default="forward", pattern="^(forward|backward)$"),
                  level: str | None = Query(default=None, pattern="^(debug|info|warn|error)$"),
                  search: str | None = Query(default=None, max_length=256)):
    """E2B ``SandboxLogsV2Response``: entries from ``cursor`` (UNIX ms) ``forward``
    (oldest first) or ``backward`` (newest first), at least ``level``, containing
    ``search``, at most ``limit``. Page on with the last entry's time as the cursor."""
    from forkyard.orchestrator.logs import select

    entries = select(await asyncio.to_thread(_orch(request).log_entries, sandbox_id), cursor, limit, direction,
                     level, search)
    return {"logs": [_entry(e) for e in entries]}


def _entry(e: dict) -> dict:
    return {"timestamp": e["timestamp"], "level": e["level"], "message": e["message"], "fields": e["fields"]}
