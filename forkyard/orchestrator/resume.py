"""Resuming a paused sandbox under the same id: paused → resuming → running, by
unfreezing its kept runtime (hot pause) or restoring its image (committed, or still
staged on this node when its commit failed). Also E2B's ``connect`` (resume or extend)
and auto-resume on proxied traffic (``wake``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from dataclasses import dataclass

from forkyard.obs import metrics
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import BadRequest, Conflict, CreateFailed, NotFound
from forkyard.orchestrator.expiry import check_timeout
from forkyard.orchestrator.image_gc import ImageGC
from forkyard.orchestrator.staging import PAUSE_MARKER, Stager, meta_for
from forkyard.orchestrator.start import Starter
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore
from forkyard.runtime.base import RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")


@dataclass(eq=False, repr=False)
class Resumer:
    """Resumes paused sandboxes.

    Args:
        table: the sandboxes (``hot`` holds frozen copies kept by hot pause).
        driver: unfreezes kept runtimes.
        snapshots: pause images (committed or staged).
        starter: restores a sandbox from its image.
        teardown: removes a kept runtime that failed to unfreeze.
        gc: told which pause images a resume made garbage.
        admit: ``admit(vcpus, memory_mb)``: admission of the resumed sandbox (raises
            ``AtCapacity``).
        stager: says what kind an image staged here is.
    """

    table: SandboxTable
    driver: RuntimeDriver
    snapshots: SnapshotStore
    starter: Starter
    teardown: Teardown
    gc: ImageGC
    admit: Callable[[int, int], None]
    stager: Stager

    @metrics.timed("resume")
    async def resume(self, sandbox_id: str, timeout_s: int | None = None,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """Restore a paused sandbox under the same id; processes, memory and files
        continue. Expiry is reset to now + ``timeout_s`` (default: its last timeout);
        ``auto_pause`` (when given) replaces its expiry action — only if it resumes.

        Raises:
            NotFound: unknown sandbox.
            Conflict: already running (409, as E2B) or busy.
            CreateFailed: restore failed; the sandbox stays paused.
        """
        if timeout_s is not None:
            timeout_s = check_timeout(timeout_s)
        table = self.table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            rec = table.get(sandbox_id)
            if rec.state == "running":
                raise Conflict(f"sandbox {sandbox_id} is already running")
            if rec.state != "paused":
                raise Conflict(f"sandbox {sandbox_id} is busy ({rec.state}); retry shortly")
            rec = await self._resume_locked(rec, timeout_s, auto_pause)
        self.gc.later()
        return rec

    async def _resume_locked(self, rec: SandboxRecord, timeout_s: int | None,
                             auto_pause: bool | None) -> SandboxRecord:
        # AtCapacity: it stays paused (a kept frozen copy stays kept). Kept copies are
        # not counted as holding memory: they are dropped first when memory runs low.
        self.admit(rec.vcpus, rec.memory_mb)
        if timeout_s is not None:
            rec.timeout_s = timeout_s
        if auto_pause is not None:
            rec.auto_pause, rec.auto_pause_default = auto_pause, False
        image_id = rec.image_id
        if await self._unfreeze(rec):
            marked = self.snapshots.staging_path(image_id or "-")
            staged = marked / "image" if image_id and (marked / PAUSE_MARKER).is_file() else None
        else:
            t0 = time.perf_counter()
            image, staged = await self._pause_image(rec)
            t1 = time.perf_counter()
            timing.record("lookup", (t1 - t0) * 1000)
            # Persisted with the slot (the start's first write, before anything runs): a
            # crash before it leaves the row paused, which is what it still is then.
            rec.state = "resuming"
            phases: dict[str, float] = {}
            try:
                # The row written running also drops the pause image (one write, not two).
                await self.starter.start(rec, image, rec.envd_access_token, image_dir=staged, phases=phases,
                                         forget_image=True)
                # "boot": a cold boot over a filesystem-only image; "restore": a checkpoint.
                timing.record("restore" if image.memory else "boot", (time.perf_counter() - t1) * 1000)
                for name, ms in phases.items():  # observed in Prometheus by the start
                    timing.add(name, ms)
            except BaseException:
                rec.state, rec.slot, rec.image_id = "paused", None, image_id
                self.table.store.put(rec)
                raise
        if staged is not None:
            self.snapshots.discard(staged.parent)
        if image_id:
            self.gc.garbage.add(image_id)
        return rec

    async def _pause_image(self, rec: SandboxRecord) -> tuple[SnapshotMeta, Path | None]:
        """Where to resume ``rec`` from: ``(meta, None)`` for its committed pause image,
        or ``(meta, staged image dir)`` when its commit failed and the image is still
        staged on this node (restored from there: once the sandbox runs again the
        image is garbage, so nothing is left to commit).

        Raises:
            CreateFailed: neither a committed nor a staged image exists.
            RepositoryError: the repository failed (the API answers 503).
        """
        staging = self.snapshots.staging_path(rec.image_id or "-")
        if rec.image_id and (staging / PAUSE_MARKER).is_file():
            log.warning("resuming %s from its image staged on this node", rec.id)
            return (meta_for(rec, "pause", rec.image_id, memory=self.stager.staged_memory(staging)),
                    staging / "image")
        image = await asyncio.to_thread(self.snapshots.get, rec.image_id or "")
        if image is None:
            raise CreateFailed(f"paused state of sandbox {rec.id} is missing from the repository")
        return image, None

    async def _unfreeze(self, rec: SandboxRecord) -> bool:
        """Resume ``rec`` by unfreezing its kept runtime (hot pause; records ``thaw``,
        ms) and persist it running, its pause image forgotten. False when none is kept
        or the unfreeze failed (the kept runtime is then destroyed and the caller
        restores from the image)."""
        slot = self.table.hot.take(rec.id)
        if slot is None:
            return False
        t0 = time.perf_counter()
        try:
            await self.driver.thaw(rec.id)
        except Exception as e:  # noqa: BLE001
            log.warning("unfreezing %s failed (%s); restoring it from its image", rec.id, e)
            await self.teardown.destroy(rec.id, slot.index)
            rec.slot = None
            self.table.store.put(rec)
            return False
        timing.record("thaw", (time.perf_counter() - t0) * 1000)
        self.table.slots[rec.id] = slot
        now = time.time()
        rec.state, rec.slot, rec.paused_at, rec.image_id = "running", slot.index, None, None
        rec.started_at, rec.end_at = now, now + rec.timeout_s
        self.table.store.put(rec)
        return True

    async def connect(self, sandbox_id: str, timeout_s: int, memory: bool | None = None) -> tuple[SandboxRecord, bool]:
        """E2B ``connect``: resume a paused sandbox (expiry now + ``timeout_s``) or
        extend a running one's expiry to at least now + ``timeout_s`` (never shorten).
        Waits for a pause, resume, snapshot or fork in progress, so concurrent connects
        all see the result. Returns ``(record, resumed)``.

        ``memory`` False (E2B connect ``memory: false``, SDK ``on_resume="reboot"``):
        a no-op for a running sandbox or one paused filesystem-only; refused (400) for
        one paused with memory — forkyard cannot cold-boot from a memory checkpoint.

        Raises:
            NotFound, BadRequest (timeout; ``memory`` False on a memory pause),
            CreateFailed (restore failed; stays paused).
        """
        timeout_s = check_timeout(max(timeout_s, 1))
        table = self.table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            rec = table.get(sandbox_id)
            if rec.state == "paused" and memory is False and await self._paused_with_memory(rec):
                raise BadRequest(f"sandbox {sandbox_id} was paused with its memory; a reboot from a memory "
                                 "snapshot (connect memory: false) is not supported by forkyard: connect "
                                 "without it to restore the memory snapshot")
            if rec.state == "paused":
                rec = await self._resume_locked(rec, timeout_s, None)
                resumed = True
            else:
                if rec.end_at < time.time() + timeout_s:
                    rec.end_at = time.time() + timeout_s
                    rec.timeout_s = timeout_s
                    table.store.put(rec)
                resumed = False
        if resumed:
            self.gc.later()
        return rec, resumed

    async def _paused_with_memory(self, rec: SandboxRecord) -> bool:
        """Whether paused ``rec`` resumes from a memory checkpoint (True) or cold-boots
        from a filesystem-only image (False)."""
        staging = self.snapshots.staging_path(rec.image_id or "-")
        if rec.image_id and (staging / PAUSE_MARKER).is_file():
            return self.stager.staged_memory(staging)
        meta = await asyncio.to_thread(self.snapshots.get, rec.image_id or "")
        return meta is None or meta.memory

    async def wake(self, sandbox_id: str) -> bool:
        """Auto-resume (E2B ``autoResume``): resume ``sandbox_id`` for its own timeout if
        it is paused (or being paused) and was created with ``autoResume.enabled``; True
        when it runs now. A sandbox without auto-resume, unknown or gone: False.

        Raises:
            CreateFailed: the restore failed (it stays paused).
        """
        rec = self.table.store.get(sandbox_id)
        if rec is None or not rec.auto_resume:
            return False
        if rec.state == "running":
            return True  # another request resumed it meanwhile
        if rec.state not in ("paused", "pausing", "resuming"):
            return False
        try:
            await self.connect(sandbox_id, rec.timeout_s)
        except NotFound:
            return False
        return True
