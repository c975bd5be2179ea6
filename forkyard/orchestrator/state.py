"""The node's table of sandboxes: their rows, a lock per sandbox, and what is kept in
memory beside the rows while they run (slots, proxy rules, pauses in flight, frozen
copies, why the dead died).

Every part of the orchestrator reads and changes sandboxes through one
:class:`SandboxTable`; the rules that make that safe:

* a state change is written to the store (``table.store.put``) before the operation
  that follows it acts, so a crash leaves rows that a restart can reconcile;
* an operation on one sandbox holds ``table.locks[id]`` throughout, and waits for that
  sandbox's pause still committing in the background (:meth:`SandboxTable.settle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable

from forkyard.network.base import Slot
from forkyard.orchestrator.errors import Conflict, NotFound
from forkyard.orchestrator.hot import HotPaused
from forkyard.orchestrator.store import SandboxRecord, Store
from forkyard.orchestrator.tombstones import Tombstones

log = logging.getLogger("forkyard.orchestrator")


class SandboxTable:
    """Rows and in-memory state of every sandbox on this node.

    Attributes:
        store: the SQLite rows (the durable truth).
        tombstones: why sandboxes that died by themselves died.
        hot: paused sandboxes whose frozen runtime is still kept (hot pause).
        slots: network slot of each sandbox that runs (what the proxy connects to).
        proxy_rules: ``(traffic token, Host mask)`` per running sandbox that has either.
        locks: one lock per sandbox id; every operation on a sandbox holds it.
        stopping: sandboxes being paused: the proxy treats them as not running.
        pending: background halves of pauses (commit + teardown), by sandbox id.
        on_gone: ``async f(sandbox_id)`` run when a sandbox stops serving (killed,
            paused, died); the API's proxy closes its connections to it there.
        starting: starts in flight (background work such as spare slots and the warm
            pool's refill yields to them).
        closing: the node is stopping; background work ends.
    """

    def __init__(self, store: Store, tombstones: Tombstones, hot: HotPaused):
        self.store = store
        self.tombstones = tombstones
        self.hot = hot
        self.slots: dict[str, Slot] = {}
        self.proxy_rules: dict[str, tuple[str | None, str | None]] = {}
        self.locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.stopping: set[str] = set()
        self.pending: dict[str, asyncio.Task] = {}
        self.on_gone: list[Callable[[str], Awaitable[None]]] = []
        self.starting = 0
        self.closing = False

    # ---- queries ------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRecord:
        """The live (running or paused, possibly mid-operation) sandbox ``sandbox_id``.

        Raises:
            NotFound: unknown id or killed sandbox; for one that died by itself within
                the last hour the message adds why (``…: it was killed: out of memory
                (limit 512 MiB), at …``, :mod:`forkyard.orchestrator.tombstones`).
        """
        rec = self.store.get(sandbox_id)
        if rec is None or rec.state in ("creating", "killing"):
            tomb = self.tombstones.get(sandbox_id)
            raise NotFound(f"sandbox {sandbox_id!r} not found" + (f": {tomb.describe()}" if tomb else ""))
        return rec

    def list(self) -> list[SandboxRecord]:
        """Every sandbox visible to clients (running or paused), oldest first."""
        return [r for r in self.store.all() if r.state not in ("creating", "killing")]

    def target(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """``(host, port)`` the proxy connects to for ``port`` inside the sandbox.

        Raises:
            NotFound: unknown or not running sandbox; the message says "was not found"
                (E2B's proxy wording) and whether it is paused, or why it died
                (:mod:`forkyard.orchestrator.tombstones`).
        """
        slot = self.slots.get(sandbox_id)
        if slot is None or sandbox_id in self.stopping:
            # Wording of E2B's proxy ("... was not found"): the SDKs read it as "not running".
            rec = self.store.get(sandbox_id)
            if rec is not None and rec.state in ("paused", "pausing"):
                raise NotFound("The sandbox was not found running: it is paused (connect or resume it)")
            tomb = self.tombstones.get(sandbox_id)
            if tomb is not None:  # the SDK appends "The sandbox was killed or reached its timeout"
                raise NotFound(f"The sandbox was not found: {tomb.describe()}")
            raise NotFound("The sandbox was not found")  # E2B's proxy, word for word
        return slot.outer_ip, port

    def running(self, sandbox_id: str) -> SandboxRecord:
        """The sandbox, which must be running (not paused, not mid-operation).

        Raises:
            NotFound: unknown sandbox.
            Conflict: it is paused, or busy with another operation.
        """
        rec = self.get(sandbox_id)
        if rec.state == "paused":
            raise Conflict(f"sandbox {sandbox_id} is paused")
        if rec.state != "running":
            raise Conflict(f"sandbox {sandbox_id} is busy ({rec.state}); retry shortly")
        return rec

    # ---- changes ------------------------------------------------------------------
    def mark_running(self, rec: SandboxRecord, slot: Slot) -> None:
        """Record that ``rec`` runs in ``slot`` (proxy table, row: running, expiry from now)."""
        self.slots[rec.id] = slot
        if rec.traffic_token or rec.mask_host:
            self.proxy_rules[rec.id] = (rec.traffic_token, rec.mask_host)
        rec.slot = slot.index
        rec.state = "running"
        rec.started_at = time.time()
        rec.end_at = rec.started_at + rec.timeout_s
        rec.paused_at = None
        self.store.put(rec)

    async def settle(self, sandbox_id: str) -> None:
        """Wait until a pause's background commit/teardown of ``sandbox_id`` is done
        (its outcome is already in the store); call with the sandbox's lock held."""
        task = self.pending.get(sandbox_id)
        if task is not None:
            await asyncio.wait([task])

    async def notify_gone(self, sandbox_id: str) -> None:
        """Run the :attr:`on_gone` callbacks (the proxy closes its connections)."""
        for callback in self.on_gone:
            try:
                await callback(sandbox_id)
            except Exception as e:  # noqa: BLE001
                log.error("on_gone callback for %s failed: %s", sandbox_id, e)
