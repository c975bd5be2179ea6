"""The gVisor driver's image format: what it writes into an image directory and how it
reads one back.

A checkpoint image (:attr:`~forkyard.runtime.base.ImageKind.CHECKPOINT`) is what
``runsc checkpoint --image-path`` writes (``checkpoint.img``, ``pages*.img`` …) plus:

* :data:`BUILD_FILE` — the runsc build that wrote it (a restore on another build is
  refused: gVisor's checkpoint format is not stable across builds);
* :data:`~.spec.ROOTFS_TAR_MARKER` — the rootfs-tar annotation the sandbox was booted
  with (runsc refuses a restore whose annotations differ);
* the ``/tmp`` kind marker (:func:`~.spec.tmp_marker`): how ``/tmp`` was mounted, so a
  restore mounts it so again.

A filesystem-only image (:attr:`~forkyard.runtime.base.ImageKind.FILESYSTEM`) is one
file, :data:`ROOTFS_TAR`: the sandbox's overlay upper layer as ``runsc tar rootfs-upper``
writes it (whiteouts for deletions, opaque directories), written as ``<it>.tmp`` first.

Above the driver these are opaque files: the repository chunks them, the orchestrator
asks :func:`image_at` what a directory holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from forkyard.runtime.base import Image, ImageKind, RuntimeError_
from forkyard.runtime.gvisor import spec as ocispec

#: File in every checkpoint image naming the runtime build that wrote it.
BUILD_FILE = "forkyard-runtime.json"
#: The filesystem-only image of a sandbox: its overlay upper layer as a tar.
ROOTFS_TAR = "rootfs-upper.tar"


def image_at(path: Path) -> Image:
    """What image directory ``path`` holds: a filesystem-only image when it has
    :data:`ROOTFS_TAR` (or its temporary name: still being written), else a checkpoint
    (with the build its :data:`BUILD_FILE` records)."""
    path = Path(path)
    if (path / ROOTFS_TAR).exists() or (path / f"{ROOTFS_TAR}.tmp").exists():
        return Image(path, ImageKind.FILESYSTEM)
    return Image(path, ImageKind.CHECKPOINT, read_image_build(path))


def write_markers(image_dir: Path, bundle: Path) -> None:
    """Record in checkpoint ``image_dir`` how the sandbox of ``bundle`` was booted: its
    ``/tmp`` kind and its rootfs-tar annotation (empty file: none), which its restore
    must pass again."""
    marker = ocispec.tmp_marker(ocispec.bundle_tmp(bundle))
    if marker is not None:
        (image_dir / marker).write_text("1\n")
    rootfs_tar = ocispec.rootfs_tar_annotation(bundle)
    (image_dir / ocispec.ROOTFS_TAR_MARKER).write_text((rootfs_tar or "") + "\n")


def write_image_build(image_dir: Path, build: str) -> None:
    """Record ``build`` in checkpoint image ``image_dir`` (file :data:`BUILD_FILE`,
    JSON ``{"runtime": "gvisor", "build": ...}``); it travels with the image into the
    snapshot repository."""
    path = image_dir / BUILD_FILE
    path.write_text(json.dumps({"runtime": "gvisor", "build": build}))
    os.chmod(path, 0o600)


def image_rootfs_tar(image_dir: Path) -> str | None:
    """The :data:`~.spec.ROOTFS_TAR_ANNOTATION` value the checkpointed sandbox of
    ``image_dir`` was booted with (restore must pass the same), or None.

    Read from :data:`~.spec.ROOTFS_TAR_MARKER` (written by :func:`write_markers`),
    else — images from before the marker — from the metadata header of
    ``checkpoint.img``: ``gVisorSF``, 8 bytes of length, then JSON whose
    ``container_specs`` (a JSON string) maps container names to the OCI specs runsc
    compares at restore (the pinned runsc's format, not documented).
    """
    try:
        return (image_dir / ocispec.ROOTFS_TAR_MARKER).read_text().strip() or None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        with open(image_dir / "checkpoint.img", "rb") as f:
            head = f.read(1 << 20)
        if not head.startswith(b"gVisorSF"):
            return None
        text = head[head.index(b"{"):].decode("utf-8", "replace")
        meta, _ = json.JSONDecoder().raw_decode(text)
        for spec in json.loads(meta.get("container_specs") or "{}").values():
            value = (spec.get("annotations") or {}).get(ocispec.ROOTFS_TAR_ANNOTATION)
            if value:
                return str(value)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return None


def read_image_build(image_dir: Path) -> str | None:
    """The build recorded in ``image_dir``, or None for images written before builds
    were recorded (or with an unreadable record)."""
    try:
        return str(json.loads((image_dir / BUILD_FILE).read_text())["build"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def provide_tar(value: str) -> None:
    """Make sure the rootfs-tar annotation ``value`` of an image names a readable
    tar (see :meth:`.driver.GVisorDriver.create`): the placeholder is (re)created; an older image's
    per-image path must still exist. It is never recreated: it lies in the image
    cache or a staging directory, where an empty tar would pass for the real
    filesystem image of that snapshot (the cache adopts any directory there).

    Raises:
        RuntimeError_: an older image's path is gone, or the placeholder could not
            be created.
    """
    path = Path(value)
    try:
        if path == ocispec.ROOTFS_TAR_PLACEHOLDER:
            ocispec.ensure_empty_tar(path)
            return
    except OSError as e:
        raise RuntimeError_(f"cannot create {path}: {e}") from e
    if not path.is_file():
        raise RuntimeError_(
            f"this checkpoint was made (before forkyard recorded it otherwise) from a sandbox booted over "
            f"filesystem image {value}, which is gone; runsc restores it only with that file present")
