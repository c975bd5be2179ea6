"""Making images of a running sandbox: a checkpoint or a filesystem-only export into a
fresh staging directory, then a commit to the repository.

Commit of every image goes through :class:`~forkyard.repository.snapshots.SnapshotStore`
(staging → fsync → rename), so a crash never leaves a half-written snapshot visible.
Pause, snapshot, fork and restart reconciliation all make their images here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.obs import metrics
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import Conflict, CreateFailed
from forkyard.orchestrator.images import SNAPSHOT_KEY
from forkyard.orchestrator.store import SandboxRecord
from forkyard.repository.errors import RepositoryError
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore
from forkyard.runtime.base import ExportTooLarge, ImageKind, RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")

#: File in a pause's staging directory: the checkpoint finished, the image is complete.
PAUSE_MARKER = "checkpointed"


class FsImageTooLarge(Conflict):
    """A filesystem-only pause/snapshot was refused: its image would be too large to
    resume (409); the sandbox keeps running."""


def meta_for(rec: SandboxRecord, kind: str, snapshot_id: str,
             names: list[str] | None = None, memory: bool = True) -> SnapshotMeta:
    """The :class:`SnapshotMeta` an image of ``rec`` is committed under (``memory``
    False: a filesystem-only image)."""
    return SnapshotMeta(
        snapshot_id=snapshot_id, kind=kind, template_id=rec.template_id, source_sandbox_id=rec.id,
        vcpus=rec.vcpus, memory_mb=rec.memory_mb, env_vars=dict(rec.env_vars),
        metadata=dict(rec.metadata), names=list(names or []),
        envd_access_token=rec.envd_access_token, parent_image_id=rec.metadata.get(SNAPSHOT_KEY),
        memory=memory, default_user=rec.default_user, default_workdir=rec.default_workdir,
        disk_mb=rec.disk_mb,
    )


@dataclass(eq=False, repr=False)
class Stager:
    """Stages images of running sandboxes and commits them.

    Args:
        settings: ``fs_image_memory_fraction`` (bound of a filesystem-only image).
        driver: checkpoints, freezes/thaws and exports sandboxes.
        snapshots: staging directories and the repository.
    """

    settings: Settings
    driver: RuntimeDriver
    snapshots: SnapshotStore

    def staged_memory(self, staging: Path) -> bool:
        """Whether the image staged under ``staging`` (in ``<it>/image``, possibly still
        being written) is a checkpoint (True) or a filesystem-only image (False); the
        driver reads it from its files (:meth:`RuntimeDriver.image_at`)."""
        return self.driver.image_at(staging / "image").kind is ImageKind.CHECKPOINT

    async def stage(self, rec: SandboxRecord, snapshot_id: str, stop: bool = False, fork: bool = False) -> Path:
        """``runsc checkpoint`` of ``rec`` into a fresh staging directory (image in
        ``<it>/image``): ``--leave-running`` unless ``stop`` (pause: the sandbox stops
        once the image is complete; the stopped runtime is left for the teardown).
        ``fork``: the image is a fork's (the driver may share its pages with ``rec``).
        Records the ``checkpoint`` phase (ms) for ``Server-Timing`` — the time the
        sentry holds the sandbox's tasks stopped.

        Raises:
            CreateFailed: staging or runsc failed; the staging directory is removed.
        """
        t0 = time.perf_counter()
        try:
            staging = self.snapshots.staging(snapshot_id)
            await self.driver.checkpoint(rec.id, staging / "image", leave_running=not stop, keep_stopped=stop,
                                         fork=fork)
        except BaseException as e:
            self.snapshots.discard(self.snapshots.staging_path(snapshot_id))
            if isinstance(e, Exception):
                raise CreateFailed(f"checkpoint of sandbox {rec.id} failed: {e}") from e
            raise
        timing.record("checkpoint", (time.perf_counter() - t0) * 1000)
        return staging

    def fs_image_limit(self, rec: SandboxRecord) -> int:
        """Largest filesystem-only image of ``rec`` (bytes) that a cold boot can lay back:
        ``settings.fs_image_memory_fraction`` of its memory (runsc lays the tar back
        inside the sandbox's memory limit; measured at 512 MiB: 100 MiB resumed, 150 MiB
        was OOM-killed at boot), and at most 90 % of its disk (sparse files come back
        fully allocated)."""
        limit = int(rec.memory_mb * self.settings.fs_image_memory_fraction) << 20
        if rec.disk_mb:
            limit = min(limit, (rec.disk_mb * 9 // 10) << 20)
        return max(limit, 1 << 20)

    @staticmethod
    def _too_large(rec: SandboxRecord, limit: int, size: int, detail: str) -> str:
        return (f"filesystem-only pause needs the changed files ({detail}; sparse files count at their full "
                f"size) to fit in {limit >> 20} MiB (part of the sandbox's {rec.memory_mb} MiB memory: resume "
                "lays them back inside it); pause with memory instead (the sandbox keeps running)")

    async def stage_fs(self, rec: SandboxRecord, snapshot_id: str, thaw: bool) -> Path:
        """Filesystem-only image of ``rec`` into a fresh staging directory (``<it>/image``,
        :meth:`RuntimeDriver.export_filesystem`): the sandbox is frozen, its writable layer
        exported, and — when ``thaw`` (snapshot) — continued; a pause leaves it frozen
        for the teardown. Records ``scan`` (the look for files too large, see
        :meth:`fs_image_limit`), ``freeze`` and ``export`` (ms) for ``Server-Timing``.

        Raises:
            FsImageTooLarge: the image would exceed :meth:`fs_image_limit` (409); the
                sandbox runs on (thawed), nothing is kept.
            CreateFailed: the runtime failed; the staging directory is removed and the
                sandbox runs on (thawed).
        """
        limit = self.fs_image_limit(rec)
        # One file above the bound: the export itself reads it whole into the sandbox's
        # memory (a 1 GiB sparse file got the sandbox OOM-killed), so refuse first.
        t_scan = time.perf_counter()
        big = await self.driver.large_changed_files(rec.id, limit)
        timing.record("scan", (time.perf_counter() - t_scan) * 1000)
        if big:
            name, size = max(big, key=lambda b: b[1])
            raise FsImageTooLarge(self._too_large(rec, limit, size, f"{name} alone is {size >> 20} MiB"))
        t0 = time.perf_counter()
        frozen = False
        try:
            staging = self.snapshots.staging(snapshot_id)
            await self.driver.freeze(rec.id)  # a consistent cut: nothing writes meanwhile
            frozen = True
            t1 = time.perf_counter()
            timing.record("freeze", (t1 - t0) * 1000)
            size = await self.driver.export_filesystem(rec.id, staging / "image", max_bytes=limit)
            timing.record("export", (time.perf_counter() - t1) * 1000)
            metrics.FS_IMAGE_BYTES.observe(size)
        except BaseException as e:
            self.snapshots.discard(self.snapshots.staging_path(snapshot_id))
            if frozen:
                await self.thaw_quietly(rec.id)
            if isinstance(e, ExportTooLarge):
                raise FsImageTooLarge(self._too_large(rec, limit, e.size, f"over {e.size >> 20} MiB")) from e
            if isinstance(e, Exception):
                raise CreateFailed(f"filesystem export of sandbox {rec.id} failed: {e}") from e
            raise
        if thaw:
            await self.thaw_quietly(rec.id)
        return staging

    async def commit(self, staging: Path, meta: SnapshotMeta, keep_on_error: bool = False) -> SnapshotMeta:
        """Commit a staged image to the repository (in a thread); records ``commit`` (ms).

        Raises:
            RepositoryError: the repository failed (503); the staging directory is
                removed unless ``keep_on_error``.
            CreateFailed: local I/O failed; likewise.
        """
        t0 = time.perf_counter()
        try:
            meta = await asyncio.to_thread(self.snapshots.commit, staging, meta)
        except BaseException as e:
            if not keep_on_error:
                self.snapshots.discard(staging)
            if isinstance(e, RepositoryError):
                raise  # the API answers 503: the repository, not the sandbox, failed
            if isinstance(e, Exception):
                raise CreateFailed(f"commit of snapshot {meta.snapshot_id} failed: {e}") from e
            raise
        timing.record("commit", (time.perf_counter() - t0) * 1000)
        return meta

    async def thaw_quietly(self, sandbox_id: str) -> None:
        """Continue a frozen sandbox; a failure is logged (the caller's liveness check
        decides what follows)."""
        try:
            await self.driver.thaw(sandbox_id)
        except Exception as e:  # noqa: BLE001 — the caller's liveness check decides
            log.error("thaw of %s after a failed pause failed: %s", sandbox_id, e)
