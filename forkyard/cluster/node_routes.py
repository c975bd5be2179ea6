"""What a cluster node serves to the control plane beside its REST API (used by
:class:`~.agent.NodeAgent`):

* the **internal routes** under ``/cluster`` (behind the agent's key check): ``adopt`` a
  paused sandbox from a dead or draining node, fork with an exported image, start fork
  children from another node's image, delete an exported fork image;
* :func:`record_from_published`, the checked inverse of what a node publishes for a
  sandbox (:func:`~.messages.published_record`);
* :class:`PlacementAck`, the middleware that acknowledges the scheduler's placements.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Callable

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictInt

from forkyard.api.auth import cluster_secret_ok
from forkyard.api.routes_lifecycle import fork_results
from forkyard.cluster.config import PLACEMENT_HEADER
from forkyard.ids import is_name, is_sandbox_id
from forkyard.orchestrator import timing
from forkyard.orchestrator.store import SandboxRecord

_RECORD_FIELDS = {f.name for f in fields(SandboxRecord)}
_PLACEMENT_ID = re.compile(r"[0-9a-f]{16}")


class ForkExport(BaseModel):
    """Body of ``POST /cluster/sandboxes/{id}/fork``: children made here (``count``,
    0 = only export the image for other nodes) and their lifetime (``timeout``, s)."""

    count: StrictInt = Field(ge=0, le=100)
    timeout: StrictInt = Field(default=15, ge=1, le=86400)


class ForkChildren(BaseModel):
    """Body of ``POST /cluster/fork-children``: ``count`` children restored here from
    another node's exported fork ``image`` (its snapshot id), each living ``timeout`` s."""

    image: str = Field(min_length=1, max_length=64)
    count: StrictInt = Field(ge=1, le=100)
    timeout: StrictInt = Field(default=15, ge=1, le=86400)
    auto_pause: bool = Field(default=True, alias="autoPause")
    #: the source's egress policy (forkyard.network.egress), so children stay filtered
    egress: dict | None = None


def record_from_published(body: dict) -> SandboxRecord:
    """A :class:`SandboxRecord` from its published dict (unknown keys ignored), checked
    before anything uses it: its id names host paths (work dir, runsc state) and its
    sizes become limits, so only the shapes forkyard itself writes pass.

    Raises:
        TypeError: required fields missing or malformed (the routes answer 400).
    """
    rec = SandboxRecord(**{k: v for k, v in body.items() if k in _RECORD_FIELDS})
    ints = {"vcpus": (1, 64), "memory_mb": (64, 1 << 20), "disk_mb": (0, 1 << 24)}
    if not isinstance(rec.id, str) or not is_sandbox_id(rec.id):
        raise TypeError(f"id must be 1-64 lower-case letters and digits, got {str(rec.id)[:80]!r}")
    if rec.image_id is not None and (not isinstance(rec.image_id, str) or not is_name(rec.image_id)):
        raise TypeError("image_id is not a snapshot id")
    if not isinstance(rec.template_id, str) or len(rec.template_id) > 128:
        raise TypeError("template_id must be a string of at most 128 characters")
    for name, (lo, hi) in ints.items():
        v = getattr(rec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise TypeError(f"{name} must be an integer between {lo} and {hi}")
    return rec


def internal_router(orch) -> APIRouter:
    """The ``/cluster`` routes over the node's orchestrator ``orch``. They check no key
    themselves: :meth:`~.agent.NodeAgent.wrap` lets only this node's key through."""
    router = APIRouter(prefix="/cluster")

    @router.post("/adopt")
    async def adopt(request: Request):
        body = await request.json()
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            raise HTTPException(400, "body must be a sandbox record with an id")
        try:
            rec = record_from_published(body)
        except TypeError as e:
            raise HTTPException(400, f"not a sandbox record: {e}") from e
        rec = await orch.adopt(rec)
        return {"sandboxID": rec.id, "state": rec.state}

    @router.post("/sandboxes/{sandbox_id}/fork")
    async def fork_export(sandbox_id: str, body: ForkExport):
        phases = timing.start()
        results, image = await orch.fork_export(sandbox_id, body.count, body.timeout)
        return JSONResponse({"results": fork_results(results), "image": image},
                            headers=timing.header(phases))

    @router.post("/fork-children")
    async def fork_children(body: ForkChildren):
        phases = timing.start()
        results = await orch.fork_children(body.image, body.count, body.timeout, body.auto_pause, body.egress)
        return JSONResponse({"results": fork_results(results)}, headers=timing.header(phases))

    @router.delete("/images/{snapshot_id}", status_code=204)
    async def delete_image(snapshot_id: str):
        if not await orch.delete_image(snapshot_id):
            raise HTTPException(404, f"fork image {snapshot_id!r} not found")
        return Response(status_code=204)

    return router


class PlacementAck:
    """ASGI middleware on the node: a call that carries the scheduler's placement id
    (:data:`~forkyard.cluster.config.PLACEMENT_HEADER`, with the cluster secret) is
    acknowledged in a heartbeat sent as soon as it has ended — answered or failed — so the
    scheduler counts the placement until the node's report shows its sandboxes, never
    both gone (a placement made while a report was in flight used to be lost).

    Args:
        app: the ASGI app it wraps.
        secret: this node's key (the header must carry it).
        on_ended: called with the placement id (16 hex digits) once its call has ended.
    """

    def __init__(self, app, secret: str, on_ended: Callable[[str], None]):
        self.app, self.secret, self.on_ended = app, secret, on_ended

    async def __call__(self, scope, receive, send):
        pid = None
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            got = headers.get(PLACEMENT_HEADER)
            if got and _PLACEMENT_ID.fullmatch(got) and cluster_secret_ok(headers, self.secret):
                pid = got
        try:
            await self.app(scope, receive, send)
        finally:
            if pid:
                self.on_ended(pid)
