"""A sandbox's disk: the size-limited host filesystem holding its writable layer.

gVisor keeps every write of a sandbox in its rootfs overlay, whose upper layer lives in
a "filestore" file under ``--overlay2=root:dir=<workdir>/overlay`` (a deleted file:
``du`` cannot see it). Left on the host's filesystem, one sandbox could fill the host
and break the database and the repository for everyone (measured: 2 GiB in 1.3 s).
So ``<workdir>/overlay`` is a mount of its own: a sparse file ``<workdir>/disk.img`` of
the sandbox's disk size, formatted ext4 and loop-mounted. Writes beyond it fail inside
the sandbox with ENOSPC; the host loses at most the disk size. Costs ~30 ms per start
(truncate + mkfs + mount, measured); the file only takes the blocks really written.

A checkpoint carries the filestore's contents (it is part of the sandbox's state), so
pause/resume and fork work unchanged: each restore gets a fresh disk.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

log = logging.getLogger("forkyard.runtime.disk")

IMAGE_NAME = "disk.img"


class DiskError(Exception):
    """The disk could not be made or mounted (message names the step)."""


def _run(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise DiskError(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.strip()}")


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this mount namespace."""
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def attach(workdir: Path, overlay_dir: Path, size_mb: int) -> None:
    """Make ``overlay_dir`` a ``size_mb`` MiB ext4 filesystem backed by a sparse
    ``<workdir>/disk.img`` (idempotent: an existing mount is kept).

    Raises:
        DiskError: truncate, mkfs or mount failed (nothing is left mounted).
    """
    overlay_dir.mkdir(parents=True, exist_ok=True)
    if is_mounted(overlay_dir):
        return
    image = workdir / IMAGE_NAME
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, size_mb << 20)
    finally:
        os.close(fd)
    # No journal and no reserved blocks: a scratch layer, discarded with the sandbox.
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard",
          str(image)])
    _run(["mount", "-o", "loop,nosuid,nodev,noexec", str(image), str(overlay_dir)])
    os.chmod(overlay_dir, 0o700)


def detach(workdir: Path, overlay_dir: Path) -> None:
    """Unmount ``overlay_dir`` (lazily when busy; the loop device is freed with the last
    user) and delete the disk image. Never raises."""
    try:
        if is_mounted(overlay_dir):
            if subprocess.run(["umount", str(overlay_dir)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(overlay_dir)], capture_output=True)
    except OSError as e:
        log.warning("unmounting %s failed: %s", overlay_dir, e)
    try:
        (workdir / IMAGE_NAME).unlink(missing_ok=True)
    except OSError as e:
        log.warning("removing %s failed: %s", workdir / IMAGE_NAME, e)


def usage(overlay_dir: Path) -> tuple[int, int] | None:
    """``(used bytes, total bytes)`` of a sandbox's disk, None when it has none."""
    if not is_mounted(overlay_dir):
        return None
    st = os.statvfs(overlay_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize
