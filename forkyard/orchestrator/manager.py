"""Sandbox lifecycle core: create, kill, timeouts, restart reconciliation.

Data flows orchestrator → runtime driver / network slots / snapshot store / SQLite,
never back. Every state transition is written to the store before the operation that
follows it, so a crash leaves rows that :meth:`Orchestrator.start` can reconcile
(re-adopt what still runs, keep what is paused, clean up the rest). Pause, resume,
snapshot and fork live in :mod:`forkyard.orchestrator.lifecycle`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import time
from collections import defaultdict
from pathlib import Path

import httpx

from forkyard.config import Settings
from forkyard.ids import is_sandbox_id, new_sandbox_id, rfc3339
from forkyard.network.base import Slot
from forkyard.network.egress import EgressPolicy
from forkyard.obs import metrics
from forkyard.orchestrator import envd_client, timing
from forkyard.orchestrator.admission import Capacity
from forkyard.orchestrator.errors import BadRequest, Conflict, CreateFailed, NotFound
from forkyard.orchestrator.hot import HotPaused, available_memory_pct
from forkyard.orchestrator.lifecycle import (PAUSE_MARKER, FsImageTooLarge, LifecycleMixin, guest_defaults,
                                             staged_memory)
from forkyard.orchestrator.pool import NotPoolable, Pooled, WarmPool
from forkyard.orchestrator.store import SandboxRecord, Store
from forkyard.orchestrator.tombstones import Tombstones
from forkyard.orchestrator.usage import CpuMeter
from forkyard.repository.snapshots import ROOTFS_TAR, SnapshotMeta, SnapshotStore
from forkyard.runtime.base import RuntimeDriver, RuntimeMismatch, SandboxSpec
from forkyard.templates import registry

log = logging.getLogger("forkyard.orchestrator")

#: E2B limits: timeout 0 < t ≤ 24 h; default 300 s (E2B API spec).
DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 24 * 3600
MAX_SLOTS = 16384
#: How long a (re)start waits for checkpoints a killed server left running (s).
CHECKPOINT_WAIT_S = 60
ENVD_READY_TIMEOUT_S = 20.0
#: Network slots kept built ahead of demand (``FORKYARD_SPARE_SLOTS``): a start takes
#: one instead of spending ~25 ms of CPU creating netns, veths and NAT rules (E2B's
#: orchestrator keeps a similar pool of network slots).
SPARE_SLOTS = int(os.environ.get("FORKYARD_SPARE_SLOTS", "16"))
#: How long paused sandboxes are kept before deletion (``FORKYARD_PAUSED_RETENTION_S``).
PAUSED_RETENTION_S = int(os.environ.get("FORKYARD_PAUSED_RETENTION_S", str(30 * 24 * 3600)))
#: In a cluster, a ``fork`` image older than this (s, ``FORKYARD_FORK_IMAGE_TTL_S``) is
#: deleted by any node's image GC: the gateway deletes each once the fork's children run,
#: so an older one was left by a gateway that died mid-fork.
FORK_IMAGE_TTL_S = float(os.environ.get("FORKYARD_FORK_IMAGE_TTL_S", "3600"))
#: How often (ticks of the 0.5 s TTL loop) a cluster node runs its image GC on its own.
_CLUSTER_GC_TICKS = 120


class Orchestrator(LifecycleMixin):
    """Owns every sandbox on this node.

    Args:
        settings: node settings (paths, limits).
        driver: runtime driver (gVisor).
        network: slot manager with ``setup_host()``, ``allocate(i) -> Slot``,
            ``release(i)``, ``existing_indexes()`` (blocking calls, run in threads).
        store: SQLite store.
    """

    def __init__(self, settings: Settings, driver: RuntimeDriver, network, store: Store):
        self.settings = settings
        self.driver = driver
        self.network = network
        self.store = store
        self.snapshots = SnapshotStore(settings.data_dir / "snapshots")
        self._slots: dict[str, Slot] = {}
        self._slot_lock = asyncio.Lock()
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._ttl_task: asyncio.Task | None = None
        # No keep-alive: a slot's outer address is reused by later sandboxes, and a
        # pooled connection to a dead sandbox would hang or fail the next one.
        self._cpu = CpuMeter(driver)
        self._http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self._next_slot = 0
        #: Callbacks ``f(sandbox_id)`` run when a sandbox stops serving (killed,
        #: paused, died); the API's proxy closes its connections to it there.
        self.on_gone: list = []
        #: (traffic token, Host mask) per running sandbox that has either (:meth:`proxy_rules`).
        self._proxy_rules: dict[str, tuple[str | None, str | None]] = {}
        #: Sandboxes being paused: the proxy treats them as not running.
        self._stopping: set[str] = set()
        self._expiring: set[str] = set()
        #: Background halves of pauses (commit + teardown), by sandbox id.
        self._pending: dict[str, asyncio.Task] = {}
        self._spares: list[Slot] = []
        self._building: set[int] = set()
        self._spare_task: asyncio.Task | None = None
        self._starting = 0
        self._closing = False
        self._gc_task: asyncio.Task | None = None
        self._gc_wanted = False
        #: Pause images this node made garbage (resumed or killed their sandbox); in a
        #: cluster only these are deleted (see :meth:`_gc_images_sync`).
        self._garbage: set[str] = set()
        #: What this node may hand out (see :mod:`forkyard.orchestrator.admission`).
        self.capacity = Capacity.from_env()
        self.capacity.memory_in_use = driver.memory_in_use  # what sandboxes really use (overcommit)
        #: Why sandboxes that died by themselves died (told to clients who ask later).
        self.tombstones = Tombstones()
        #: Paused sandboxes whose frozen runtime is still kept (hot pause).
        self._hot = HotPaused(settings.hot_pause_s if not settings.cluster else 0, settings.hot_pause_max)
        #: Sandboxes started ahead per template (:mod:`forkyard.orchestrator.pool`); none in
        #: a cluster: the scheduler places by the capacity a node reports, and a node's
        #: pool would either be hidden from it or look like user sandboxes.
        self.pool = WarmPool(
            targets={} if settings.cluster else dict(settings.pool),
            boot=self._pool_boot, destroy=self._pool_destroy,
            room=lambda vcpus, mem, held: self.capacity.fits(self.store.all(), vcpus, mem, 1, held),
            busy=lambda: self._starting > 0, available_pct=available_memory_pct,
            defaults=(settings.default_vcpu, settings.default_memory_mb), new_id=new_sandbox_id,
        )

    # ---- startup / shutdown -------------------------------------------------------
    async def start(self) -> None:
        """Prepare the host, reconcile persisted sandboxes with what runs, start the
        TTL loop (see :meth:`_reconcile`)."""
        await asyncio.to_thread(self.network.setup_host)
        await self._reconcile()
        self._ttl_task = asyncio.create_task(self._ttl_loop(), name="ttl")
        self._firewall_task = asyncio.create_task(self._firewall_loop(), name="firewall")
        self._refill_spares()
        await self.driver.start_spares(self.settings.default_disk_mb)
        self.pool.refill()

    #: How often forkyard's iptables jumps are checked to still come first (s).
    FIREWALL_CHECK_S = 5.0

    async def _firewall_loop(self) -> None:
        """Every :data:`FIREWALL_CHECK_S`, move forkyard's iptables jumps back ahead of
        rules other software inserted later (``NetworkManager.ensure_jumps_first``)."""
        ensure = getattr(self.network, "ensure_jumps_first", None)
        while ensure is not None:
            await asyncio.sleep(self.FIREWALL_CHECK_S)
            try:
                await asyncio.to_thread(ensure)
            except Exception as e:  # noqa: BLE001 — retried at the next tick
                log.error("checking the firewall order failed: %s", e)

    async def stop(self) -> None:
        """Stop background work (pauses in flight are finished first). Running sandboxes
        are left running for re-adoption; pooled ones are destroyed (they belong to no
        one)."""
        self._closing = True
        await self.pool.stop()
        if self._pending:
            await asyncio.wait(list(self._pending.values()), timeout=60)
        for sandbox_id in self._hot.ids():  # their images are committed: resumable after the restart
            await self._drop_hot(sandbox_id)
        if self._gc_task:
            await asyncio.wait([self._gc_task], timeout=60)
        if self._spare_task:  # finishes the slot it is building, then stops
            await asyncio.wait([self._spare_task])
        while self._spares:
            slot = self._spares.pop()
            try:
                await asyncio.to_thread(self.network.release, slot.index)
            except Exception as e:  # noqa: BLE001
                log.error("release of spare slot %s failed: %s", slot.index, e)
        await self.driver.stop_spares()
        firewall = getattr(self, "_firewall_task", None)
        if firewall:
            firewall.cancel()
        if self._ttl_task:
            self._ttl_task.cancel()
            try:
                await self._ttl_task
            except asyncio.CancelledError:
                pass
        if not self._slots and not any(r.slot is not None for r in self.store.all()):
            # Nothing runs: the host's forwarding/NAT chains are not needed until the next start.
            try:
                await asyncio.to_thread(self.network.teardown_host)
            except Exception as e:  # noqa: BLE001
                log.warning("removing the host network chains failed: %s", e)
        await self._http.aclose()

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
            await envd_client.wait_healthy(self._http, slot.outer_ip, 10.0)
        except TimeoutError as e:
            # Its processes run: keep it (killing would lose its state); the client
            # sees envd errors and can kill it.
            log.warning("re-adopting sandbox %s although envd does not answer: %s", rec.id, e)
        self._slots[rec.id] = slot
        if rec.traffic_token or rec.mask_host:
            self._proxy_rules[rec.id] = (rec.traffic_token, rec.mask_host)
        return True

    async def _reconcile(self) -> None:
        """After a (re)start: wait for checkpoints a killed server left running and
        commit pauses it interrupted (:meth:`_commit_interrupted_pauses`); then
        running/snapshotting/forking/pausing rows whose sandbox still runs with a
        healthy envd are re-adopted as running; pausing/resuming rows with a committed
        pause snapshot become paused; paused rows stay paused while their snapshot
        exists (committed, or staged on this node); everything else — rows, runtime
        containers, netns, workdirs, staging directories — is removed."""
        stuck = await self.driver.wait_checkpoints(CHECKPOINT_WAIT_S)
        if stuck:
            log.warning("checkpoints of %s are still running after %d s", ", ".join(stuck), CHECKPOINT_WAIT_S)
        await self._commit_interrupted_pauses()
        staged = {self.snapshots.staging_path(r.image_id).name for r in self.store.all()
                  if r.state in ("paused", "resuming") and r.image_id}
        for name in self.snapshots.cleanup_staging(keep=staged):
            log.info("removed uncommitted snapshot staging %s", name)
        live_ids = set(await self.driver.list_ids())
        keep: set[str] = set()
        doomed: list = []
        for rec in self.store.all():
            committed = self.snapshots.get(rec.image_id) if rec.image_id else None
            if rec.state == "pausing" and committed is not None:
                rec.state = "paused"  # the crash came after the commit: the image is the truth
            if rec.state in ("running", "snapshotting", "forking", "pausing", "resuming") and await self._adoptable(rec, live_ids):
                rec.state, rec.image_id, rec.paused_at = "running", None, None
                self.store.put(rec)
                keep.add(rec.id)
                log.info("re-adopted sandbox %s", rec.id)
                continue
            staged_only = (rec.state in ("paused", "resuming") and committed is None and rec.image_id
                           and (self.snapshots.staging_path(rec.image_id) / PAUSE_MARKER).is_file())
            if staged_only:  # its commit failed again: keep it, resumable from this node
                log.error("paused sandbox %s has its image only staged on this node (commit failed)", rec.id)
            if staged_only or (rec.state in ("paused", "resuming") and committed is not None and committed.kind == "pause"):
                await self._teardown(rec.id, rec.slot)
                rec.state, rec.slot = "paused", None
                rec.paused_at = rec.paused_at or time.time()
                self.store.put(rec)
                keep.add(rec.id)
                log.info("sandbox %s is paused", rec.id)
                continue
            log.info("cleaning up sandbox %s (state %s)", rec.id, rec.state)
            doomed.append(self._teardown_row(rec))
        rows = {r.id for r in self.store.all()}  # doomed rows are destroyed with their row
        for rid in live_ids - keep:
            if rid not in self._slots and rid not in rows:
                log.info("removing orphan runtime sandbox %s", rid)
                doomed.append(self.driver.destroy(rid, self.settings.sandboxes_dir / rid))
        # In parallel: after a restart their processes belong to the host's PID 1, which
        # reaps only about once a second, so each destroy can take ~1-2 s.
        await asyncio.gather(*doomed)
        used = {s.index for s in self._slots.values()}
        self._next_slot = (max(used) + 1) % MAX_SLOTS if used else 0
        for idx in await asyncio.to_thread(self.network.existing_indexes):
            if idx not in used:
                await asyncio.to_thread(self.network.release, idx)
        if self.settings.sandboxes_dir.is_dir():
            for d in self.settings.sandboxes_dir.iterdir():
                if d.name not in self._slots:
                    shutil.rmtree(d, ignore_errors=True)
        await self._gc_images()

    async def _drop_hot(self, sandbox_id: str) -> None:
        """Destroy the kept frozen runtime of paused ``sandbox_id`` and free its slot; the
        sandbox stays paused (its committed image is what resume restores next)."""
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            if sandbox_id not in self._hot:
                return
            rec = self.store.get(sandbox_id)
            slot = self._hot.slot(sandbox_id)
            await self._teardown(sandbox_id, slot.index if slot else None)  # forgets it last
            if rec is not None and rec.state == "paused":
                rec.slot = None
                self.store.put(rec)
            log.info("dropped the frozen runtime of paused sandbox %s (resumes from its image)", sandbox_id)

    async def _teardown_row(self, rec: SandboxRecord) -> None:
        await self._teardown(rec.id, rec.slot)
        self.store.delete(rec.id)

    async def _commit_interrupted_pauses(self) -> None:
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
        for rec in self.store.all():
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
                if not staged_memory(staging):
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
                self.store.put(rec)
            try:
                await self._commit(staging, self._meta_for(rec, "pause", rec.image_id,
                                                           memory=staged_memory(staging)), keep_on_error=True)
                log.info("committed the interrupted pause of sandbox %s", rec.id)
            except Exception as e:  # noqa: BLE001
                log.error("committing the interrupted pause of %s failed (kept staged): %s", rec.id, e)

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
        slot = self._slots.get(sandbox_id)
        if slot is None or sandbox_id in self._stopping:
            # Wording of E2B's proxy ("... was not found"): the SDKs read it as "not running".
            rec = self.store.get(sandbox_id)
            if rec is not None and rec.state in ("paused", "pausing"):
                raise NotFound(f"The sandbox {sandbox_id} was not found running: it is paused "
                               "(connect or resume it)")
            tomb = self.tombstones.get(sandbox_id)
            if tomb is not None:  # the SDK appends "The sandbox was killed or reached its timeout"
                raise NotFound(f"The sandbox {sandbox_id} was not found: {tomb.describe()}")
            raise NotFound(f"The sandbox {sandbox_id} was not found")
        return slot.outer_ip, port

    # ---- create / start / kill ----------------------------------------------------
    def _pick_index(self) -> int:
        """Next free slot index, round-robin, so a just-freed outer address (and any
        conntrack/ARP state or pooled client connection tied to it) is not reused at
        once. Caller holds ``_slot_lock``.

        Raises:
            CreateFailed: all :data:`MAX_SLOTS` are taken.
        """
        used = {r.slot for r in self.store.all() if r.slot is not None}
        used |= {s.index for s in self._spares} | self._building | self.pool.slot_indexes()
        for step in range(MAX_SLOTS):
            idx = (self._next_slot + step) % MAX_SLOTS
            if idx not in used:
                self._next_slot = (idx + 1) % MAX_SLOTS
                return idx
        metrics.admission_refused("no_network_slot")
        raise CreateFailed("no free network slot on this node")

    async def _alloc_slot(self, rec: SandboxRecord) -> Slot:
        """A spare slot when one is ready, else one built now; recorded in ``rec``."""
        def note(index: int) -> None:
            rec.slot = index
            self.store.put(rec)

        return await self._reserve_slot(note)

    async def _reserve_slot(self, note) -> Slot:
        """A spare slot when one is ready, else one built now. ``note(index)`` records the
        index (in a row or a pool entry) before the slot lock is released, so
        :meth:`_pick_index` never hands the same index out twice."""
        async with self._slot_lock:
            spare = self._spares.pop(0) if self._spares else None
            index = spare.index if spare is not None else self._pick_index()
            note(index)
        self._refill_spares()
        if spare is not None:
            return spare
        return await asyncio.to_thread(self.network.allocate, index)

    def _refill_spares(self) -> None:
        if SPARE_SLOTS > 0 and not self._closing and (self._spare_task is None or self._spare_task.done()):
            self._spare_task = asyncio.create_task(self._fill_spares(), name="spare-slots")

    async def _fill_spares(self) -> None:
        """Build slots until :data:`SPARE_SLOTS` are ready, yielding to starts in flight
        (they need the CPU now; spares are for the next burst)."""
        while len(self._spares) < SPARE_SLOTS and not self._closing:
            while self._starting and not self._closing:
                await asyncio.sleep(0.05)
            if self._closing:
                return
            async with self._slot_lock:
                try:
                    idx = self._pick_index()
                except CreateFailed:
                    return
                self._building.add(idx)
            try:
                slot = await asyncio.to_thread(self.network.allocate, idx)
            except Exception as e:  # noqa: BLE001 — starts build their own slot meanwhile
                log.warning("building spare network slot %s failed: %s", idx, e)
                await asyncio.to_thread(self._release_quietly, idx)
                return
            finally:
                self._building.discard(idx)
            self._spares.append(slot)

    def _release_quietly(self, index: int) -> None:
        try:
            self.network.release(index)
        except Exception as e:  # noqa: BLE001
            log.error("release of slot %s failed: %s", index, e)

    def node_metrics(self) -> dict:
        """``{"sandboxes": {"running": n, "paused": n}, "spareSlots": [index, …],
        "pausesInFlight": n, "hotPaused": n, "gcInFlight": bool, "pool": {template:
        {"target", "ready", "starting", "memoryMB", "hits", "misses", "boots",
        "failures"}}, "poolSlots": [index, …], "poolSandboxes": [runtime id, …],
        "spareDisks": [mount point, …], "memoryInUseMB": n, "sharesRestoredPages": bool}`` (hot
        paused: paused sandboxes whose frozen runtime is still kept here; spare slots
        include those being built; pauses in flight have answered but are still
        committing their image / releasing the runtime; gc deletes pause images nothing
        needs any more; pool: the warm pool per template (:meth:`WarmPool.describe`), its
        sandboxes are not in ``sandboxes``; their slots and runtime ids are listed so
        leak checks can tell them apart — an id becomes the id of the sandbox a create
        gets; spare disks: mount points of the disks the runtime made ahead,
        ``FORKYARD_SPARE_DISKS``; memory in use: MiB the running sandboxes hold that the
        host cannot take back, as an overcommitted node's admission counts it,
        :meth:`Capacity.in_use_mb`; shares restored pages: restored sandboxes share their
        image's unchanged pages, :attr:`RuntimeDriver.shares_restored_pages`)."""
        counts = {"running": 0, "paused": 0}
        for r in self.list():
            if r.state in counts:
                counts[r.state] += 1
        return {"sandboxes": counts, "capacity": self.capacity.as_dict(),
                "memoryInUseMB": self.capacity.in_use_mb(self.list()),
                "sharesRestoredPages": self.driver.shares_restored_pages,
                "spareSlots": sorted({s.index for s in self._spares} | self._building),
                "pausesInFlight": len(self._pending), "hotPaused": len(self._hot),
                "gcInFlight": self._gc_task is not None and not self._gc_task.done(),
                "pool": self.pool.describe(), "poolSlots": sorted(self.pool.slot_indexes()),
                "poolSandboxes": self.pool.ids(), "spareDisks": self.driver.spare_mounts()}

    # ---- warm pool ----------------------------------------------------------------
    def _template_stamp(self, template_id: str) -> int:
        """Build identity of rootfs template ``template_id``: its completion marker's
        mtime (ns), rewritten by every (re)build; 0 when unreadable."""
        try:
            return (self.settings.templates_dir / template_id / registry.MARKER).stat().st_mtime_ns
        except OSError:
            return 0

    async def _pool_boot(self, e: Pooled) -> None:
        """Boot pooled sandbox ``e`` as a cold create of its template would (node default
        vCPUs, memory and disk, hostname, a slot of its own) until envd answers
        ``/health``; no ``/init`` is sent (that is the hand-out's).

        Raises:
            NotPoolable: the template is not a rootfs template built here.
            Exception: the runtime, the network or envd failed (everything made is removed).
        """
        tmpl = registry.resolve(self.settings, e.template_id)
        if tmpl is None:
            raise NotPoolable(f"no rootfs template {e.template_id!r} is built on this node")
        e.stamp = self._template_stamp(e.template_id)

        def note(index: int) -> None:
            e.slot_index = index

        try:
            slot = await self._reserve_slot(note)
            e.slot = slot
            workdir = self._fresh_workdir(e.sandbox_id)
            spec = SandboxSpec(
                sandbox_id=e.sandbox_id, rootfs=tmpl.rootfs, netns_path=slot.netns_path,
                vcpus=e.vcpus, memory_mb=e.memory_mb, hostname="e2b.local", workdir=workdir,
                disk_mb=tmpl.disk_mb or self.settings.default_disk_mb,  # as a cold create's
            )
            await self.driver.create(spec)
            await envd_client.wait_healthy(self._http, slot.outer_ip, ENVD_READY_TIMEOUT_S)
            await self.driver.alive(e.sandbox_id)  # caches its pid: the hand-out's check is a kill(0)
        except BaseException:
            await asyncio.shield(self._pool_destroy(e))
            raise

    def _fresh_workdir(self, sandbox_id: str) -> Path:
        """An empty runtime work directory for ``sandbox_id`` (a stale one is removed).

        Raises:
            CreateFailed: ``sandbox_id`` is not a sandbox id (it would name another path).
        """
        if not is_sandbox_id(sandbox_id):  # it names a host path (forkyard.ids)
            raise CreateFailed(f"{sandbox_id!r} is not a sandbox id")
        workdir = self.settings.sandboxes_dir / sandbox_id
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        return workdir

    async def _pool_destroy(self, e: Pooled) -> None:
        """Remove pooled sandbox ``e``: runtime, slot, workdir. Never raises."""
        await self._teardown(e.sandbox_id, e.slot_index)
        e.slot_index = None

    def _pool_yield(self, vcpus: int, memory_mb: int, count: int = 1) -> None:
        """After admitting ``count`` user sandboxes of ``vcpus``/``memory_mb`` that have no
        row yet: drop pooled sandboxes until the pool fits beside every user sandbox."""
        if self.pool.enabled:
            self.pool.make_room(lambda held: self.capacity.fits(self.store.all(), vcpus, memory_mb, count, held))

    def _admit(self, vcpus: int, memory_mb: int, count: int = 1) -> None:
        """Admission of ``count`` user sandboxes (:meth:`Capacity.check` over the user
        sandboxes); the warm pool yields to them (:meth:`_pool_yield`).

        Raises:
            AtCapacity: they do not fit beside the user sandboxes.
        """
        self.capacity.check(self.store.all(), vcpus, memory_mb, count)
        self._pool_yield(vcpus, memory_mb, count)

    def _poolable(self, tmpl, vcpus: int | None, memory_mb: int | None, disk_mb: int | None = None) -> bool:
        """True when a pooled sandbox of ``tmpl`` can honour the request: a rootfs
        template with a pool, the node's default vCPUs and memory, and the template's
        disk size."""
        return (tmpl is not None and self.pool.pools(tmpl.template_id)
                and vcpus in (None, self.settings.default_vcpu)
                and memory_mb in (None, self.settings.default_memory_mb)
                and disk_mb in (None, tmpl.disk_mb or self.settings.default_disk_mb))

    async def _handout(self, rec: SandboxRecord, e: Pooled) -> None:
        """Make pooled sandbox ``e`` the sandbox ``rec`` (whose id is ``e``'s): apply the
        egress policy, send envd ``/init`` (env vars, access token, default user ``user``
        as a cold create of a rootfs template does, the clock), then mark it running as
        :meth:`_start` does (expiry from now).

        Raises:
            CreateFailed: it died meanwhile or envd refused ``/init``; the pooled
                sandbox is destroyed (the caller falls back to a cold create).
        """
        self._starting += 1
        try:
            if not await self.driver.alive(e.sandbox_id):
                raise CreateFailed(f"pooled sandbox {e.sandbox_id} is no longer running")
            if rec.egress:  # before anything of the caller's runs in it
                await asyncio.to_thread(self.network.set_egress, e.slot.index, EgressPolicy.from_json(rec.egress))
            await envd_client.init(self._http, e.slot.outer_ip, rec.env_vars, rec.envd_access_token, None,
                                   default_user="user")
        except BaseException as err:
            log.warning("hand-out of pooled sandbox %s failed: %r", e.sandbox_id, err)
            await asyncio.shield(self._pool_destroy(e))
            if isinstance(err, Exception) and not isinstance(err, CreateFailed):
                raise CreateFailed(f"hand-out of pooled sandbox {e.sandbox_id} failed: {err!r}") from err
            raise
        finally:
            self._starting -= 1
        self._mark_running(rec, e.slot)

    async def _start(self, rec: SandboxRecord, image: SnapshotMeta | None, old_token: str | None,
                     image_dir: Path | None = None, phases: dict[str, float] | None = None,
                     forget_image: bool = False) -> None:
        """Allocate a slot, start ``rec`` fresh (``image`` None) or restore it from
        ``image`` (read from ``image_dir`` when given — a staged, uncommitted fork image —
        else from the repository), wait for envd and send ``/init``. Persists ``rec`` as
        running. ``phases`` (when given) receives ``slot``, ``runtime`` and ``envd``
        durations in ms; a restore also ``image`` (the image directory found in the node
        cache or materialized from the repository; part of ``runtime``) and the driver's
        own phases (gVisor: ``disk``, ``runsc``, ``rearm``). ``forget_image``: the row
        written as running also clears ``rec.image_id`` (a resume's pause image; one
        durable write instead of two).

        Raises:
            CreateFailed / NotFound: the runtime, the network or envd failed; the slot,
                runtime state and workdir are removed (``rec``'s row is left as is).
            Conflict: the image was written by another runtime build (409 naming both
                builds); cleaned up the same way.
        """
        tmpl = registry.resolve(self.settings, rec.template_id)
        if tmpl is None:
            raise NotFound(f"template {rec.template_id!r} of sandbox {rec.id} not found")
        phases = {} if phases is None else phases
        t0 = time.perf_counter()
        self._starting += 1
        try:
            slot = await self._alloc_slot(rec)
            if rec.egress:  # before anything runs in the slot: no unfiltered moment
                await asyncio.to_thread(self.network.set_egress, slot.index, EgressPolicy.from_json(rec.egress))
            t1 = time.perf_counter()
            phases["slot"] = (t1 - t0) * 1000
            workdir = self._fresh_workdir(rec.id)
            spec = SandboxSpec(
                sandbox_id=rec.id, rootfs=tmpl.rootfs, netns_path=slot.netns_path,
                vcpus=rec.vcpus, memory_mb=rec.memory_mb, hostname="e2b.local", workdir=workdir,
                disk_mb=rec.disk_mb,
            )
            if image is None:
                await self.driver.create(spec)
            elif not image.memory:
                # Filesystem-only image: a cold boot of the template with the saved
                # writable layer laid over it (new boot id; processes do not survive).
                if image_dir is not None:
                    spec.rootfs_upper_tar = image_dir / ROOTFS_TAR
                    await self.driver.create(spec)
                else:
                    path = await asyncio.to_thread(self.snapshots.image, image.snapshot_id)
                    try:
                        spec.rootfs_upper_tar = path / ROOTFS_TAR
                        await self.driver.create(spec)
                    finally:
                        self.snapshots.release(image.snapshot_id)
            elif image_dir is not None:
                await self.driver.restore(spec, image_dir, phases=phases)
            else:
                # Materializes the image from the repository when this node lacks it.
                path = await asyncio.to_thread(self.snapshots.image, image.snapshot_id)
                phases["image"] = (time.perf_counter() - t1) * 1000
                try:
                    await self.driver.restore(spec, path, phases=phases)
                finally:
                    self.snapshots.release(image.snapshot_id)
            t2 = time.perf_counter()
            phases["runtime"] = (t2 - t1) * 1000
            cold = image is None or not image.memory
            if cold or old_token != rec.envd_access_token or rec.env_vars != image.env_vars:
                # A template build records its final USER and WORKDIR on its snapshot
                # (forkyard.templates.build); the record carries them on (rows from
                # before: the image's). A restored envd keeps its workdir in memory.
                user, workdir = guest_defaults(image)
                user = rec.default_user or user or "user"
                workdir = (rec.default_workdir or workdir) if cold else None
                # A cold-booted envd holds no token yet: nothing to prove.
                await envd_client.init(self._http, slot.outer_ip, rec.env_vars, rec.envd_access_token,
                                       None if cold else old_token, default_user=user,
                                       wait_s=ENVD_READY_TIMEOUT_S, default_workdir=workdir)
            else:
                await envd_client.wait_healthy(self._http, slot.outer_ip, ENVD_READY_TIMEOUT_S)
            phases["envd"] = (time.perf_counter() - t2) * 1000
        except BaseException as e:
            log.warning("start of %s failed: %r", rec.id, e)
            await asyncio.shield(self._teardown(rec.id, rec.slot))
            rec.slot = None
            if isinstance(e, (CreateFailed, NotFound, asyncio.CancelledError)) or not isinstance(e, Exception):
                raise
            if isinstance(e, RuntimeMismatch):
                raise Conflict(f"sandbox {rec.id} cannot be restored here: {e}") from e
            if image is not None and image_dir is None and self.snapshots.get(image.snapshot_id) is None:
                raise NotFound(f"snapshot {image.snapshot_id} was deleted while sandbox {rec.id} was being restored from it") from e
            what = "restoring" if image else "creating"
            raise CreateFailed(f"{what} sandbox {rec.id} from {rec.template_id!r} failed: {str(e) or repr(e)}") from e
        finally:
            self._starting -= 1
        for name, ms in phases.items():  # Prometheus/tracing: slot, runtime, envd of this start
            metrics.observe_phase(name, ms / 1000)
        if forget_image:
            rec.image_id = None
        self._mark_running(rec, slot)

    def _mark_running(self, rec: SandboxRecord, slot: Slot) -> None:
        """Record that ``rec`` runs in ``slot`` (proxy table, row: running, expiry from now)."""
        self._slots[rec.id] = slot
        if rec.traffic_token or rec.mask_host:
            self._proxy_rules[rec.id] = (rec.traffic_token, rec.mask_host)
        rec.slot = slot.index
        rec.state = "running"
        rec.started_at = time.time()
        rec.end_at = rec.started_at + rec.timeout_s
        rec.paused_at = None
        self.store.put(rec)

    def _check_timeout(self, timeout_s: int | None) -> int:
        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise BadRequest(f"timeout must be between 1 and {MAX_TIMEOUT_S} seconds")
        return timeout_s

    @metrics.timed("create")
    async def create(
        self,
        template_id: str,
        timeout_s: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        auto_pause: bool = True,
        secure: bool = False,
        vcpus: int | None = None,
        memory_mb: int | None = None,
        auto_resume: bool = False,
        egress: EgressPolicy | None = None,
        public_traffic: bool = True,
        mask_host: str | None = None,
        auto_pause_memory: bool | None = None,
        disk_mb: int | None = None,
    ) -> SandboxRecord:
        """Create and start a sandbox from a template or a snapshot (id or name) and
        wait for envd.

        Args:
            timeout_s: seconds until expiry (1 … 86400; default 300).
            auto_pause: pause (True) or kill (False) at expiry.
            auto_pause_memory: False = that pause keeps the filesystem only (E2B
                ``autoPauseMemory``); None/True = a full memory pause.
            auto_resume: proxied traffic resumes the sandbox when paused (:meth:`wake`).
            egress: outbound traffic policy, enforced from before the sandbox starts.
            public_traffic: False = user ports need the ``traffic_token`` generated here.
            mask_host: Host header for user-port requests (``${PORT}`` = the port).
            secure: generate an envd access token that clients must send (always
                done for snapshots whose source had one).
            disk_mb: disk size (MiB) instead of the template's or snapshot's (a template
                build's own ``diskSizeMB``); at least the snapshot's, within the node's
                bounds (:func:`forkyard.templates.registry.check_disk_mb`). Default: the
                snapshot's, else the template's, else ``FORKYARD_DISK_MB``.

        Raises:
            NotFound: unknown template/snapshot.
            BadRequest: out-of-range timeout or disk size.
            CreateFailed: runtime or envd failure; everything half-made is removed.
        """
        timeout_s = self._check_timeout(timeout_s)
        tmpl = registry.resolve(self.settings, template_id)
        snap = await asyncio.to_thread(self.snapshots.find, template_id) if tmpl is None else None
        if snap is None and tmpl is None:
            raise NotFound(f"template {template_id!r} not found")
        inherited = (snap.disk_mb if snap else tmpl.disk_mb) or self.settings.default_disk_mb
        if disk_mb is not None:
            try:
                registry.check_disk_mb(self.settings, disk_mb)
            except ValueError as e:
                raise BadRequest(str(e)) from None
            if snap is not None and inherited and disk_mb < inherited:
                raise BadRequest(f"diskSizeMB {disk_mb} is smaller than the disk of {template_id!r} "
                                 f"({inherited} MiB), whose files it restores")
        now = time.time()
        rec = SandboxRecord(
            id=new_sandbox_id(),
            template_id=snap.template_id if snap else tmpl.template_id,
            state="creating",
            slot=None,
            vcpus=snap.vcpus if snap else (vcpus or self.settings.default_vcpu),
            memory_mb=snap.memory_mb if snap else (memory_mb or self.settings.default_memory_mb),
            started_at=now,
            end_at=now + timeout_s,
            auto_pause=auto_pause,
            metadata=dict(metadata or {}),
            env_vars={**(snap.env_vars if snap else {}), **(env_vars or {})},
            image_id=snap.snapshot_id if snap else None,
            timeout_s=timeout_s,
            auto_resume=auto_resume,
            egress=egress.to_json() if egress is not None and not egress.empty else {},
            traffic_token=None if public_traffic else secrets.token_urlsafe(24),
            mask_host=mask_host,
            disk_mb=disk_mb if disk_mb is not None else inherited,
            auto_pause_memory=auto_pause_memory,
        )
        rec.default_user, rec.default_workdir = guest_defaults(snap)
        old_token = snap.envd_access_token if snap else None
        if secure or old_token:
            rec.envd_access_token = secrets.token_urlsafe(24)
        self.capacity.check(self.store.all(), rec.vcpus, rec.memory_mb)  # no await until put: atomic
        pooled = None
        if snap is None and self._poolable(tmpl, vcpus, memory_mb, disk_mb):
            pooled = self.pool.take(tmpl.template_id, self._template_stamp(tmpl.template_id))
            if pooled is not None:
                rec.id, rec.slot = pooled.sandbox_id, pooled.slot.index
        self._pool_yield(rec.vcpus, rec.memory_mb)
        self.store.put(rec)
        if pooled is not None:
            t0 = time.perf_counter()
            try:
                await self._handout(rec, pooled)
                self.pool.record(tmpl.template_id, hit=True)
                timing.record("pool", (time.perf_counter() - t0) * 1000)
                return rec
            except CreateFailed:
                self.store.delete(rec.id)  # cold below, under a new id
                rec.id, rec.slot = new_sandbox_id(), None
                self.store.put(rec)
            except BaseException:
                self.store.delete(rec.id)
                raise
        if tmpl is not None and snap is None and self.pool.pools(tmpl.template_id):
            self.pool.record(tmpl.template_id, hit=False)
        phases: dict[str, float] = {}
        try:
            await self._start(rec, snap, old_token, phases=phases)
        except BaseException:
            self.store.delete(rec.id)
            raise
        for name, ms in phases.items():  # (observed in Prometheus by _start)
            timing.add(name, ms)
        return rec

    async def _notify_gone(self, sandbox_id: str) -> None:
        """Run the :attr:`on_gone` callbacks (the proxy closes its connections)."""
        for callback in self.on_gone:
            try:
                await callback(sandbox_id)
            except Exception as e:  # noqa: BLE001
                log.error("on_gone callback for %s failed: %s", sandbox_id, e)

    async def _teardown(self, sandbox_id: str, slot_index: int | None) -> None:
        """Destroy runtime state, network slot and workdir; never raises."""
        self._slots.pop(sandbox_id, None)
        self._proxy_rules.pop(sandbox_id, None)
        await self._notify_gone(sandbox_id)
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
        self._hot.take(sandbox_id)  # last: the hot-paused count covers a copy until it is gone

    @metrics.timed("kill")
    async def kill(self, sandbox_id: str, only_if=None) -> None:
        """Kill a running or paused sandbox and free everything it held. ``only_if``
        (``f(sandbox_id) -> bool``, checked under the sandbox's lock) lets expiry back
        off when the sandbox was extended meanwhile.

        Raises:
            NotFound: unknown or already killed sandbox.
        """
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            if only_if is not None and not only_if(sandbox_id):
                return
            rec = self.get(sandbox_id)
            was_paused = rec.state == "paused"
            rec.state = "killing"
            self.store.put(rec)
            await self._teardown(rec.id, rec.slot)
            if rec.image_id:  # a pause image that was never committed
                self.snapshots.discard(self.snapshots.staging_path(rec.image_id))
            if rec.image_id and was_paused:  # (a running one's image_id is where it came from)
                self._garbage.add(rec.image_id)
            self.store.delete(rec.id)
        self._locks.pop(sandbox_id, None)
        self._gc_images_later()

    def repository_metrics(self) -> dict:
        """Snapshot repository and node-cache metrics (cache hits/misses, bytes fetched
        and uploaded, GC); see :meth:`SnapshotStore.metrics` for the shape."""
        return self.snapshots.metrics()

    def _gc_images_later(self) -> None:
        """Run :meth:`_gc_images` in the background (at most one at a time, plus one
        queued), so a kill or resume never waits on the repository."""
        self._gc_wanted = True
        if self._gc_task is None or self._gc_task.done():
            self._gc_task = asyncio.create_task(self._gc_loop(), name="gc-images")

    async def _gc_loop(self) -> None:
        while self._gc_wanted:
            self._gc_wanted = False
            await self._gc_images()

    async def _gc_images(self) -> None:
        """Delete pause/fork images no sandbox row refers to any more (repository
        calls run in a thread: on S3 each is a network round trip). Best effort: a
        repository failure is logged and retried by the next call."""
        try:
            await asyncio.to_thread(self._gc_images_sync)
        except Exception as e:  # noqa: BLE001 — never fail the operation that triggered it
            log.warning("deleting unused pause images failed (retried later): %s", e)

    def _gc_images_sync(self) -> None:
        """Alone: delete every pause/fork image no local row refers to. In a cluster
        (``settings.cluster``) the repository is shared and other nodes' paused
        sandboxes have images there too, so only the images this node made garbage
        (:attr:`_garbage`) are deleted."""
        referenced = {r.image_id for r in self.store.all() if r.image_id}
        if self.settings.cluster:
            for sid in list(self._garbage - referenced):
                meta = self.snapshots.get(sid)
                if meta is not None and meta.kind == "pause":  # never a user's snapshot or template
                    self.snapshots.delete(sid)
                self._garbage.discard(sid)
            stale = time.time() - FORK_IMAGE_TTL_S
            for meta in self.snapshots.list("fork"):  # left by a gateway that died mid-fork
                if meta.created_at and meta.created_at < stale:
                    log.info("deleting fork image %s left over from %s", meta.snapshot_id,
                             rfc3339(meta.created_at, "seconds"))
                    self.snapshots.delete(meta.snapshot_id)
            return
        for meta in self.snapshots.list():
            if meta.kind in ("pause", "fork") and meta.snapshot_id not in referenced:
                self.snapshots.delete(meta.snapshot_id)

    # ---- cluster hand-over ----------------------------------------------------------
    async def adopt(self, rec: SandboxRecord) -> SandboxRecord:
        """Take over a paused sandbox whose node is gone or draining (its state is a
        committed ``pause`` snapshot in the shared repository): a ``paused`` row with no
        slot; ``resume``/``connect`` then restore it here. Idempotent.

        Raises:
            BadRequest: ``rec`` is not paused or has no pause image.
            NotFound: its pause image is not in the repository.
            Conflict: this node holds the sandbox in another state.
        """
        if rec.state != "paused" or not rec.image_id:
            raise BadRequest(f"only a paused sandbox with a pause image can be adopted (got {rec.state})")
        async with self._locks[rec.id]:
            cur = self.store.get(rec.id)
            if cur is not None:
                if cur.state != "paused":
                    raise Conflict(f"sandbox {rec.id} is {cur.state} on this node")
                return cur
            meta = await asyncio.to_thread(self.snapshots.get, rec.image_id)
            if meta is None:
                raise NotFound(f"paused state {rec.image_id} of sandbox {rec.id} is not in the repository")
            if meta.kind != "pause":
                raise BadRequest(f"{rec.image_id} is a {meta.kind} image, not a pause image")
            if not 0 < rec.disk_mb <= self.settings.max_disk_mb:  # a record never lifts the disk bound
                rec.disk_mb = meta.disk_mb or self.settings.default_disk_mb
            rec.slot = None
            self.store.put(rec)
            log.info("adopted paused sandbox %s (image %s)", rec.id, rec.image_id)
            return rec

    async def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox the cluster has given to another node (or reported gone while
        this node was unreachable): a running one is destroyed, a paused one only loses
        its row here — its pause image stays in the repository for its new node."""
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            rec = self.store.get(sandbox_id)
            if rec is None:
                return
            log.warning("sandbox %s belongs to another node now (or was reported gone); dropping it here", sandbox_id)
            if rec.state != "paused" or rec.slot is not None:  # running, or paused but still frozen here
                await self._teardown(rec.id, rec.slot)
            self.store.delete(rec.id)
        self._locks.pop(sandbox_id, None)

    async def delete_image(self, snapshot_id: str) -> bool:
        """Delete a ``fork`` image exported for other nodes' children (the gateway
        calls this once they all run). Returns False when there is no such fork image."""
        meta = await asyncio.to_thread(self.snapshots.get, snapshot_id)
        if meta is None or meta.kind != "fork":
            return False
        return await asyncio.to_thread(self.snapshots.delete, snapshot_id)

    # ---- timeouts -----------------------------------------------------------------
    def proxy_rules(self, sandbox_id: str) -> tuple[str | None, str | None]:
        """``(traffic access token, Host mask)`` the proxy applies to user-port requests
        of a running sandbox (None, None when it has neither). In memory: filled when
        the sandbox starts, so a proxied request costs no database read."""
        return self._proxy_rules.get(sandbox_id, (None, None))

    def sandbox_for_file_signature(self, query: dict[str, str], operation: str) -> str | None:
        """The running sandbox whose envd access token produced ``query``'s v1 file-URL
        signature (the SDKs' ``download_url``/``upload_url`` of a secure sandbox:
        ``"v1_" + base64(sha256("path:operation:username:token[:expiration]"))``, e2b
        ``sandbox/signature.py``), or None. Such URLs carry no sandbox id when
        ``E2B_SANDBOX_URL`` is set; envd checks the signature again (and its expiry)."""
        import base64
        import hashlib
        import hmac

        sig = query.get("signature", "")
        if not sig.startswith("v1_") or len(sig) > 64:
            return None
        head = [query.get("path", ""), operation, query.get("username", "")]
        tail = [query["signature_expiration"]] if query.get("signature_expiration") else []
        for rec in self.store.all():
            if rec.envd_access_token is None or rec.id not in self._slots:
                continue
            raw = ":".join([*head, rec.envd_access_token, *tail]).encode()
            want = "v1_" + base64.b64encode(hashlib.sha256(raw).digest()).rstrip(b"=").decode()
            if hmac.compare_digest(want, sig):
                return rec.id
        return None

    def log_entries(self, sandbox_id: str) -> list[dict]:
        """The sandbox's log entries since it last started or resumed
        (:func:`forkyard.orchestrator.logs.read_entries`); empty while paused. For a
        sandbox that died by itself within the last hour: its last entries and an
        ``error`` entry saying why (:mod:`forkyard.orchestrator.tombstones`).

        Raises:
            NotFound: unknown sandbox.
        """
        from forkyard.orchestrator.logs import read_entries

        try:
            self.get(sandbox_id)
        except NotFound:
            if (tomb := self.tombstones.get(sandbox_id)) is not None:  # (its row may still be "killing")
                return list(tomb.logs)
            raise
        return read_entries(self.settings.sandboxes_dir / sandbox_id / "console.log")

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        """Replace a sandbox's egress policy (E2B ``PUT /sandboxes/{id}/network``): applied
        at once when it runs, stored for its next resume when paused.

        Raises:
            NotFound: unknown sandbox.
        """
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            rec = self.get(sandbox_id)
            slot = self._slots.get(sandbox_id)
            if slot is not None:
                await asyncio.to_thread(self.network.set_egress, slot.index, policy)
            rec.egress = {} if policy.empty else policy.to_json()
            self.store.put(rec)
            return rec

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        """Set expiry to now + ``timeout_s`` (E2B semantics: may shorten or extend).
        Waits for a pause/snapshot/fork in progress, so their write-back cannot undo it.

        Raises:
            NotFound, BadRequest (timeout outside 0 … 86400 s).
        """
        if not 0 <= timeout_s <= MAX_TIMEOUT_S:
            raise BadRequest(f"timeout must be between 0 and {MAX_TIMEOUT_S} seconds")
        async with self._locks[sandbox_id]:
            rec = self.get(sandbox_id)
            rec.end_at = time.time() + timeout_s
            rec.timeout_s = max(timeout_s, 1)
            self.store.put(rec)
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
        async with self._locks[sandbox_id]:
            rec = self.get(sandbox_id)
            rec.end_at = max(rec.end_at, time.time() + duration_s)
            self.store.put(rec)
            return rec

    async def _ttl_loop(self) -> None:
        """Every 0.5 s: start expiry actions (pause or kill, each in its own task so one
        slow pause never delays the others) and retention deletes; every 2 s: remove
        running sandboxes whose runtime died (init exited, OOM kill)."""
        tick = 0
        while True:
            await asyncio.sleep(0.5)
            tick += 1
            now = time.time()
            for rec in self.list():
                if rec.id in self._expiring:
                    continue
                if rec.state == "running" and rec.end_at <= now:
                    action = self._expire_pause if rec.auto_pause else self._expire_kill
                elif rec.state == "paused" and rec.paused_at and rec.paused_at + PAUSED_RETENTION_S <= now:
                    action = self._expire_kill
                else:
                    continue
                self._expiring.add(rec.id)
                asyncio.create_task(self._expire(rec.id, action), name=f"expire-{rec.id}")
            if len(self._hot):
                for sandbox_id in self._hot.due(available_memory_pct()):
                    asyncio.create_task(self._drop_hot(sandbox_id), name=f"unfreeze-drop-{sandbox_id}")
            if tick % 4 == 0:
                if self.pool.enabled:  # died meanwhile; memory pressure; refill after room was freed
                    for e in self.pool.ready():
                        if not await self.driver.alive(e.sandbox_id) and e.state == "ready":
                            log.warning("pooled sandbox %s died; replacing it", e.sandbox_id)
                            self.pool.drop(e)
                    self.pool.check_memory()
                    self.pool.refill()
                await self._reap_dead()
            if self.settings.cluster and tick % _CLUSTER_GC_TICKS == 0:
                self._gc_images_later()  # stale fork images (FORK_IMAGE_TTL_S) even on an idle node

    def _due(self, sandbox_id: str) -> bool:
        """Still due for expiry now (call with the sandbox's lock held): a timeout set
        or a connect made since the TTL loop looked wins over the expiry."""
        rec = self.store.get(sandbox_id)
        if rec is None:
            return False
        now = time.time()
        if rec.state == "running":
            return rec.end_at <= now
        return rec.state == "paused" and bool(rec.paused_at) and rec.paused_at + PAUSED_RETENTION_S <= now

    async def _expire_pause(self, sandbox_id: str) -> None:
        rec = self.store.get(sandbox_id)
        # E2B autoPauseMemory: false = a filesystem-only auto-pause; unset = full memory.
        memory = rec is None or rec.auto_pause_memory is not False
        if not memory:
            try:
                await self.pause(sandbox_id, only_if=self._due, memory=False)
                return
            except FsImageTooLarge as e:
                # Nothing is lost: a memory pause keeps the files (and the processes).
                log.warning("sandbox %s: filesystem-only auto-pause refused (%s); pausing with memory", sandbox_id, e)
        await self.pause(sandbox_id, only_if=self._due, memory=True)

    async def _expire_kill(self, sandbox_id: str) -> None:
        await self.kill(sandbox_id, only_if=self._due)

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

    async def _reap_dead(self) -> None:
        """Remove running sandboxes whose runtime is gone (checked cheaply by pid)."""
        for rec in self.list():
            if rec.state != "running" or rec.id not in self._slots or self._locks[rec.id].locked():
                continue
            try:
                if await self.driver.alive(rec.id):
                    continue
                async with self._locks[rec.id]:
                    cur = self.store.get(rec.id)
                    if cur is None or cur.state != "running" or await self.driver.is_running(rec.id):
                        continue
                    await self._bury(cur)
            except Exception as e:  # noqa: BLE001
                log.error("liveness check of %s failed: %s", rec.id, e)

    async def _bury(self, rec: SandboxRecord) -> None:
        """Remove running sandbox ``rec`` whose runtime stopped by itself (call with its
        lock held), recording why first (:attr:`tombstones`: its proxy streams, the
        502s and 404s that follow and its logs then name the cause) and logging it."""
        from forkyard.orchestrator.logs import read_entries

        cause = await self.driver.death_cause(rec.id)
        reason = cause or "its runtime stopped unexpectedly (envd, the sandbox's init, exited)"
        logs = await asyncio.to_thread(read_entries, self.settings.sandboxes_dir / rec.id / "console.log")
        self.tombstones.add(rec.id, reason, logs)
        metrics.SANDBOX_DEATHS.labels("oom" if cause and "out of memory" in cause else "exited").inc()
        log.warning("sandbox %s was killed: %s; removing it", rec.id, reason,
                    extra={"sandbox_id": rec.id})
        rec.state = "killing"  # gone for clients from now on (get() answers with the cause)
        self.store.put(rec)
        await self._teardown(rec.id, rec.slot)
        self.store.delete(rec.id)

    # ---- metrics ------------------------------------------------------------------
    async def metrics(self, sandbox_id: str) -> dict:
        """Usage of a running sandbox: envd's ``/metrics`` JSON (memory from the
        sandbox's own ``/proc/meminfo``, disk from ``statfs("/")``) with the CPU figures
        measured on the host (:class:`~forkyard.orchestrator.usage.CpuMeter`:
        ``cpu_used_pct`` 0-100 over the sandbox's CPU quota, ``cpu_count`` that quota)
        and ``disk_total`` capped at the host filesystem holding the sandbox's writable
        layer (gVisor's overlay reports an unbounded size).

        Raises:
            NotFound: unknown or not running sandbox.
            CreateFailed: envd did not answer (500).
        """
        rec = self.get(sandbox_id)
        host, _ = self.target(sandbox_id, 0)
        try:
            m = await envd_client.get_json(self._http, host, "/metrics", rec.envd_access_token)
        except httpx.HTTPError as e:
            raise CreateFailed(f"envd of sandbox {sandbox_id} did not answer /metrics: {e}") from e
        cpu = await self._cpu.percent(sandbox_id)
        if cpu is not None:
            m["cpu_used_pct"], m["cpu_count"] = cpu[0], max(1, round(cpu[1]))
        # Inside, gVisor's overlay reports no real disk figures: take the sandbox's disk
        # (its writable layer) from the host.
        usage = getattr(self.driver, "disk_usage", None)
        disk = await asyncio.to_thread(usage, self.settings.sandboxes_dir / sandbox_id) if usage else None
        if disk is not None:
            m["disk_used"], m["disk_total"] = disk
        else:
            try:
                st = os.statvfs(self.settings.sandboxes_dir)
                m["disk_total"] = min(int(m.get("disk_total", 0)) or 1 << 62, st.f_blocks * st.f_frsize)
            except OSError:
                pass
        return m
