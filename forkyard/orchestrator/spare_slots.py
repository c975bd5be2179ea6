"""Network slots for starting sandboxes: which index a start gets, and the spare slots
built ahead of demand (``FORKYARD_SPARE_SLOTS``, ``settings.spare_slots``): a start
takes one instead of spending ~25 ms of CPU creating a netns, veths and NAT rules
(E2B's orchestrator keeps a similar pool of network slots).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from forkyard.network.base import Network, Slot
from forkyard.obs import metrics
from forkyard.orchestrator.errors import CreateFailed
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord

log = logging.getLogger("forkyard.orchestrator")

#: Slot indexes a node hands out (0 … MAX_SLOTS-1).
MAX_SLOTS = 16384


class SlotAllocator:
    """Hands out slot indexes and keeps ``spare_count`` slots built ahead.

    Args:
        table: the sandboxes (their rows' slot indexes are taken; starts in flight make
            the spare filler wait; ``closing`` stops it).
        network: builds (``allocate(index) -> Slot``) and removes (``release(index)``)
            slots; blocking calls, run in threads.
        spare_count: how many spare slots to keep built (0: none).
        held_elsewhere: indexes held outside the rows (the warm pool's sandboxes).

    Attributes:
        spares: built slots no sandbox has yet.
        building: indexes of spare slots being built.
        next_index: where the round-robin search for a free index starts.
    """

    def __init__(self, table: SandboxTable, network: Network, spare_count: int,
                 held_elsewhere: Callable[[], set[int]]):
        self.table = table
        self.network = network
        self.spare_count = spare_count
        self.held_elsewhere = held_elsewhere
        self.spares: list[Slot] = []
        self.building: set[int] = set()
        self.next_index = 0
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None

    def indexes(self) -> list[int]:
        """Spare slots, including those being built (sorted indexes)."""
        return sorted({s.index for s in self.spares} | self.building)

    def _pick_index(self) -> int:
        """Next free slot index, round-robin, so a just-freed outer address (and any
        conntrack/ARP state or pooled client connection tied to it) is not reused at
        once. Caller holds ``_lock``.

        Raises:
            CreateFailed: all :data:`MAX_SLOTS` are taken.
        """
        used = {r.slot for r in self.table.store.all() if r.slot is not None}
        used |= {s.index for s in self.spares} | self.building | self.held_elsewhere()
        for step in range(MAX_SLOTS):
            idx = (self.next_index + step) % MAX_SLOTS
            if idx not in used:
                self.next_index = (idx + 1) % MAX_SLOTS
                return idx
        metrics.admission_refused("no_network_slot")
        raise CreateFailed("no free network slot on this node")

    async def alloc(self, rec: SandboxRecord) -> Slot:
        """A spare slot when one is ready, else one built now; recorded in ``rec``.

        Raises:
            CreateFailed: no free index; Exception: building the slot failed.
        """
        def note(index: int) -> None:
            rec.slot = index
            self.table.store.put(rec)

        return await self.reserve(note)

    async def reserve(self, note: Callable[[int], None]) -> Slot:
        """A spare slot when one is ready, else one built now. ``note(index)`` records the
        index (in a row or a pool entry) before the slot lock is released, so
        :meth:`_pick_index` never hands the same index out twice."""
        async with self._lock:
            spare = self.spares.pop(0) if self.spares else None
            index = spare.index if spare is not None else self._pick_index()
            note(index)
        self.refill()
        if spare is not None:
            return spare
        return await asyncio.to_thread(self.network.allocate, index)

    def refill(self) -> None:
        """Start building spare slots in the background unless enough are built."""
        if self.spare_count > 0 and not self.table.closing and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._fill(), name="spare-slots")

    async def _fill(self) -> None:
        """Build slots until ``spare_count`` are ready, yielding to starts in flight
        (they need the CPU now; spares are for the next burst)."""
        while len(self.spares) < self.spare_count and not self.table.closing:
            while self.table.starting and not self.table.closing:
                await asyncio.sleep(0.05)
            if self.table.closing:
                return
            async with self._lock:
                try:
                    idx = self._pick_index()
                except CreateFailed:
                    return
                self.building.add(idx)
            try:
                slot = await asyncio.to_thread(self.network.allocate, idx)
            except Exception as e:  # noqa: BLE001 — starts build their own slot meanwhile
                log.warning("building spare network slot %s failed: %s", idx, e)
                await asyncio.to_thread(self.release_quietly, idx)
                return
            finally:
                self.building.discard(idx)
            self.spares.append(slot)

    def release_quietly(self, index: int) -> None:
        """Remove slot ``index``; a failure is logged. Blocking."""
        try:
            self.network.release(index)
        except Exception as e:  # noqa: BLE001
            log.error("release of slot %s failed: %s", index, e)

    async def stop(self) -> None:
        """Finish the slot being built (call with ``table.closing`` set), then remove
        every spare slot."""
        if self._task:
            await asyncio.wait([self._task])
        while self.spares:
            slot = self.spares.pop()
            try:
                await asyncio.to_thread(self.network.release, slot.index)
            except Exception as e:  # noqa: BLE001
                log.error("release of spare slot %s failed: %s", slot.index, e)
