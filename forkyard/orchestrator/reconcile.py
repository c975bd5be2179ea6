"""After a (re)start: make the rows and what runs agree again. Every transition was
persisted before it acted, so each row says how far its operation got: what still runs
is re-adopted, pauses a crash interrupted are committed, what is paused stays paused,
and everything else (rows, runtimes, slots, work and staging directories) is removed.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass

import httpx

from forkyard.config import Settings
from forkyard.guest import envd
from forkyard.network.base import Network
from forkyard.orchestrator.image_gc import ImageGC
from forkyard.orchestrator.spare_slots import MAX_SLOTS, SlotAllocator
from forkyard.orchestrator.staging import PAUSE_MARKER, Stager, meta_for
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.repository.snapshots import SnapshotStore
from forkyard.runtime.base import RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")

#: How long a (re)start waits for checkpoints a killed server left running (s).
CHECKPOINT_WAIT_S = 60


@dataclass(eq=False, repr=False)
class Reconciler:
    """Reconciles persisted sandboxes with what runs, once at start.

    Args:
        settings: ``sandboxes_dir``.
        table: the sandboxes.
        driver: what runs; waits for checkpoints in flight.
        network: slots that exist (``existing_indexes``, ``allocate``, ``release``;
            blocking).
        snapshots: committed and staged images.
        stager: commits interrupted pauses.
        teardown: removes what is not kept.
        slots: where slot allocation continues afterwards.
        gc: deletes images nothing refers to any more.
        http: the client envd calls go through.
    """

    settings: Settings
    table: SandboxTable
    driver: RuntimeDriver
    network: Network
    snapshots: SnapshotStore
    stager: Stager
    teardown: Teardown
    slots: SlotAllocator
    gc: ImageGC
    http: httpx.AsyncClient

    async def _adoptable(self, rec: SandboxRecord, live_ids: set[str]) -> bool:
        if rec.id not in live_ids or rec.slot is None:
            return False
        try:
            if await self.driver.is_frozen(rec.id):  # a pause interrupted before its commit
                await self.driver.thaw(rec.id)
            if not await self.driver.is_running(rec.id):
                return False
            slot = await asyncio.to_thread(self.network.allocate, rec.slot)
        except Exception as e:  # noqa: BLE001 — any failure means not adoptable
            log.warning("sandbox %s not adoptable: %s", rec.id, e)
            return False
        try:
            await envd.wait_healthy(self.http, slot.outer_ip, 10.0)
        except TimeoutError as e:
            # Its processes run: keep it (killing would lose its state); the client
            # sees envd errors and can kill it.
            log.warning("re-adopting sandbox %s although envd does not answer: %s", rec.id, e)
        self.table.slots[rec.id] = slot
        if rec.traffic_token or rec.mask_host:
            self.table.proxy_rules[rec.id] = (rec.traffic_token, rec.mask_host)
        return True

    async def reconcile(self) -> None:
        """After a (re)start: wait for checkpoints a killed server left running and
        commit pauses it interrupted (:meth:`commit_interrupted_pauses`); then
        running/snapshotting/forking/pausing rows whose sandbox still runs with a
        healthy envd are re-adopted as running; pausing/resuming rows with a committed
        pause snapshot become paused; paused rows stay paused while their snapshot
        exists (committed, or staged on this node); everything else — rows, runtime
        containers, netns, workdirs, staging directories — is removed."""
        store = self.table.store
        stuck = await self.driver.wait_checkpoints(CHECKPOINT_WAIT_S)
        if stuck:
            log.warning("checkpoints of %s are still running after %d s", ", ".join(stuck), CHECKPOINT_WAIT_S)
        await self.commit_interrupted_pauses()
        staged = {self.snapshots.staging_path(r.image_id).name for r in store.all()
                  if r.state in ("paused", "resuming") and r.image_id}
        for name in self.snapshots.cleanup_staging(keep=staged):
            log.info("removed uncommitted snapshot staging %s", name)
        live_ids = set(await self.driver.list_ids())
        keep: set[str] = set()
        doomed: list = []
        for rec in store.all():
            committed = self.snapshots.get(rec.image_id) if rec.image_id else None
            if rec.state == "pausing" and committed is not None:
                rec.state = "paused"  # the crash came after the commit: the image is the truth
            if rec.state in ("running", "snapshotting", "forking", "pausing", "resuming") and await self._adoptable(rec, live_ids):
                rec.state, rec.image_id, rec.paused_at = "running", None, None
                store.put(rec)
                keep.add(rec.id)
                log.info("re-adopted sandbox %s", rec.id)
                continue
            staged_only = (rec.state in ("paused", "resuming") and committed is None and rec.image_id
                           and (self.snapshots.staging_path(rec.image_id) / PAUSE_MARKER).is_file())
            if staged_only:  # its commit failed again: keep it, resumable from this node
                log.error("paused sandbox %s has its image only staged on this node (commit failed)", rec.id)
            if staged_only or (rec.state in ("paused", "resuming") and committed is not None and committed.kind == "pause"):
                await self.teardown.destroy(rec.id, rec.slot)
                rec.state, rec.slot = "paused", None
                rec.paused_at = rec.paused_at or time.time()
                store.put(rec)
                keep.add(rec.id)
                log.info("sandbox %s is paused", rec.id)
                continue
            log.info("cleaning up sandbox %s (state %s)", rec.id, rec.state)
            doomed.append(self._teardown_row(rec))
        running = self.table.slots
        rows = {r.id for r in store.all()}  # doomed rows are destroyed with their row
        for rid in live_ids - keep:
            if rid not in running and rid not in rows:
                log.info("removing orphan runtime sandbox %s", rid)
                doomed.append(self.driver.destroy(rid, self.settings.sandboxes_dir / rid))
        # In parallel: after a restart their processes belong to the host's PID 1, which
        # reaps only about once a second, so each destroy can take ~1-2 s.
        await asyncio.gather(*doomed)
        used = {s.index for s in running.values()}
        self.slots.next_index = (max(used) + 1) % MAX_SLOTS if used else 0
        for idx in await asyncio.to_thread(self.network.existing_indexes):
            if idx not in used:
                await asyncio.to_thread(self.network.release, idx)
        if self.settings.sandboxes_dir.is_dir():
            for d in self.settings.sandboxes_dir.iterdir():
                if d.name not in running:
                    shutil.rmtree(d, ignore_errors=True)
        await self.gc.run()

    async def _teardown_row(self, rec: SandboxRecord) -> None:
        await self.teardown.destroy(rec.id, rec.slot)
        self.table.store.delete(rec.id)

    async def commit_interrupted_pauses(self) -> None:
        """Commit the staged images of pauses a crash interrupted (call once no
        checkpoint runs any more):

        * ``paused`` rows (the reply went out) whose staging carries the
          checkpoint-complete marker;
        * ``pausing`` rows whose checkpoint finished after the server died: the sandbox
          is no longer running and the staged image exists (runsc stops the sandbox only
          once its image is complete; one that died on its own mid-checkpoint is
          committed too and reported by a failing resume). The row becomes ``paused``.

        A commit that fails leaves the image staged (paused rows stay resumable here).
        """
        store = self.table.store
        for rec in store.all():
            if rec.state not in ("paused", "pausing") or not rec.image_id:
                continue
            if self.snapshots.get(rec.image_id) is not None:
                continue
            staging = self.snapshots.staging_path(rec.image_id)
            if rec.state == "paused" and not (staging / PAUSE_MARKER).is_file():
                continue
            if rec.state == "pausing":
                if not (staging / "image").is_dir() or not any((staging / "image").iterdir()):
                    continue
                if not self.stager.staged_memory(staging):
                    # A filesystem-only pause stops nothing before its reply: the
                    # sandbox still exists (frozen or running) and is re-adopted.
                    continue
                try:
                    if await self.driver.is_running(rec.id):
                        continue  # the checkpoint failed; reconcile re-adopts it
                except Exception as e:  # noqa: BLE001
                    log.warning("state of %s unknown (%s); treating its checkpoint as finished", rec.id, e)
                (staging / PAUSE_MARKER).touch()
                rec.state, rec.paused_at = "paused", time.time()
                store.put(rec)
            try:
                await self.stager.commit(staging, meta_for(rec, "pause", rec.image_id,
                                                           memory=self.stager.staged_memory(staging)), keep_on_error=True)
                log.info("committed the interrupted pause of sandbox %s", rec.id)
            except Exception as e:  # noqa: BLE001
                log.error("committing the interrupted pause of %s failed (kept staged): %s", rec.id, e)
