"""Forking: running → forking → running (one ``checkpoint --leave-running`` of the
source), plus ``count`` children creating → running, each restored from that one image.

On one node the image stays staged (never committed: nothing needs it once the children
run). In a cluster whose children do not all fit on the source's node it is committed
as a ``fork`` image, and other nodes start their share from it (:meth:`Forker.fork_export`,
:meth:`Forker.fork_children`).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.ids import new_sandbox_id
from forkyard.obs import metrics
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound
from forkyard.orchestrator.expiry import check_timeout
from forkyard.orchestrator.holds import hold
from forkyard.orchestrator.images import PARENT_KEY, SNAPSHOT_KEY, guest_defaults
from forkyard.orchestrator.staging import Stager, meta_for
from forkyard.orchestrator.start import Starter
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore, new_snapshot_id

#: E2B fork limits (``POST /sandboxes/{id}/fork``): count 1…100 (default 1), timeout default 15 s.
MAX_FORKS = 100
FORK_DEFAULT_TIMEOUT_S = 15


@dataclass(eq=False, repr=False)
class Forker:
    """Forks sandboxes.

    Args:
        settings: ``fork_parallelism`` (restores at once), ``default_disk_mb``.
        table: the sandboxes.
        snapshots: staging and the repository.
        stager: takes and commits the one checkpoint.
        starter: restores each child.
        admit: ``admit(vcpus, memory_mb, count)``: admission of the children (raises
            ``AtCapacity``) before anything is checkpointed.
    """

    settings: Settings
    table: SandboxTable
    snapshots: SnapshotStore
    stager: Stager
    starter: Starter
    admit: Callable[[int, int, int], None]

    @metrics.timed("fork")
    async def fork(self, sandbox_id: str, count: int = 1, timeout_s: int | None = None) -> list[SandboxRecord | Exception]:
        """Checkpoint the running source once (it keeps running, id and expiry
        unchanged) and restore ``count`` children in parallel.

        Each child gets a new id, the source's memory, processes, files, env and
        resources, a new envd token, expiry now + ``timeout_s`` (default 15 s, E2B's),
        and lineage in its metadata (:data:`PARENT_KEY`, :data:`SNAPSHOT_KEY`).

        Returns:
            One entry per child, in order: its record, or the exception that stopped it.

        Raises:
            BadRequest: count outside 1…100 or bad timeout.
            NotFound / Conflict: unknown or not running source.
            CreateFailed: the checkpoint failed (the source keeps running).
        """
        if not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 1 and {MAX_FORKS}")
        timeout_s = check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        src = self.table.get(sandbox_id)
        self.admit(src.vcpus, src.memory_mb, count)  # before the checkpoint
        src, image, staging = await self._fork_stage(sandbox_id)
        # Children restore straight from the staged image: a fork image is never needed
        # after its children run, so it is not committed to the repository.
        try:
            await hold("fork.staged", sandbox_id)
            return await self._spawn_children(image, count, timeout_s, src.auto_pause, staging / "image",
                                              egress=src.egress, volume_mounts=src.volume_mounts)
        finally:
            self.snapshots.discard(staging)

    @metrics.timed("fork_export")
    async def fork_export(self, sandbox_id: str, count: int, timeout_s: int | None = None
                          ) -> tuple[list[SandboxRecord | Exception], str]:
        """:meth:`fork` for a cluster whose children do not all fit on this node: the
        one checkpoint is committed to the shared repository as a ``fork`` image, then
        ``count`` (0…100) children start here from it; other nodes start the rest with
        :meth:`fork_children`. Returns ``(children, fork image id)``; the caller deletes
        the image (``Orchestrator.delete_image``) once every node's children run.

        Raises:
            as :meth:`fork`; RepositoryError when the commit fails (source keeps running).
        """
        if not isinstance(count, int) or not 0 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 0 and {MAX_FORKS}")
        timeout_s = check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        src = self.table.get(sandbox_id)
        if src.volume_mounts:
            raise Conflict(f"sandbox {sandbox_id} mounts volumes, which are mounted on one node at a time: its "
                           "fork children run on its node only (the scheduler places them there)")
        self.admit(src.vcpus, src.memory_mb, count)
        src, image, staging = await self._fork_stage(sandbox_id)
        image = await self.stager.commit(staging, image)
        return (await self._spawn_children(image, count, timeout_s, src.auto_pause, None, egress=src.egress),
                image.snapshot_id)

    @metrics.timed("fork_children")
    async def fork_children(self, image_id: str, count: int, timeout_s: int | None = None,
                            auto_pause: bool = True, egress: dict | None = None) -> list[SandboxRecord | Exception]:
        """Start ``count`` fork children on this node from a ``fork`` image another
        node exported (:meth:`fork_export`); each child is as a :meth:`fork` child of
        the image's source (memory, files, env, lineage), with ``auto_pause`` and the
        ``egress`` policy as the source's.

        Raises:
            BadRequest: count outside 1…100, bad timeout, or not a fork image.
            NotFound: no such image in the repository.
        """
        if not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 1 and {MAX_FORKS}")
        timeout_s = check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        image = await asyncio.to_thread(self.snapshots.get, image_id)
        if image is None:
            raise NotFound(f"fork image {image_id!r} not found")
        if image.kind != "fork":
            raise BadRequest(f"{image_id!r} is a {image.kind} image, not a fork image")
        self.admit(image.vcpus, image.memory_mb, count)
        return await self._spawn_children(image, count, timeout_s, auto_pause, None, egress=egress)

    async def _fork_stage(self, sandbox_id: str) -> tuple[SandboxRecord, SnapshotMeta, Path]:
        """Checkpoint the running source (``--leave-running``) under its lock; returns
        ``(source, fork image meta, staging dir)``."""
        table = self.table
        async with table.locks[sandbox_id]:
            src = table.running(sandbox_id)
            src.state = "forking"
            table.store.put(src)
            sid = new_snapshot_id()
            try:
                staging = await self.stager.stage(src, sid, fork=True)
            finally:
                src.state = "running"
                table.store.put(src)
        return src, meta_for(src, "fork", sid), staging

    async def _spawn_children(self, image: SnapshotMeta, count: int, timeout_s: int, auto_pause: bool,
                              image_dir: Path | None, egress: dict | None = None,
                              volume_mounts: list[dict] | None = None) -> list[SandboxRecord | Exception]:
        """Restore ``count`` children of ``image`` in parallel (``settings.fork_parallelism``)
        from ``image_dir`` (staged) or, when None, from the repository / node cache;
        each gets ``egress`` (the source's policy on a local fork) and ``volume_mounts``
        (the source's: the same volumes, shared with it, as on E2B; the restore needs them).
        Records ``children`` and the slowest child's ``slot``/``runtime``/``envd`` (ms)."""
        now = time.time()
        kids = []
        for _ in range(count):
            kid = SandboxRecord(
                id=new_sandbox_id(), template_id=image.template_id, state="creating", slot=None,
                vcpus=image.vcpus, memory_mb=image.memory_mb, started_at=now, end_at=now + timeout_s,
                auto_pause=auto_pause,
                metadata={**image.metadata, PARENT_KEY: image.source_sandbox_id, SNAPSHOT_KEY: image.snapshot_id},
                env_vars=dict(image.env_vars), image_id=None, timeout_s=timeout_s,
                disk_mb=image.disk_mb or self.settings.default_disk_mb,
                envd_access_token=secrets.token_urlsafe(24) if image.envd_access_token else None,
                egress=dict(egress or {}), volume_mounts=[dict(m) for m in volume_mounts or []],
            )
            kid.default_user, kid.default_workdir = guest_defaults(image)
            self.table.store.put(kid)
            kids.append(kid)
        await hold("fork.children-recorded", image.source_sandbox_id)
        sem = asyncio.Semaphore(self.settings.fork_parallelism)
        child_phases: list[dict[str, float]] = []

        async def one(kid: SandboxRecord) -> SandboxRecord | Exception:
            async with sem:
                phases: dict[str, float] = {}
                child_phases.append(phases)
                try:
                    await hold("fork.child-start", kid.id)
                    await self.starter.start(kid, image, image.envd_access_token, image_dir=image_dir, phases=phases)
                except Exception as e:  # noqa: BLE001 — reported per child
                    self.table.store.delete(kid.id)
                    return e
                return kid

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(k) for k in kids))
        timing.record("children", (time.perf_counter() - t0) * 1000)
        for name in ("slot", "runtime", "envd"):  # slowest child's phase
            timing.record(f"{name}-max", max((p.get(name, 0.0) for p in child_phases), default=0.0))
        return list(results)
