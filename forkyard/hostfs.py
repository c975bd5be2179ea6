"""Host filesystem plumbing shared by the runtime's sandbox disks and the node's volumes:
whether a path is a mount point, and running a host tool (``mkfs.ext4``, ``mount``)
that must succeed."""

from __future__ import annotations

import subprocess
from pathlib import Path


def is_mounted(path: Path) -> bool:
    """Whether ``path`` is a mount point in this mount namespace (``/proc/self/mounts``)."""
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def run_checked(argv: list[str], error: type[Exception]) -> None:
    """Run ``argv``; raise ``error("<tool> <arg> failed (<rc>): <stderr>")`` when it exits
    non-zero."""
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise error(f"{' '.join(argv[:2])} failed ({proc.returncode}): {proc.stderr.strip()}")


def unmount(path: Path) -> None:
    """``umount path``, else a lazy ``umount -l`` (busy: detached now, freed when its last
    user lets go). Never raises."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
