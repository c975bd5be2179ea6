"""The host's cgroups of a gVisor sandbox (``/forkyard/<id>``, made by runsc with the
spec's memory limit and CPU quota): what they say about CPU use and OOM kills, and their
removal after a failed start.
"""

from __future__ import annotations

import os
from pathlib import Path

from forkyard.runtime.base import RuntimeUsage
from forkyard.runtime.gvisor import spec as ocispec


def remove_cgroups(sandbox_id: str) -> None:
    """Remove the sandbox's (empty) cgroup directories. runsc removes them on delete,
    but not after a failed ``run`` (measured: a bad netns left all nine v1 dirs)."""
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    root = Path("/sys/fs/cgroup")
    for path in [root / rel, *root.glob(f"*/{rel}")]:
        try:
            path.rmdir()
        except OSError:
            pass  # absent, or still has processes/children


_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_usage(sandbox_id: str, root: Path = _CGROUP_ROOT) -> RuntimeUsage | None:
    """CPU time and CPU limit of the sandbox's cgroup, or None when it has none.

    cgroup v1 (runsc's choice on hybrid hosts): ``cpuacct/<path>/cpuacct.usage`` (ns)
    and ``cpu/<path>/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; cgroup v2:
    ``<path>/cpu.stat`` ``usage_usec`` and ``cpu.max`` (kernel docs, cgroup-v1/cpuacct
    and cgroup-v2 "CPU"). No quota (``-1`` / ``max``) reads as the host's CPU count.
    gVisor's in-sandbox ``/proc/stat`` is all zeros (measured), hence the host side.
    """
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "cpuacct" / rel / "cpuacct.usage"
        if v1.exists():
            ns = int(v1.read_text())
            quota = int((root / "cpu" / rel / "cpu.cfs_quota_us").read_text())
            period = int((root / "cpu" / rel / "cpu.cfs_period_us").read_text())
        else:
            v2 = root / rel / "cpu.stat"
            if not v2.exists():
                return None
            stat = dict(line.split() for line in v2.read_text().splitlines() if line.strip())
            ns = int(stat["usage_usec"]) * 1000
            q, _, p = (root / rel / "cpu.max").read_text().strip().partition(" ")
            quota, period = (-1 if q == "max" else int(q)), int(p or 100000)
    except (OSError, ValueError, KeyError):
        return None  # the sandbox went away between the reads
    limit = quota / period if quota > 0 and period > 0 else float(os.cpu_count() or 1)
    return RuntimeUsage(cpu_ns=ns, cpu_limit=limit)


def cgroup_memory_in_use(sandbox_id: str, root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes of the sandbox's memory cgroup that the host cannot reclaim, or None when
    it has no memory cgroup: anonymous + shmem pages — cgroup v1 ``memory.stat``
    ``total_rss`` + ``total_shmem``, v2 ``anon`` + ``shmem`` (kernel docs cgroup-v1/memory,
    cgroup-v2 "memory.stat"). Under gVisor the sandbox's memory is the sentry's memory
    file, a memfd (shmem), plus the sentry's own heap (anon); pages shared from a
    checkpoint's pages file (runsc patch 0020, docs/runtime.md "Memory") are page cache,
    which the host can evict and read back, so they are not counted."""
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "memory" / rel / "memory.stat"
        if v1.exists():
            keys, path = ("total_rss", "total_shmem"), v1
        elif (root / rel / "memory.stat").exists():
            keys, path = ("anon", "shmem"), root / rel / "memory.stat"
        else:
            return None
        stat = dict(line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
        return sum(int(stat.get(k, 0)) for k in keys)
    except (OSError, ValueError):
        return None


def cgroup_oom(sandbox_id: str, root: Path = _CGROUP_ROOT) -> tuple[int, int] | None:
    """``(oom kills, memory limit in bytes)`` of the sandbox's cgroup, or None when it
    has no memory cgroup (gone, or never made).

    cgroup v1: ``memory/<path>/memory.oom_control`` line ``oom_kill N`` (kernel ≥ 4.13)
    and ``memory.limit_in_bytes``; cgroup v2: ``<path>/memory.events`` ``oom_kill N``
    and ``memory.max`` (kernel docs, cgroup-v1/memory and cgroup-v2 "Memory"). Under
    gVisor the host's OOM killer acts on this cgroup and kills the sentry, i.e. the
    whole sandbox (measured: tests/test_runtime.py), so a count above 0 on a sandbox
    whose runtime stopped says why it stopped. A limit of ``max`` reads as 0.
    """
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "memory" / rel
        if (v1 / "memory.oom_control").exists():
            events, limit_file = v1 / "memory.oom_control", v1 / "memory.limit_in_bytes"
        elif (root / rel / "memory.events").exists():
            events, limit_file = root / rel / "memory.events", root / rel / "memory.max"
        else:
            return None
        fields = dict(line.split()[:2] for line in events.read_text().splitlines() if len(line.split()) >= 2)
        raw = limit_file.read_text().strip()
        return int(fields.get("oom_kill", 0)), (0 if raw == "max" else int(raw))
    except (OSError, ValueError):
        return None
