"""What a sandbox starts from: the rootfs templates built on this node (the registry)
and what an image's metadata says about the sandboxes made from it.

A template ``NAME`` is usable when ``<templates_dir>/NAME/rootfs`` exists and the build
wrote its completion marker. Template ids follow E2B's alias rules: lower-case letters,
digits, ``-`` and ``_``, at most 64 characters. Template builds
(:mod:`forkyard.templates`) write templates; the orchestrator resolves them on every
create, so the registry lives here, below both.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import Settings
from forkyard.ids import is_name
from forkyard.repository.snapshots import SnapshotMeta

MARKER = ".complete"
#: A rootfs template's settings (``{"diskSizeMB": N}``), next to its ``rootfs``.
SETTINGS_FILE = "template.json"
#: Smallest disk a template may ask for (MiB): room for ext4's own metadata and a
#: sandbox's first writes.
MIN_DISK_MB = 32


@dataclass(frozen=True)
class Template:
    """A built template: ``template_id``, its read-only ``rootfs`` directory and its
    sandboxes' disk size ``disk_mb`` (MiB; 0 = the node's ``FORKYARD_DISK_MB``)."""

    template_id: str
    rootfs: Path
    disk_mb: int = 0


def check_disk_mb(settings: Settings, value) -> int:
    """``value`` as a template's disk size in MiB, checked against this node's bounds
    (:data:`MIN_DISK_MB` … ``settings.max_disk_mb``).

    Raises:
        ValueError: not an integer in those bounds; the message is meant for the client
            (the API answers it as a 400).
    """
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_DISK_MB <= value <= settings.max_disk_mb:
        raise ValueError(f"diskSizeMB must be an integer between {MIN_DISK_MB} and {settings.max_disk_mb} MiB "
                         f"(this node's maximum, FORKYARD_MAX_DISK_MB), got {value!r}")
    return value


def write_settings(tdir: Path, disk_mb: int) -> None:
    """Record a rootfs template's disk size in ``tdir``/:data:`SETTINGS_FILE` (temp
    name, fsync, rename)."""
    tmp = tdir / f".{SETTINGS_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump({"diskSizeMB": disk_mb}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(tdir / SETTINGS_FILE)


def _disk_mb(tdir: Path) -> int:
    try:
        value = json.loads((tdir / SETTINGS_FILE).read_text()).get("diskSizeMB", 0)
    except (OSError, ValueError, AttributeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def _marker_ok(tdir: Path) -> bool:
    return (tdir / MARKER).exists()


def resolve(settings: Settings, template_id: str) -> Template | None:
    """Template named ``template_id`` (an optional ``:tag`` suffix is ignored), or None
    when it is not a valid name or not built here."""
    name = template_id.split(":", 1)[0]
    if not is_name(name):
        return None
    tdir = settings.templates_dir / name
    if not (tdir / "rootfs").is_dir() or not _marker_ok(tdir):
        return None
    return Template(name, tdir / "rootfs", _disk_mb(tdir))


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


def template_stamp(settings: Settings, template_id: str) -> int:
    """Build identity of rootfs template ``template_id``: its completion marker's
    mtime (ns), rewritten by every (re)build; 0 when unreadable."""
    try:
        return (settings.templates_dir / template_id / MARKER).stat().st_mtime_ns
    except OSError:
        return 0


# --------------------------------------------------------------------------- image metadata

#: Metadata keys recording a fork child's lineage.
PARENT_KEY = "forkyard.parentSandboxID"
SNAPSHOT_KEY = "forkyard.snapshotID"
#: Metadata keys a template build leaves on its snapshot (forkyard.templates.build).
DEFAULT_USER_KEY = "forkyard.defaultUser"
DEFAULT_WORKDIR_KEY = "forkyard.defaultWorkdir"
#: Metadata key a template build puts on its sandbox and so on the snapshot it commits
#: (named after the template): such a snapshot *is* the template, not a user snapshot.
TEMPLATE_KEY = "forkyard.template"


def is_template_build(meta: SnapshotMeta) -> bool:
    """True when ``meta`` is a built template's own snapshot (kept out of the snapshot
    API: deleting it would delete the template)."""
    name = meta.metadata.get(TEMPLATE_KEY)
    return bool(name) and name in meta.names


def guest_defaults(image: SnapshotMeta | None) -> tuple[str | None, str | None]:
    """``(default user, default workdir)`` of envd in sandboxes started from ``image``:
    its recorded source defaults, else a template build's metadata, else ``(None, None)``."""
    if image is None:
        return None, None
    return (image.default_user or image.metadata.get(DEFAULT_USER_KEY),
            image.default_workdir or image.metadata.get(DEFAULT_WORKDIR_KEY))
