"""Read-only console data a node serves beyond E2B's API (key required)."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fastapi import APIRouter, Depends, Request

from forkyard.api.auth import require_key

router = APIRouter()

#: Most snapshots ``GET /metrics/snapshots`` describes (newest first).
MAX_SNAPSHOTS = 200


def snapshot_usage(repo, limit: int = MAX_SNAPSHOTS) -> list[dict]:
    """Committed snapshots (every kind but transient ``fork`` images), newest first, at
    most ``limit``: ``{snapshotID, names, kind, sandboxID, templateID, parentImageID,
    sizeBytes (image bytes, uncompressed), chunks (distinct), sharedChunks (also used by
    another snapshot), createdAt (RFC 3339)}``. Reads every manifest (cached by the
    repository after the first read); blocking."""
    manifests = [m for m in repo.manifests() if m.meta.get("kind") != "fork"]
    hashes = {m.snapshot_id: m.chunk_hashes() for m in manifests}
    refs: dict[str, int] = {}
    for hs in hashes.values():
        for h in hs:
            refs[h] = refs.get(h, 0) + 1
    manifests.sort(key=lambda m: m.meta.get("created_at", 0), reverse=True)
    out = []
    for m in manifests[:limit]:
        hs = hashes[m.snapshot_id]
        out.append({
            "snapshotID": m.snapshot_id, "names": m.meta.get("names", []), "kind": m.meta.get("kind"),
            "sandboxID": m.meta.get("source_sandbox_id"), "templateID": m.meta.get("template_id"),
            "parentImageID": m.meta.get("parent_image_id"), "sizeBytes": m.meta.get("size_bytes", 0),
            "chunks": len(hs), "sharedChunks": sum(1 for h in hs if refs[h] > 1),
            "createdAt": _iso(m.meta.get("created_at") or 0),
        })
    return out


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


@router.get("/metrics/snapshots", dependencies=[Depends(require_key)])
async def snapshots(request: Request):
    """Snapshots in the repository with their sizes and how many chunks they share with
    other snapshots (:func:`snapshot_usage`; for the console). forkyard's own endpoint."""
    repo = request.app.state.orchestrator.snapshots.repo
    return await asyncio.to_thread(snapshot_usage, repo)
