"""Pausing a sandbox (state machine in shared/DESIGN.md §4, each transition persisted
before it acts):

* running → pausing → paused (checkpoint that stops the sandbox, image staged; the
  reply goes out here) → background: image committed as a ``pause`` snapshot, stopped
  runtime destroyed, slot freed;
* hot pause (:mod:`forkyard.orchestrator.hot`): running → pausing (freeze, then
  ``checkpoint --leave-running`` of the frozen sandbox) → paused, the frozen runtime kept
  with its slot (resume unfreezes it), or dropped later (:meth:`Pauser.drop_hot`: the
  committed image is then what resume restores);
* a filesystem-only pause: frozen, writable layer exported, frozen runtime destroyed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from dataclasses import dataclass

import httpx

from forkyard.config import Settings
from forkyard.guest import envd
from forkyard.obs import metrics
from forkyard.orchestrator import timing
from forkyard.orchestrator.errors import CreateFailed, NotFound, Unavailable
from forkyard.orchestrator.holds import hold
from forkyard.orchestrator.staging import PAUSE_MARKER, FsImageTooLarge, Stager, meta_for
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.repository.snapshots import SnapshotMeta, new_snapshot_id
from forkyard.runtime.base import RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")


@dataclass(eq=False, repr=False)
class Pauser:
    """Pauses sandboxes.

    Args:
        settings: ``cluster`` (a pause answers once its image is committed).
        table: the sandboxes (``hot`` holds the frozen copies kept).
        driver: freezes, checkpoints, says whether a sandbox still runs.
        stager: stages and commits the image.
        teardown: removes the stopped runtime once the image is committed.
        http: the client envd calls go through (``require_healthy``).
    """

    settings: Settings
    table: SandboxTable
    driver: RuntimeDriver
    stager: Stager
    teardown: Teardown
    http: httpx.AsyncClient

    @metrics.timed("pause")
    async def pause(self, sandbox_id: str, require_healthy: bool = False, only_if=None,
                    memory: bool = True) -> SandboxRecord:
        """Checkpoint memory + filesystem, stop the sandbox and free its CPU, memory and
        network slot; the id, metadata and settings stay.

        One ``runsc checkpoint`` (without ``--leave-running``): the sentry stops every
        task, writes the image and only then ends the sandbox, so nothing runs past the
        checkpoint. The answer goes out once the image is on local disk; committing it
        to the repository and removing the stopped runtime continue in the background
        (:meth:`_finish_pause`; resume, kill and shutdown wait for them).

        Crash-safe order: persist ``pausing``; checkpoint into staging (runsc runs in
        its own session and finishes even if the server dies); mark the staged image
        complete; persist ``paused``; commit; destroy. Restart waits for a checkpoint
        still running, then: sandbox still running → running (the checkpoint failed);
        stopped with a staged image → committed, paused (see
        :meth:`forkyard.orchestrator.reconcile.Reconciler.commit_interrupted_pauses`). A
        commit that fails leaves the image staged on this node; resume and restart
        commit it again, and resume restores from the staged copy if the repository
        still refuses.

        With ``require_healthy`` (E2B ``requireHealthyGuest``) envd must answer
        ``/health`` within 2 s first, else :class:`Unavailable` (503) and the sandbox
        keeps running. ``only_if`` (``f(sandbox_id) -> bool``, checked under the lock)
        lets expiry back off when the sandbox was extended meanwhile.

        In a cluster (``settings.cluster``) the answer waits for the commit too, so the
        sandbox can resume on any node even if this one dies right after.

        ``memory`` False (E2B ``memory: false``, SDK ``mode="filesystem"``): a
        filesystem-only pause. The sandbox is frozen and its writable layer exported
        (:meth:`Stager.stage_fs`, no checkpoint); the image is a ``pause`` snapshot with
        ``memory`` False, committed and the frozen runtime destroyed as above. Resume
        cold-boots the template with those files laid over it: same id, token, env vars,
        metadata and egress policy; a new boot id; no processes; ``/tmp`` and
        ``/dev/shm`` (tmpfs mounts, not the rootfs) start empty. Hot pause never
        applies to it (nothing would be kept to resume).

        Hot pause (``settings.hot_pause_s`` > 0, not in a cluster): the sandbox is frozen
        first and checkpointed with ``--leave-running`` (it stays frozen); the frozen
        runtime and its slot are kept so resume is an unfreeze, until dropped
        (:mod:`forkyard.orchestrator.hot`). Durability is the same: the image is
        committed in the background either way.

        Raises:
            NotFound: unknown sandbox (or it had died; it is removed).
            Conflict: already paused (409, as E2B) or busy.
            FsImageTooLarge: ``memory`` False and the changed files exceed
                :meth:`Stager.fs_image_limit` (409); the sandbox keeps running.
            Unavailable: ``require_healthy`` and envd did not answer, or the node's disk
                has no room for the image (:meth:`room_for_image`); it keeps running.
            CreateFailed: runsc failed; the sandbox keeps running.
        """
        table = self.table
        async with table.locks[sandbox_id]:
            if only_if is not None and not only_if(sandbox_id):
                return table.get(sandbox_id)
            rec = table.running(sandbox_id)
            if require_healthy:
                try:
                    await envd.wait_healthy(self.http, table.target(sandbox_id, 0)[0], 2.0)
                except TimeoutError as e:
                    raise Unavailable(f"envd of sandbox {sandbox_id} does not answer; not paused (it keeps running)") from e
            self.room_for_image(rec)
            sid = new_snapshot_id()
            rec.state, rec.image_id = "pausing", sid
            table.store.put(rec)
            table.stopping.add(rec.id)  # the proxy answers "not running" from now on
            hot = memory and table.hot.enabled and await self._freeze(rec.id)
            try:
                await hold("pause.before-checkpoint", rec.id)
                try:
                    if memory:
                        staging = await self.stager.stage(rec, sid, stop=not hot)
                    else:
                        staging = await self.stager.stage_fs(rec, sid, thaw=False)
                except FsImageTooLarge:
                    rec.state, rec.image_id = "running", None  # thawed; nothing was kept
                    table.store.put(rec)
                    raise
                except CreateFailed as e:
                    if hot:
                        await self.stager.thaw_quietly(rec.id)
                    try:
                        alive = await self.driver.is_running(rec.id)
                    except Exception:  # noqa: BLE001 — treat as dead
                        alive = False
                    if not alive:
                        log.error("sandbox %s is not running after a failed pause; removing it", rec.id)
                        await self.teardown.destroy(rec.id, rec.slot)
                        table.store.delete(rec.id)
                        raise NotFound(f"sandbox {rec.id} had stopped (its init exited or it ran out of memory) and was removed") from e
                    rec.state, rec.image_id = "running", None
                    table.store.put(rec)
                    raise CreateFailed(f"pause of sandbox {rec.id} failed: {e}") from e
                await hold("pause.checkpointed", rec.id)
                try:
                    (staging / PAUSE_MARKER).touch()
                except OSError as e:  # the sandbox has stopped: go on; a restart infers the marker
                    log.error("pause of %s: writing the checkpoint marker failed: %s", rec.id, e)
                # The slot stays recorded (and allocated) until the stopped runtime is gone.
                rec.state, rec.paused_at = "paused", time.time()
                table.store.put(rec)
                slot = table.slots.pop(rec.id, None)
                keep = hot and slot is not None
                if keep:
                    table.hot.keep(rec.id, slot)
                    await table.notify_gone(rec.id)  # open streams end, as for a stopping checkpoint
                meta = meta_for(rec, "pause", sid, memory=memory)
                task = table.pending[rec.id] = asyncio.create_task(
                    self._finish_pause(rec.id, staging, meta, rec.slot, keep_runtime=keep), name=f"pause-{rec.id}")
                if self.settings.cluster:
                    # Another node may have to resume it if this one dies next: answer only
                    # once the image is in the shared repository.
                    await asyncio.shield(task)
                return rec
            finally:
                table.stopping.discard(rec.id)

    def room_for_image(self, rec: SandboxRecord) -> None:
        """Refuse a pause when the staging filesystem has less free space than the
        sandbox's memory size (its image needs about that, plus its changed files): a
        checkpoint that runs out of space midway stops the sandbox for good (measured:
        gVisor does not resume it), while a refusal leaves it running.

        Raises:
            Unavailable: not enough free space (503); the sandbox keeps running.
        """
        try:
            st = os.statvfs(self.stager.snapshots.root)
        except OSError:
            return
        free_mb = (st.f_bavail * st.f_frsize) >> 20
        if free_mb < rec.memory_mb:
            raise Unavailable(f"not enough free disk on this node to pause sandbox {rec.id} ({free_mb} MiB free, "
                              f"its image needs about {rec.memory_mb} MiB): it keeps running")

    def committed(self, rec: SandboxRecord) -> bool:
        """Whether paused ``rec``'s image is in the repository, so another node can
        resume it: False while its commit runs, or when a failed commit left it staged
        on this node (:meth:`commit_staged` tries again). True for anything not paused."""
        if rec.state != "paused" or not rec.image_id:
            return True
        if rec.id in self.table.pending:
            return False
        return not (self.stager.snapshots.staging_path(rec.image_id) / PAUSE_MARKER).is_file()

    async def commit_staged(self) -> int:
        """Commit again the images of paused sandboxes that a failed commit left staged
        on this node (the repository was down during their pause); each committed row is
        written again (a cluster node republishes it: it can now resume elsewhere).
        Stops at the first failure (the repository still refuses). Returns how many
        were committed."""
        table = self.table
        done = 0
        for rec in table.store.all():
            if rec.state != "paused" or self.committed(rec):
                continue
            async with table.locks[rec.id]:
                cur = table.store.get(rec.id)
                if cur is None or cur.state != "paused" or cur.image_id != rec.image_id or self.committed(cur):
                    continue
                staging = self.stager.snapshots.staging_path(cur.image_id)
                try:
                    await self.stager.commit(staging, meta_for(cur, "pause", cur.image_id,
                                                               memory=self.stager.staged_memory(staging)),
                                             keep_on_error=True)
                except Exception as e:  # noqa: BLE001 — kept staged; the caller tries later
                    log.warning("committing the staged pause image of %s failed again: %s", cur.id, e)
                    break
                log.info("committed the staged pause image of %s", cur.id)
                table.store.put(cur)
                done += 1
        return done

    async def _freeze(self, sandbox_id: str) -> bool:
        """Freeze a sandbox about to be hot-paused (records ``freeze``, ms). False when
        the runtime cannot: the pause then stops the sandbox as usual."""
        t0 = time.perf_counter()
        try:
            await self.driver.freeze(sandbox_id)
        except Exception as e:  # noqa: BLE001 — NotImplementedError included
            log.warning("hot pause of %s: freeze failed (%s); pausing without keeping it", sandbox_id, e)
            return False
        timing.record("freeze", (time.perf_counter() - t0) * 1000)
        return True

    async def _finish_pause(self, sandbox_id: str, staging: Path, meta: SnapshotMeta,
                            slot_index: int | None, keep_runtime: bool = False) -> None:
        """Background half of :meth:`pause`: commit the staged image (kept staged when
        that fails), then destroy the stopped runtime and release its slot — unless
        ``keep_runtime`` (hot pause: the frozen sandbox stays until dropped)."""
        try:
            await hold("pause.before-commit", sandbox_id)
            try:
                await self.stager.commit(staging, meta, keep_on_error=True)
            except Exception as e:  # noqa: BLE001
                log.error("pause of %s: commit failed (%s); its image stays staged on this node "
                          "and is committed again on resume or restart", sandbox_id, e)
            if keep_runtime:
                return
            await self.teardown.destroy(sandbox_id, slot_index)
            cur = self.table.store.get(sandbox_id)
            if cur is not None and cur.state == "paused":
                cur.slot = None
                self.table.store.put(cur)
        except Exception as e:  # noqa: BLE001 — a background task must not die silently
            log.error("finishing the pause of %s failed: %s", sandbox_id, e)
        finally:
            self.table.pending.pop(sandbox_id, None)

    async def drop_hot(self, sandbox_id: str) -> None:
        """Destroy the kept frozen runtime of paused ``sandbox_id`` and free its slot; the
        sandbox stays paused (its committed image is what resume restores next)."""
        table = self.table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            if sandbox_id not in table.hot:
                return
            rec = table.store.get(sandbox_id)
            slot = table.hot.slot(sandbox_id)
            await self.teardown.destroy(sandbox_id, slot.index if slot else None)  # forgets it last
            if rec is not None and rec.state == "paused":
                rec.slot = None
                table.store.put(rec)
            log.info("dropped the frozen runtime of paused sandbox %s (resumes from its image)", sandbox_id)
