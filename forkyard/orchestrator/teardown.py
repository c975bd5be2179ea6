"""Ending sandboxes: removing what one held (runtime, slot, work directory), killing on
request, and burying those whose runtime stopped by itself (init exited, OOM kill).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.ids import is_sandbox_id
from forkyard.network.base import Network
from forkyard.obs import metrics
from forkyard.orchestrator.image_gc import ImageGC
from forkyard.orchestrator.logs import read_entries
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.repository.snapshots import SnapshotStore
from forkyard.runtime.base import RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")


@dataclass(eq=False, repr=False)
class Teardown:
    """Removes sandboxes and everything they hold.

    Args:
        settings: ``sandboxes_dir`` (per-sandbox work directories).
        table: the sandboxes.
        driver: destroys runtimes; says whether they still run and why they died.
        network: releases slots (``release(index)``, blocking).
        snapshots: discards a killed sandbox's uncommitted pause image.
        gc: told which pause images a kill made garbage.
    """

    settings: Settings
    table: SandboxTable
    driver: RuntimeDriver
    network: Network
    snapshots: SnapshotStore
    gc: ImageGC

    async def destroy(self, sandbox_id: str, slot_index: int | None) -> None:
        """Destroy runtime state, network slot and workdir; never raises."""
        self.table.slots.pop(sandbox_id, None)
        self.table.proxy_rules.pop(sandbox_id, None)
        await self.table.notify_gone(sandbox_id)
        try:
            await self.driver.destroy(sandbox_id, self.settings.sandboxes_dir / sandbox_id)
        except Exception as e:  # noqa: BLE001
            log.error("destroy of %s failed: %s", sandbox_id, e)
        if slot_index is not None:
            try:
                await asyncio.to_thread(self.network.release, slot_index)
            except Exception as e:  # noqa: BLE001
                log.error("release of slot %s failed: %s", slot_index, e)
        if is_sandbox_id(sandbox_id):  # never a path outside sandboxes_dir
            shutil.rmtree(self.settings.sandboxes_dir / sandbox_id, ignore_errors=True)
        else:
            log.error("not removing the work dir of sandbox %r: not a sandbox id", sandbox_id)
        self.table.hot.take(sandbox_id)  # last: the hot-paused count covers a copy until it is gone

    @metrics.timed("kill")
    async def kill(self, sandbox_id: str, only_if=None) -> None:
        """Kill a running or paused sandbox and free everything it held. ``only_if``
        (``f(sandbox_id) -> bool``, checked under the sandbox's lock) lets expiry back
        off when the sandbox was extended meanwhile.

        Raises:
            NotFound: unknown or already killed sandbox.
        """
        table = self.table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            if only_if is not None and not only_if(sandbox_id):
                return
            rec = table.get(sandbox_id)
            was_paused = rec.state == "paused"
            rec.state = "killing"
            table.store.put(rec)
            await self.destroy(rec.id, rec.slot)
            if rec.image_id:  # a pause image that was never committed
                self.snapshots.discard(self.snapshots.staging_path(rec.image_id))
            if rec.image_id and was_paused:  # (a running one's image_id is where it came from)
                self.gc.garbage.add(rec.image_id)
            table.store.delete(rec.id)
        table.locks.pop(sandbox_id, None)
        self.gc.later()

    async def reap_dead(self) -> None:
        """Remove running sandboxes whose runtime is gone (checked cheaply by pid)."""
        table = self.table
        for rec in table.list():
            if rec.state != "running" or rec.id not in table.slots or table.locks[rec.id].locked():
                continue
            try:
                if await self.driver.alive(rec.id):
                    continue
                async with table.locks[rec.id]:
                    cur = table.store.get(rec.id)
                    if cur is None or cur.state != "running" or await self.driver.is_running(rec.id):
                        continue
                    await self.bury(cur)
            except Exception as e:  # noqa: BLE001
                log.error("liveness check of %s failed: %s", rec.id, e)

    async def bury(self, rec: SandboxRecord) -> None:
        """Remove running sandbox ``rec`` whose runtime stopped by itself (call with its
        lock held), recording why first (``table.tombstones``: its proxy streams, the
        502s and 404s that follow and its logs then name the cause) and logging it."""
        cause = await self.driver.death_cause(rec.id)
        reason = cause or "its runtime stopped unexpectedly (envd, the sandbox's init, exited)"
        logs = await asyncio.to_thread(read_entries, self.settings.sandboxes_dir / rec.id / "console.log")
        self.table.tombstones.add(rec.id, reason, logs)
        metrics.SANDBOX_DEATHS.labels("oom" if cause and "out of memory" in cause else "exited").inc()
        log.warning("sandbox %s was killed: %s; removing it", rec.id, reason,
                    extra={"sandbox_id": rec.id})
        rec.state = "killing"  # gone for clients from now on (get() answers with the cause)
        self.table.store.put(rec)
        await self.destroy(rec.id, rec.slot)
        self.table.store.delete(rec.id)
