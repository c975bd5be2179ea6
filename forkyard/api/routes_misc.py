"""Health, the template list and the node's own metrics endpoints (``/metrics/…``:
forkyard's, not E2B's; key required)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from forkyard.api.auth import require_key
from forkyard.api.routes_templates import template_entries
from forkyard.repository.usage import snapshot_usage

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


@router.get("/metrics/repository", dependencies=[Depends(require_key)])
async def repository_metrics(request: Request):
    """Snapshot repository and node-cache counters (cache hits/misses, bytes fetched
    and uploaded, GC runs) as returned by ``Orchestrator.repository_metrics``."""
    return await asyncio.to_thread(request.app.state.orchestrator.repository_metrics)


@router.get("/metrics/node", dependencies=[Depends(require_key)])
async def node_metrics(request: Request):
    """This node's sandbox counts and pre-built spare network slots, as returned by
    ``Orchestrator.node_metrics``."""
    return request.app.state.orchestrator.node_metrics()


@router.get("/metrics/snapshots", dependencies=[Depends(require_key)])
async def snapshots(request: Request):
    """Snapshots in the repository with their sizes and how many chunks they share with
    other snapshots (:func:`~forkyard.repository.usage.snapshot_usage`; for the console).
    forkyard's own endpoint."""
    repo = request.app.state.orchestrator.snapshots.repo
    return await asyncio.to_thread(snapshot_usage, repo)
