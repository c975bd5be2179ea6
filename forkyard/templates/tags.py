"""Template tags as E2B defines them: a tag names one build of a template
(``name:tag``; no tag means ``default``). A build is given the tags it was requested
with (``POST /v3/templates`` ``name: "n:t"`` and/or ``tags``; none: ``default``) when it
succeeds; ``POST /templates/tags`` points more tags at the build a ``name:tag`` names,
``DELETE /templates/tags`` removes tags (never ``default``), ``GET
/templates/{id}/tags`` lists them. Tags are normalized as E2B's ``id`` package does
(trimmed, lower-case, ``[a-z0-9._-]+``, not a UUID).

One JSON file per template, ``<data_dir>/template-tags/<name>.json`` (``{tag: {"buildID",
"createdAt"}}``), written to a temp name, fsynced and renamed.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path

from forkyard.ids import is_name
from forkyard.orchestrator.errors import BadRequest

DEFAULT_TAG = "default"
_TAG = re.compile(r"^[a-z0-9._-]{1,128}$")


def normalize(tags) -> list[str]:
    """``tags`` trimmed, lower-cased and deduplicated (order kept), as E2B's
    ``ValidateAndDeduplicateTags``.

    Raises:
        BadRequest: not a list of strings, or a tag outside ``[a-z0-9._-]`` / a UUID.
    """
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise BadRequest("tags must be a list of strings")
    out: list[str] = []
    for t in tags:
        c = t.strip().lower()
        if not _TAG.match(c):
            raise BadRequest(f"invalid tag {t!r}: 1-128 of a-z, 0-9, '.', '_', '-'")
        try:
            uuid.UUID(c)
            raise BadRequest(f"invalid tag {t!r}: a tag cannot be a UUID")
        except ValueError:
            pass
        if c not in out:
            out.append(c)
    return out


class TagStore:
    """The tags of every built template on this node.

    Args:
        root: directory of the per-template files (created).
    """

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        if not is_name(name):
            raise BadRequest(f"invalid template name {name!r}")
        return self.root / f"{name}.json"

    def of(self, name: str) -> dict[str, dict]:
        """``{tag: {"buildID", "createdAt" (epoch s)}}`` of template ``name`` ({} if none)."""
        try:
            data = json.loads(self._path(name).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _write(self, name: str, data: dict) -> None:
        path = self._path(name)
        if not data:
            path.unlink(missing_ok=True)
            return
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def build_of(self, name: str, tag: str | None) -> str | None:
        """The build ``name:tag`` names (``tag`` None: ``default``), or None."""
        entry = self.of(name).get((tag or DEFAULT_TAG).strip().lower())
        return entry.get("buildID") if isinstance(entry, dict) else None

    def assign(self, name: str, build_id: str, tags: list[str]) -> None:
        """Point ``tags`` (normalized) of ``name`` at ``build_id`` (moving them from
        whatever build they named)."""
        data = self.of(name)
        now = time.time()
        for t in tags:
            data[t] = {"buildID": build_id, "createdAt": now}
        self._write(name, data)

    def remove(self, name: str, tags: list[str]) -> None:
        """Remove ``tags`` (normalized) of ``name``; absent ones are ignored (as E2B).

        Raises:
            BadRequest: ``default`` is among them.
        """
        if DEFAULT_TAG in tags:
            raise BadRequest(f"Cannot delete the '{DEFAULT_TAG}' tag")
        data = self.of(name)
        for t in tags:
            data.pop(t, None)
        self._write(name, data)

    def builds_tagged(self, name: str) -> set[str]:
        """Build ids some tag of ``name`` names."""
        return {e.get("buildID") for e in self.of(name).values() if isinstance(e, dict)}

    def drop(self, name: str) -> None:
        """Forget every tag of ``name`` (the template is deleted)."""
        self._path(name).unlink(missing_ok=True)
