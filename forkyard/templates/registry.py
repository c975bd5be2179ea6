"""Lookup of built templates on this node.

A template ``NAME`` is usable when ``<templates_dir>/NAME/rootfs`` exists and the build
wrote its completion marker. Template ids follow E2B's alias rules: lower-case letters,
digits, ``-`` and ``_``, at most 64 characters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import Settings

_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
MARKER = ".complete"


@dataclass(frozen=True)
class Template:
    """A built template: ``template_id`` and its read-only ``rootfs`` directory."""

    template_id: str
    rootfs: Path


def _marker_ok(tdir: Path) -> bool:
    return (tdir / MARKER).exists()


def resolve(settings: Settings, template_id: str) -> Template | None:
    """Template named ``template_id`` (an optional ``:tag`` suffix is ignored), or None
    when it is not a valid name or not built here."""
    name = template_id.split(":", 1)[0]
    if not _NAME.match(name):
        return None
    tdir = settings.templates_dir / name
    if not (tdir / "rootfs").is_dir() or not _marker_ok(tdir):
        return None
    return Template(name, tdir / "rootfs")


def list_templates(settings: Settings) -> list[Template]:
    """Every built template on this node, sorted by id."""
    if not settings.templates_dir.is_dir():
        return []
    out = []
    for tdir in sorted(settings.templates_dir.iterdir()):
        t = resolve(settings, tdir.name)
        if t:
            out.append(t)
    return out
