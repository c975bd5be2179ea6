"""Health and template listing routes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from forkyard.api.auth import require_key
from forkyard.templates import registry

router = APIRouter()


@router.get("/health")
async def health():
    """Liveness: 200 ``{"status": "ok"}`` (no auth, as E2B's ``/health``)."""
    return {"status": "ok"}


@router.get("/templates", dependencies=[Depends(require_key)])
async def list_templates(request: Request):
    """Templates built on this node, in E2B's ``Template`` shape."""
    out = []
    for t in registry.list_templates(request.app.state.settings):
        out.append({
            "templateID": t.template_id,
            "buildID": t.template_id,
            "cpuCount": request.app.state.settings.default_vcpu,
            "memoryMB": request.app.state.settings.default_memory_mb,
            "public": False,
            "aliases": [t.template_id],
            "names": [t.template_id],
            "buildStatus": "ready",
        })
    return out
