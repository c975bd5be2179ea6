"""Admission: a node starts a sandbox only within its capacity (issue 11, item 4).

Each sandbox's memory limit and vCPU quota are enforced by its cgroup; admission keeps
their sum within what the host has, so one more sandbox cannot degrade (or OOM) all of
them. Counted: every sandbox that holds resources now — all states but ``paused``
(``creating``, ``resuming`` and ``forking`` included, so parallel creates are counted as
soon as their row exists).

Capacity (environment):

* memory: ``MemTotal`` of the host − ``FORKYARD_RESERVED_MEMORY_MB`` (1024) for the
  host and forkyard, × ``FORKYARD_MEMORY_OVERCOMMIT`` (1.0: a sandbox's limit is memory
  it may really use);
* memory in use, when limits are overcommitted (``FORKYARD_MEMORY_OVERCOMMIT`` > 1): the
  memory the sandboxes really hold that the host cannot take back (the runtime's
  :meth:`~forkyard.runtime.base.RuntimeDriver.memory_in_use`: anonymous and shared-memory
  pages of each sandbox's cgroup; page cache such as the images restored sandboxes share
  is evictable and not counted), each counted at least ``FORKYARD_SANDBOX_HOST_MB``, plus
  that much per new sandbox, must stay within host memory − reserve (not overcommitted).
  So an overcommitted node admits by what sandboxes use — fork children share their
  source's pages (docs/runtime.md "Memory") and idle sandboxes use a fraction of their
  limit — and answers 503 once their use fills the host, before the host has to
  OOM-kill one of them;
* vCPUs: host cores × ``FORKYARD_CPU_OVERCOMMIT`` — off unless set (CPU is time-shared
  and each sandbox is capped by its own quota; E2B overcommits CPU too);
* count: ``FORKYARD_MAX_SANDBOXES``, default :data:`SANDBOXES_PER_CORE` × host cores
  (``0``: no count limit). Idle sandboxes are not free of CPU (measured ~0.13 % of a
  core each at N=400, bench/bench_density.py): on 2 cores ``commands.run`` stayed within
  1.5× of its N=1 latency to about N=250 and doubled at N=400, so the default stops an
  overcommitted node there instead of letting every sandbox slow down.
* the host itself: a start is refused while the host's ``MemAvailable`` would fall under
  ``FORKYARD_MIN_AVAILABLE_MEMORY_PCT`` (10) % of ``MemTotal`` once the new sandboxes
  took ``FORKYARD_SANDBOX_HOST_MB`` (64) MiB each — what an idle sandbox costs the host
  (bench/bench_density.py, docs/runtime.md). This holds also when memory limits are
  overcommitted, so an overcommitted node answers 503 before the host degrades.

The warm pool's sandboxes hold capacity too but never take it from users: user starts are
admitted against user sandboxes, then pooled sandboxes that no longer fit are dropped
(``Creator.admit``); the pool refills only into room left over
(:mod:`forkyard.orchestrator.pool`).

A start beyond capacity is refused with :class:`AtCapacity` (503, with what is used and
what is left), before anything is created.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from forkyard.config import AdmissionSettings
from forkyard.orchestrator.errors import OrchestratorError


#: Default count limit per host core (see the module doc; docs/runtime.md "Density").
SANDBOXES_PER_CORE = 125


class AtCapacity(OrchestratorError):
    """The node has no room for the sandbox(es) asked for (503); retry later or
    elsewhere."""

    status = 503


def _host_available_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) // 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def _host_memory_mb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    raise OSError("no MemTotal in /proc/meminfo")


@dataclass
class Capacity:
    """What a node may hand out: ``memory_mb`` (MiB of memory limits), ``vcpus`` (None:
    unlimited), ``max_sandboxes`` (None: unlimited); ``min_available_pct`` (% of host
    memory that must stay available, 0: off) and ``sandbox_host_mb`` (host MiB a new
    sandbox is counted to take from it); ``overcommit`` (the ratio ``memory_mb`` was
    multiplied by) and ``host_memory_mb`` (MiB the sandboxes may really use; None: no
    use check) with ``memory_in_use`` (``ids -> {id: bytes}``, the runtime's measure,
    set by the orchestrator) for the use check of an overcommitted node."""

    memory_mb: int
    vcpus: float | None
    max_sandboxes: int | None
    min_available_pct: float = 0.0
    sandbox_host_mb: int = 64
    overcommit: float = 1.0
    host_memory_mb: int | None = None
    memory_in_use: Callable[[list[str]], dict[str, int]] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_env(cls) -> "Capacity":
        """Capacity of this host from the environment (see the module doc)."""
        env = AdmissionSettings()
        overcommit = env.memory_overcommit
        if not overcommit > 0:
            raise ValueError(f"FORKYARD_MEMORY_OVERCOMMIT must be a ratio > 0, not {overcommit}")
        host = max(0, _host_memory_mb() - env.reserved_memory_mb)
        mem = int(host * overcommit)
        cores = os.cpu_count() or 1
        count_limit = SANDBOXES_PER_CORE * cores if env.max_sandboxes is None else env.max_sandboxes
        return cls(memory_mb=max(0, mem), vcpus=cores * env.cpu_overcommit if env.cpu_overcommit else None,
                   max_sandboxes=count_limit or None,
                   min_available_pct=env.min_available_memory_pct,
                   sandbox_host_mb=env.sandbox_host_mb,
                   overcommit=overcommit, host_memory_mb=host)

    def in_use_mb(self, live, held: list[tuple[int, int]] = ()) -> int | None:
        """MiB the sandboxes of ``live`` (records; paused ones hold nothing) and ``held``
        (the warm pool's) are counted to use: each one's :attr:`memory_in_use`, at
        least :attr:`sandbox_host_mb` (a sandbox still starting has not allocated yet);
        None without a :attr:`memory_in_use` measure."""
        if self.memory_in_use is None:
            return None
        ids = [r.id for r in live if r.state != "paused"]
        measured = self.memory_in_use(ids)
        floor = self.sandbox_host_mb
        return sum(max(measured.get(i, 0) >> 20, floor) for i in ids) + len(held) * floor

    def check(self, live, vcpus: int, memory_mb: int, count: int = 1,
              held: list[tuple[int, int]] = ()) -> None:
        """Raise :class:`AtCapacity` unless ``count`` more sandboxes of ``vcpus`` /
        ``memory_mb`` fit beside ``live`` (records; paused ones hold nothing) and
        ``held`` (``(vcpus, memory_mb)`` of other holders: the warm pool's sandboxes)."""
        holding = [(r.vcpus, r.memory_mb) for r in live if r.state != "paused"] + list(held)
        used_mem = sum(m for _, m in holding)
        used_cpu = sum(c for c, _ in holding)
        what = f"{count} sandbox(es) of {vcpus} vCPU / {memory_mb} MiB"
        if self.max_sandboxes is not None and len(holding) + count > self.max_sandboxes:
            raise AtCapacity(f"node at capacity: {len(holding)} of {self.max_sandboxes} sandboxes in use, "
                             f"no room for {what}; retry later")
        if used_mem + count * memory_mb > self.memory_mb:
            raise AtCapacity(f"node at capacity: {used_mem} of {self.memory_mb} MiB of sandbox memory in use, "
                             f"no room for {what}; retry later")
        if self.overcommit > 1 and self.host_memory_mb is not None:
            in_use = self.in_use_mb(live, held)
            if in_use is not None and in_use + count * self.sandbox_host_mb > self.host_memory_mb:
                raise AtCapacity(f"node at capacity: sandboxes use {in_use} of {self.host_memory_mb} MiB of host "
                                 f"memory (limits overcommitted {self.overcommit:g}x), no room for {what}; "
                                 f"retry later")
        if self.vcpus is not None and used_cpu + count * vcpus > self.vcpus:
            raise AtCapacity(f"node at capacity: {used_cpu} of {self.vcpus:g} vCPUs in use, "
                             f"no room for {what}; retry later")
        if self.min_available_pct > 0:
            avail, total = _host_available_mb(), _host_memory_mb()
            floor = total * self.min_available_pct / 100
            if avail - count * self.sandbox_host_mb < floor:
                raise AtCapacity(f"node at capacity: host memory low ({avail} MiB available, "
                                 f"{self.min_available_pct:g}% of {total} MiB must stay free), "
                                 f"no room for {what}; retry later")

    def as_dict(self) -> dict:
        """For ``GET /metrics/node``."""
        return {"memoryMB": self.memory_mb, "vcpus": self.vcpus, "maxSandboxes": self.max_sandboxes,
                "minAvailableMemoryPct": self.min_available_pct, "sandboxHostMB": self.sandbox_host_mb,
                "memoryOvercommit": self.overcommit, "hostMemoryMB": self.host_memory_mb}

    def fits(self, live, vcpus: int, memory_mb: int, count: int = 1, held: list[tuple[int, int]] = ()) -> bool:
        """True when :meth:`check` with the same arguments would not raise."""
        try:
            self.check(live, vcpus, memory_mb, count, held)
        except AtCapacity:
            return False
        return True
