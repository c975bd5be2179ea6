"""Warm pool: per-template sandboxes started ahead of demand, so a create is a hand-out
(envd ``/init`` with the request's env vars, token and user, a row write) instead of a
``runsc run`` and an envd boot (~200-400 ms on these machines).

A pooled sandbox is booted from a rootfs template exactly as a cold create would boot
it (same rootfs, hostname, default vCPUs, memory and disk, a network slot of its own),
envd answers ``/health``, and nothing else has happened: no ``/init``, no row in the
store, no entry in the proxy's table — so it is not listed, not counted in
``/metrics/node``'s sandbox counts, not reachable through the proxy, and a server crash
leaves only an orphan runtime that the next start removes like any other. Each pooled
sandbox is handed out once, to one create; it is never shared or reused.

What a pooled sandbox cannot honour, it is never used for: a create asking for other
vCPUs or memory than the node defaults, or for a built (snapshot) template, is a cold
create. Everything else the create asks for is applied at hand-out (see
``Creator._handout`` in :mod:`forkyard.orchestrator.create`).

Memory: a pooled sandbox holds its memory limit in admission like a user sandbox
(``Capacity``), so the pool never makes the node overcommit; it yields to user
sandboxes — a user start that would not fit beside the pool drops pooled sandboxes, and
the pool refills only while there is room for one more beside every user sandbox, while
the host has at least ``refill_min_available_pct`` % memory available and no user start
is in flight. Under ``drop_available_pct`` % available memory one pooled sandbox is
dropped per check (as hot pause does). Idle, one costs ~20-40 MiB of host memory
(measured, ``docs/runtime.md``).

This module keeps the books and runs the refill; booting and destroying are the
orchestrator's (``boot``/``destroy`` callbacks), so the arrows point one way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from forkyard.network.base import Slot

log = logging.getLogger("forkyard.orchestrator.pool")

@dataclass
class Pooled:
    """One pooled sandbox.

    Attributes:
        sandbox_id: its runtime id, which becomes the sandbox id at hand-out.
        template_id: the rootfs template it was booted from.
        vcpus / memory_mb: its limits (the node defaults; counted in admission).
        stamp: the template's build identity at boot (:func:`forkyard.orchestrator.images.template_stamp`):
            a rebuilt template makes older pooled sandboxes stale.
        slot: its network slot once built (None while booting before that).
        slot_index: the slot's index once reserved (kept from other sandboxes until the
            pooled sandbox is destroyed or handed out).
        ready_at: ``time.monotonic()`` when it became ready (oldest handed out first).
        state: ``starting`` → ``ready`` → ``taken`` (handed out: no longer the pool's);
            ``doomed`` once dropped (a booting one is destroyed when its boot returns).
    """

    sandbox_id: str
    template_id: str
    vcpus: int
    memory_mb: int
    stamp: int = 0
    slot: Slot | None = None
    slot_index: int | None = None
    state: str = "starting"
    ready_at: float = 0.0


class NotPoolable(Exception):
    """Raised by a ``boot`` callback when the template cannot be pooled now (not built
    here, or a built snapshot template): the pool skips it for ``retry_s``."""


@dataclass
class PoolStats:
    """Per-template counters since the server started: ``hits`` (creates served from
    the pool), ``misses`` (creates of a pooled template that found none ready or whose
    hand-out failed), ``boots`` (pooled sandboxes made ready) and ``failures`` (boots
    that failed)."""

    hits: int = 0
    misses: int = 0
    boots: int = 0
    failures: int = 0


@dataclass
class WarmPool:
    """Books and refill of the warm pool.

    Args:
        targets: pooled sandboxes wanted per template (``FORKYARD_POOL``); empty: off.
        boot: ``await boot(entry)`` starts ``entry`` (sets its slot) until envd answers;
            raises on failure after removing what it made.
        destroy: ``await destroy(entry)`` removes a pooled sandbox (never raises).
        room: ``room(entry_vcpus, entry_memory_mb, held)`` — True when one more pooled
            sandbox fits beside every user sandbox and ``held`` (the pool's holdings).
        busy: ``busy()`` — True while user starts are in flight (refill waits).
        available_pct: host memory available, % (None: unknown).
        defaults: ``(vcpus, memory_mb)`` a pooled sandbox gets.
        new_id: ``new_id()`` — a fresh sandbox id (the pooled sandbox keeps it when
            handed out).
        refill_min_available_pct / drop_available_pct: host memory thresholds (%, see
            the module doc).
    """

    targets: dict[str, int]
    boot: Callable[[Pooled], Awaitable[None]]
    destroy: Callable[[Pooled], Awaitable[None]]
    room: Callable[[int, int, list[tuple[int, int]]], bool]
    busy: Callable[[], bool]
    available_pct: Callable[[], float | None]
    defaults: tuple[int, int]
    new_id: Callable[[], str]
    refill_min_available_pct: float = 20.0
    drop_available_pct: float = 10.0
    #: Seconds a template is not refilled after a failed boot (or while it is not built).
    retry_s: float = 10.0
    _entries: dict[str, Pooled] = field(default_factory=dict)
    _task: asyncio.Task | None = None
    _reaping: set[asyncio.Task] = field(default_factory=set)
    _retry_at: dict[str, float] = field(default_factory=dict)
    _closing: bool = False
    _skipped: set[str] = field(default_factory=set)
    stats: dict[str, PoolStats] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.targets)

    def pools(self, template_id: str) -> bool:
        """True when ``template_id`` has a pool (hits and misses are counted for it)."""
        return template_id in self.targets

    # ---- books ---------------------------------------------------------------------
    def held(self) -> list[tuple[int, int]]:
        """``(vcpus, memory_mb)`` of every pooled sandbox holding resources (ready or
        starting; dropped ones are no longer counted)."""
        return [(e.vcpus, e.memory_mb) for e in self._entries.values() if e.state != "doomed"]

    def slot_indexes(self) -> set[int]:
        """Network slot indexes held by pooled sandboxes (doomed ones until destroyed)."""
        return {e.slot_index for e in self._entries.values() if e.slot_index is not None}

    def ids(self) -> list[str]:
        """Runtime ids of every pooled sandbox not yet destroyed (test leftovers checks)."""
        return sorted(self._entries)

    def _count(self, template_id: str, state: str) -> int:
        return sum(1 for e in self._entries.values() if e.template_id == template_id and e.state == state)

    def describe(self) -> dict[str, dict]:
        """``{template: {"target", "ready", "starting", "memoryMB", "hits", "misses",
        "boots", "failures"}}`` for every configured template (memory in MiB, held in
        admission by its ready and starting sandboxes)."""
        out = {}
        for tid, target in sorted(self.targets.items()):
            s = self.stats.get(tid, PoolStats())
            live = [e for e in self._entries.values() if e.template_id == tid and e.state != "doomed"]
            out[tid] = {"target": target, "ready": self._count(tid, "ready"), "starting": self._count(tid, "starting"),
                        "memoryMB": sum(e.memory_mb for e in live), "hits": s.hits, "misses": s.misses,
                        "boots": s.boots, "failures": s.failures}
        return out

    def take(self, template_id: str, stamp: int) -> Pooled | None:
        """The oldest ready pooled sandbox of ``template_id`` booted from the template's
        current build ``stamp``, removed from the pool (synchronous: no other create can
        get it). Stale ones (older stamp) are dropped on the way. Starts a refill."""
        found = None
        for e in sorted(self._entries.values(), key=lambda e: e.ready_at):
            if e.template_id != template_id or e.state != "ready":
                continue
            if e.stamp != stamp:
                log.info("pooled sandbox %s is of an older build of %r; dropping it", e.sandbox_id, template_id)
                self.drop(e)
                continue
            found = e
            break
        if found is not None:
            del self._entries[found.sandbox_id]
            found.state = "taken"
        self.refill()
        return found

    def record(self, template_id: str, hit: bool) -> None:
        """Count a create of a pooled template: served from the pool (``hit``) or cold."""
        self._stat(template_id, "hits" if hit else "misses")

    def _stat(self, template_id: str, name: str) -> PoolStats:
        s = self.stats.setdefault(template_id, PoolStats())
        setattr(s, name, getattr(s, name) + 1)
        return s

    def drop(self, e: Pooled) -> None:
        """Stop counting ``e``; a ready one is destroyed in the background, a starting
        one when its boot returns."""
        was = e.state
        e.state = "doomed"
        if was == "ready":
            self._reap(e)

    def _reap(self, e: Pooled) -> None:
        async def run() -> None:
            try:
                await self.destroy(e)
            finally:
                self._entries.pop(e.sandbox_id, None)
                self.refill()

        task = asyncio.create_task(run(), name=f"pool-drop-{e.sandbox_id}")
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    def make_room(self, fits: Callable[[list[tuple[int, int]]], bool]) -> int:
        """Drop pooled sandboxes (starting ones first, then the newest ready ones) until
        ``fits(held)`` says the pool's holdings fit beside the user sandboxes. Returns
        how many were dropped."""
        dropped = 0
        while self.held() and not fits(self.held()):
            live = [e for e in self._entries.values() if e.state != "doomed"]
            live.sort(key=lambda e: (e.state != "starting", -e.ready_at))
            log.info("dropping pooled sandbox %s (%s): a user sandbox needs the room", live[0].sandbox_id, live[0].state)
            self.drop(live[0])
            dropped += 1
        return dropped

    def check_memory(self) -> None:
        """Drop the newest pooled sandbox when host memory available is under
        ``drop_available_pct`` (call periodically)."""
        pct = self.available_pct()
        if pct is None or pct >= self.drop_available_pct:
            return
        ready = sorted((e for e in self._entries.values() if e.state == "ready"), key=lambda e: -e.ready_at)
        if ready:
            log.warning("host memory available %.1f%% < %.0f%%: dropping pooled sandbox %s",
                        pct, self.drop_available_pct, ready[0].sandbox_id)
            self.drop(ready[0])

    # ---- refill --------------------------------------------------------------------
    def refill(self) -> None:
        """Start the refill task unless it runs (or the node is stopping)."""
        if self.enabled and not self._closing and (self._task is None or self._task.done()):
            self._task = asyncio.create_task(self._fill(), name="warm-pool")

    def _next(self) -> str | None:
        """The configured template furthest below its target that may be refilled now."""
        now = time.monotonic()
        best, gap = None, 0
        for tid, target in self.targets.items():
            if self._retry_at.get(tid, 0) > now:
                continue
            have = self._count(tid, "ready") + self._count(tid, "starting")
            if target - have > gap:
                best, gap = tid, target - have
        return best

    async def _fill(self) -> None:
        """Boot pooled sandboxes one at a time until every template is at its target,
        waiting while user starts are in flight and stopping when there is no room."""
        while not self._closing:
            while self.busy() and not self._closing:
                await asyncio.sleep(0.02)
            tid = self._next()
            if tid is None or self._closing:
                return
            pct = self.available_pct()
            if pct is not None and pct < self.refill_min_available_pct:
                return  # retried by the next periodic refill
            vcpus, memory_mb = self.defaults
            if not self.room(vcpus, memory_mb, self.held()):
                return
            e = Pooled(self.new_id(), tid, vcpus, memory_mb)
            self._entries[e.sandbox_id] = e
            try:
                await self.boot(e)
            except NotPoolable as err:
                self._entries.pop(e.sandbox_id, None)
                self.skip(tid, str(err))
                continue
            except Exception as err:  # noqa: BLE001 — retried after retry_s
                self._entries.pop(e.sandbox_id, None)
                self._stat(tid, "failures")
                self._retry_at[tid] = time.monotonic() + self.retry_s
                log.warning("warm pool: starting a %r sandbox failed (retry in %.0f s): %s", tid, self.retry_s, err)
                continue
            if e.state == "doomed" or self._closing:
                e.state = "doomed"
                await self.destroy(e)
                self._entries.pop(e.sandbox_id, None)
                continue
            e.state, e.ready_at = "ready", time.monotonic()
            self._skipped.discard(tid)
            self._stat(tid, "boots")

    def skip(self, template_id: str, why: str) -> None:
        """Do not refill ``template_id`` for ``retry_s`` (``why`` is logged the first time)."""
        if template_id not in self._skipped:
            self._skipped.add(template_id)
            log.warning("warm pool: cannot pool %r (retried every %.0f s): %s", template_id, self.retry_s, why)
        self._retry_at[template_id] = time.monotonic() + self.retry_s

    def ready(self) -> list[Pooled]:
        """The ready pooled sandboxes (for liveness checks)."""
        return [e for e in self._entries.values() if e.state == "ready"]

    async def stop(self) -> None:
        """Stop refilling (a boot in flight finishes) and destroy every pooled sandbox."""
        self._closing = True
        if self._task is not None:
            await asyncio.wait([self._task])
        if self._reaping:
            await asyncio.wait(list(self._reaping))
        left = list(self._entries.values())
        for e in left:
            e.state = "doomed"
        await asyncio.gather(*(self.destroy(e) for e in left))
        self._entries.clear()
