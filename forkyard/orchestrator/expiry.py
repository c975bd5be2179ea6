"""Timeouts: E2B's limits on them, changing them (``set_timeout``, ``refresh``), and the
0.5 s loop that acts on them — a running sandbox past its end is paused or killed, a
paused one past ``settings.paused_retention_s`` is deleted. The same loop drives the
node's periodic housekeeping: frozen copies of hot-paused sandboxes dropped when due,
the warm pool checked and refilled, dead runtimes buried, and (in a cluster) image GC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from forkyard.config import Settings
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound
from forkyard.orchestrator.hot import available_memory_pct
from forkyard.orchestrator.image_gc import ImageGC
from forkyard.orchestrator.pause import Pauser
from forkyard.orchestrator.pool import WarmPool
from forkyard.orchestrator.staging import FsImageTooLarge
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.runtime.base import RuntimeDriver

log = logging.getLogger("forkyard.orchestrator")

#: E2B limits: timeout 0 < t ≤ 24 h; default 300 s (E2B API spec).
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 24 * 3600
#: How often (ticks of the 0.5 s loop) a cluster node runs its image GC on its own.
_CLUSTER_GC_TICKS = 120


def check_timeout(timeout_s: int | None) -> int:
    """A sandbox timeout (s): ``timeout_s``, or :data:`DEFAULT_TIMEOUT_S` when None.

    Raises:
        BadRequest: outside 1 … :data:`MAX_TIMEOUT_S`.
    """
    timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise BadRequest(f"timeout must be between 1 and {MAX_TIMEOUT_S} seconds")
    return timeout_s


@dataclass(eq=False, repr=False)
class Expiry:
    """Timeouts and the loop that enforces them.

    Args:
        settings: ``paused_retention_s``, ``cluster``.
        table: the sandboxes.
        driver: says whether pooled sandboxes still run.
        pool: the warm pool (checked every 2 s).
        pauser: pauses at expiry, drops frozen copies.
        teardown: kills at expiry and buries dead runtimes.
        gc: image GC (run every minute in a cluster).
    """

    settings: Settings
    table: SandboxTable
    driver: RuntimeDriver
    pool: WarmPool
    pauser: Pauser
    teardown: Teardown
    gc: ImageGC
    _expiring: set[str] = field(default_factory=set, init=False)

    # ---- changing timeouts --------------------------------------------------------
    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        """Set expiry to now + ``timeout_s`` (E2B semantics: may shorten or extend).
        Waits for a pause/snapshot/fork in progress, so their write-back cannot undo it.

        Raises:
            NotFound, BadRequest (timeout outside 0 … 86400 s).
        """
        if not 0 <= timeout_s <= MAX_TIMEOUT_S:
            raise BadRequest(f"timeout must be between 0 and {MAX_TIMEOUT_S} seconds")
        async with self.table.locks[sandbox_id]:
            rec = self.table.get(sandbox_id)
            rec.end_at = time.time() + timeout_s
            rec.timeout_s = max(timeout_s, 1)
            if rec.auto_pause and rec.auto_pause_default and timeout_s <= self.settings.short_timeout_kill_s:
                # "End it now" from a client that never chose pause (the E2B CLI's 1 s
                # when its terminal closes): kill at the timeout, as E2B would.
                rec.auto_pause = False
                log.info("sandbox %s: timeout set to %d s and it never asked to pause at its timeout: "
                         "it is killed then, as on E2B (FORKYARD_SHORT_TIMEOUT_KILL_S=%d)",
                         sandbox_id, timeout_s, self.settings.short_timeout_kill_s)
            self.table.store.put(rec)
            return rec

    async def refresh(self, sandbox_id: str, duration_s: int | None) -> SandboxRecord:
        """Extend expiry to at least now + ``duration_s`` (default 300 s; E2B
        ``/refreshes`` never shortens). Serialized like :meth:`set_timeout`.

        Raises:
            NotFound, BadRequest (duration outside 0 … 3600 s, E2B's limit).
        """
        duration_s = DEFAULT_TIMEOUT_S if duration_s is None else duration_s
        if not 0 <= duration_s <= 3600:
            raise BadRequest("duration must be between 0 and 3600 seconds")
        async with self.table.locks[sandbox_id]:
            rec = self.table.get(sandbox_id)
            rec.end_at = max(rec.end_at, time.time() + duration_s)
            self.table.store.put(rec)
            return rec

    # ---- the loop -----------------------------------------------------------------
    async def loop(self) -> None:
        """Every 0.5 s: start expiry actions (pause or kill, each in its own task so one
        slow pause never delays the others) and retention deletes; every 2 s: remove
        running sandboxes whose runtime died (init exited, OOM kill)."""
        tick = 0
        retention_s = self.settings.paused_retention_s
        while True:
            await asyncio.sleep(0.5)
            tick += 1
            now = time.time()
            for rec in self.table.list():
                if rec.id in self._expiring:
                    continue
                if rec.state == "running" and rec.end_at <= now:
                    action = self._expire_pause if rec.auto_pause else self._expire_kill
                elif rec.state == "paused" and rec.paused_at and rec.paused_at + retention_s <= now:
                    action = self._expire_kill
                else:
                    continue
                self._expiring.add(rec.id)
                asyncio.create_task(self._expire(rec.id, action), name=f"expire-{rec.id}")
            hot = self.table.hot
            if len(hot):
                for sandbox_id in hot.due(available_memory_pct()):
                    asyncio.create_task(self.pauser.drop_hot(sandbox_id), name=f"unfreeze-drop-{sandbox_id}")
            if tick % 4 == 0:
                if self.pool.enabled:  # died meanwhile; memory pressure; refill after room was freed
                    for e in self.pool.ready():
                        if not await self.driver.alive(e.sandbox_id) and e.state == "ready":
                            log.warning("pooled sandbox %s died; replacing it", e.sandbox_id)
                            self.pool.drop(e)
                    self.pool.check_memory()
                    self.pool.refill()
                await self.teardown.reap_dead()
            if self.settings.cluster and tick % _CLUSTER_GC_TICKS == 0:
                self.gc.later()  # stale fork images (fork_image_ttl_s) even on an idle node

    def _due(self, sandbox_id: str) -> bool:
        """Still due for expiry now (call with the sandbox's lock held): a timeout set
        or a connect made since the loop looked wins over the expiry."""
        rec = self.table.store.get(sandbox_id)
        if rec is None:
            return False
        now = time.time()
        if rec.state == "running":
            return rec.end_at <= now
        return (rec.state == "paused" and bool(rec.paused_at)
                and rec.paused_at + self.settings.paused_retention_s <= now)

    async def _expire_pause(self, sandbox_id: str) -> None:
        rec = self.table.store.get(sandbox_id)
        # E2B autoPauseMemory: false = a filesystem-only auto-pause; unset = full memory.
        memory = rec is None or rec.auto_pause_memory is not False
        if not memory:
            try:
                await self.pauser.pause(sandbox_id, only_if=self._due, memory=False)
                return
            except FsImageTooLarge as e:
                # Nothing is lost: a memory pause keeps the files (and the processes).
                log.warning("sandbox %s: filesystem-only auto-pause refused (%s); pausing with memory", sandbox_id, e)
        await self.pauser.pause(sandbox_id, only_if=self._due, memory=True)

    async def _expire_kill(self, sandbox_id: str) -> None:
        await self.teardown.kill(sandbox_id, only_if=self._due)

    async def _expire(self, sandbox_id: str, action) -> None:
        try:
            log.info("sandbox %s: %s (expiry)", sandbox_id, action.__name__)
            await action(sandbox_id)
        except (NotFound, BadRequest, Conflict):
            pass
        except Exception as e:  # noqa: BLE001 — keep going
            log.error("expiry of %s failed: %s", sandbox_id, e)
        finally:
            self._expiring.discard(sandbox_id)
