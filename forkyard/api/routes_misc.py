"""Health and template listing routes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from forkyard.api.auth import require_key
from forkyard.api.routes_templates import template_entries

router = APIRouter()


@router.get("/health")
async def health():
    """Liveness: 200 ``{"status": "ok"}`` (no auth, as E2B's ``/health``)."""
    return {"status": "ok"}


@router.get("/templates", dependencies=[Depends(require_key)])
async def list_templates(request: Request):
    """Templates on this node in E2B's ``Template`` shape: rootfs templates (``base``,
    imported images) and built templates (snapshots of template builds)."""
    return template_entries(request)
