"""What the committed snapshots hold: their sizes and the chunks they share (for
``GET /metrics/snapshots`` and the web console)."""

from __future__ import annotations

from forkyard.ids import rfc3339

#: Most snapshots :func:`snapshot_usage` describes (newest first).
MAX_SNAPSHOTS = 200


def snapshot_usage(repo, limit: int = MAX_SNAPSHOTS) -> list[dict]:
    """Committed snapshots of ``repo`` (a :class:`~forkyard.repository.repo.Repository`;
    every kind but transient ``fork`` images), newest first, at most ``limit``:
    ``{snapshotID, names, kind, sandboxID, templateID, parentImageID, sizeBytes (image
    bytes, uncompressed), chunks (distinct), sharedChunks (also used by another
    snapshot), createdAt (RFC 3339)}``. Reads every manifest (cached by the repository
    after the first read); blocking."""
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
            "createdAt": rfc3339(m.meta.get("created_at") or 0),
        })
    return out

