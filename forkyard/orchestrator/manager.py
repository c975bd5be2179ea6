"""The orchestrator: one object that owns every sandbox on this node, the face the API,
template builds and the cluster agent see.

Data flows orchestrator → runtime driver / network slots / snapshot store / SQLite,
never back. Every state transition is written to the store before the operation that
follows it, so a crash leaves rows that :meth:`Orchestrator.start` can reconcile.

:class:`Orchestrator` puts together parts that each hold one concern and take only what
they need (composition: no part reaches into another's state):

============================  =========================================================
:mod:`.state`                 the sandbox table: rows, locks, slots of running sandboxes
:mod:`.spare_slots`           slot indexes and spare slots built ahead
:mod:`.start`                 starting a runtime (fresh or from an image) until envd answers
:mod:`.create`                creates: admission, cold starts, warm-pool hand-outs
:mod:`.teardown`              kill, removal of what a sandbox held, burying dead runtimes
:mod:`.staging`               checkpoints/exports into staging, commits
:mod:`.pause` / :mod:`.resume`  pause (also hot pause) and resume / connect / wake
:mod:`.snapshot` / :mod:`.fork`  user snapshots; forks (local and across nodes)
:mod:`.expiry`                timeouts and the loop that enforces them
:mod:`.reconcile`             making rows and runtimes agree after a restart
:mod:`.handover`              adopt / forget / fork images between cluster nodes
:mod:`.images` / :mod:`.image_gc`  templates built here and image metadata; image GC
============================  =========================================================
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os

import httpx

from forkyard.config import Settings
from forkyard.guest import envd
from forkyard.network.base import Network
from forkyard.network.egress import EgressPolicy
from forkyard.orchestrator.admission import Capacity
from forkyard.orchestrator.create import Creator
from forkyard.orchestrator.errors import CreateFailed, NotFound
from forkyard.orchestrator.expiry import Expiry
from forkyard.orchestrator.fork import Forker
from forkyard.orchestrator.handover import Handover
from forkyard.orchestrator.hot import HotPaused
from forkyard.orchestrator.image_gc import ImageGC
from forkyard.orchestrator.logs import read_entries
from forkyard.orchestrator.pause import Pauser
from forkyard.orchestrator.reconcile import Reconciler
from forkyard.orchestrator.resume import Resumer
from forkyard.orchestrator.snapshot import Snapshotter
from forkyard.orchestrator.spare_slots import SlotAllocator
from forkyard.orchestrator.staging import Stager
from forkyard.orchestrator.start import Starter
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord, Store
from forkyard.orchestrator.teardown import Teardown
from forkyard.orchestrator.tombstones import Tombstones
from forkyard.orchestrator.usage import CpuMeter
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore
from forkyard.runtime.base import RuntimeDriver
from forkyard.orchestrator.volumes.store import Volumes

log = logging.getLogger("forkyard.orchestrator")


class Orchestrator:
    """Owns every sandbox on this node.

    Args:
        settings: node settings (paths, limits).
        driver: runtime driver (:func:`forkyard.node.build_orchestrator` picks it).
        network: the node's network slots (:class:`~forkyard.network.base.Network`;
            blocking calls, run in threads).
        store: SQLite store.
        snapshots: the snapshot repository and this node's staging and cache.
        package_cache: the node's package cache (:class:`forkyard.pkgcache.PackageCache`;
            it starts and stops with the app, not here), or None when it is off: every
            sandbox created is pointed at it.

    Attributes:
        settings, driver, network, store, snapshots, package_cache: as given.
        capacity: what this node may hand out (:mod:`forkyard.orchestrator.admission`).
        tombstones: why sandboxes that died by themselves died (told to clients who ask
            later).
        pool: the warm pool (:mod:`forkyard.orchestrator.pool`).
        on_gone: ``async f(sandbox_id)`` callbacks run when a sandbox stops serving
            (killed, paused, died); the API's proxy closes its connections to it there.
    """

    #: How often forkyard's iptables jumps are checked to still come first (s).
    FIREWALL_CHECK_S = 5.0

    def __init__(self, settings: Settings, driver: RuntimeDriver, network: Network, store: Store,
                 snapshots: SnapshotStore, package_cache=None):
        self.settings = settings
        #: The node's package cache (:class:`forkyard.pkgcache.PackageCache`), None when off.
        self.package_cache = package_cache
        self.driver = driver
        self.network = network
        self.store = store
        self.snapshots = snapshots
        self.capacity = Capacity.from_env()
        self.capacity.memory_in_use = driver.memory_in_use  # what sandboxes really use (overcommit)
        self.tombstones = Tombstones()
        hot = HotPaused(settings.hot_pause_s if not settings.cluster else 0, settings.hot_pause_max)
        self._table = table = SandboxTable(store, self.tombstones, hot)
        self.on_gone = table.on_gone
        # No keep-alive: a slot's outer address is reused by later sandboxes, and a
        # pooled connection to a dead sandbox would hang or fail the next one.
        self._http = http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self._cpu = CpuMeter(driver)
        self._gc = gc = ImageGC(settings, store, snapshots)
        self._slots = slots = SlotAllocator(table, network, settings.spare_slots,
                                            held_elsewhere=lambda: self.pool.slot_indexes())
        self._teardown = teardown = Teardown(settings, table, driver, network, snapshots, gc)
        self._starter = starter = Starter(settings, table, driver, network, snapshots, slots, teardown, http)
        self._creator = creator = Creator(settings, table, driver, network, snapshots, self.capacity, slots,
                                          starter, teardown, http)
        self.pool = creator.pool
        self._stager = stager = Stager(settings, driver, snapshots)
        self._pauser = pauser = Pauser(settings, table, driver, stager, teardown, http)
        self._resumer = Resumer(table, driver, snapshots, starter, teardown, gc, creator.admit, stager)
        self._snapshotter = Snapshotter(settings, table, stager, snapshots)
        self._forker = Forker(settings, table, snapshots, stager, starter, creator.admit)
        self._expiry = Expiry(settings, table, driver, self.pool, pauser, teardown, gc)
        self._reconciler = Reconciler(settings, table, driver, network, snapshots, stager, teardown, slots, gc, http)
        self._handover = Handover(settings, table, snapshots, teardown)
        #: E2B volumes (:mod:`forkyard.orchestrator.volumes`); starts bind-mount them.
        self.volumes = Volumes(settings.volumes_root, settings.volumes_dir, settings.max_volumes,
                               settings.volume_size_mb, legacy_db=settings.db_path)
        starter.volumes = creator.volumes = self.volumes
        creator.package_cache = package_cache
        self._ttl_task: asyncio.Task | None = None
        self._firewall_task: asyncio.Task | None = None

    # ---- startup / shutdown -------------------------------------------------------
    async def start(self) -> None:
        """Prepare the host, reconcile persisted sandboxes with what runs
        (:meth:`Reconciler.reconcile`), start the TTL loop, spare slots, the runtime's
        spares and the warm pool."""
        await asyncio.to_thread(self.network.setup_host)
        await asyncio.to_thread(self.volumes.mount_all)  # before reconcile resumes anything
        await self._reconciler.reconcile()
        self._ttl_task = asyncio.create_task(self._expiry.loop(), name="ttl")
        self._firewall_task = asyncio.create_task(self._firewall_loop(), name="firewall")
        self._slots.refill()
        await self.driver.prepare(self.settings.default_disk_mb)
        self.pool.refill()

    async def _firewall_loop(self) -> None:
        """Every :data:`FIREWALL_CHECK_S`, move forkyard's firewall rules back ahead of
        rules other software inserted later (:meth:`Network.ensure_jumps_first`)."""
        while True:
            await asyncio.sleep(self.FIREWALL_CHECK_S)
            try:
                await asyncio.to_thread(self.network.ensure_jumps_first)
            except Exception as e:  # noqa: BLE001 — retried at the next tick
                log.error("checking the firewall order failed: %s", e)

    async def stop(self) -> None:
        """Stop background work (pauses in flight are finished first). Running sandboxes
        are left running for re-adoption; pooled ones are destroyed (they belong to no
        one)."""
        table = self._table
        table.closing = True
        await self.pool.stop()
        if table.pending:
            await asyncio.wait(list(table.pending.values()), timeout=60)
        for sandbox_id in table.hot.ids():  # their images are committed: resumable after the restart
            await self._pauser.drop_hot(sandbox_id)
        await self._gc.wait(60)
        await self._slots.stop()  # finishes the slot it is building, then removes the spares
        await self.driver.shutdown()
        rows = self.store.all()
        used = {m["id"] for r in rows if r.state != "paused" for m in r.volume_mounts}
        await asyncio.to_thread(self.volumes.unmount_idle, used, {m["id"] for r in rows for m in r.volume_mounts})
        if self._firewall_task:
            self._firewall_task.cancel()
        if self._ttl_task:
            self._ttl_task.cancel()
            try:
                await self._ttl_task
            except asyncio.CancelledError:
                pass
        if not table.slots and not any(r.slot is not None for r in self.store.all()):
            # Nothing runs: the host's forwarding/NAT chains are not needed until the next start.
            try:
                await asyncio.to_thread(self.network.teardown_host)
            except Exception as e:  # noqa: BLE001
                log.warning("removing the host network chains failed: %s", e)
        await self._http.aclose()

    # ---- queries ------------------------------------------------------------------
    def get(self, sandbox_id: str) -> SandboxRecord:
        """See :meth:`SandboxTable.get` (raises NotFound, naming why a dead one died)."""
        return self._table.get(sandbox_id)

    def list(self) -> list[SandboxRecord]:
        """Every sandbox visible to clients (running or paused), oldest first."""
        return self._table.list()

    def target(self, sandbox_id: str, port: int) -> tuple[str, int]:
        """See :meth:`SandboxTable.target`: ``(host, port)`` the proxy connects to."""
        return self._table.target(sandbox_id, port)

    def proxy_rules(self, sandbox_id: str) -> tuple[str | None, str | None]:
        """``(traffic access token, Host mask)`` the proxy applies to user-port requests
        of a running sandbox (None, None when it has neither). In memory: filled when
        the sandbox starts, so a proxied request costs no database read."""
        return self._table.proxy_rules.get(sandbox_id, (None, None))

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
        :meth:`Capacity.in_use_mb`; shares restored pages: ``"forks"`` (fork children
        share their fork image's unchanged pages, the default), ``"all"`` (every
        restore) or ``false``, :attr:`RuntimeDriver.shared_pages`; package
        cache: :meth:`forkyard.pkgcache.PackageCache.describe`, None when it is off)."""
        counts = {"running": 0, "paused": 0}
        for r in self.list():
            if r.state in counts:
                counts[r.state] += 1
        return {"sandboxes": counts, "capacity": self.capacity.as_dict(),
                "memoryInUseMB": self.capacity.in_use_mb(self.list()),
                "sharesRestoredPages": self.driver.shared_pages or False,
                "spareSlots": self._slots.indexes(),
                "pausesInFlight": len(self._table.pending), "hotPaused": len(self._table.hot),
                "gcInFlight": self._gc.in_flight,
                "pool": self.pool.describe(), "poolSlots": sorted(self.pool.slot_indexes()),
                "poolSandboxes": self.pool.ids(), "spareDisks": self.driver.spare_mounts(),
                "packageCache": self.package_cache.describe() if self.package_cache is not None else None}

    # ---- for the cluster agent: the node's rows and what it reports ----------------
    @property
    def runtime_build(self) -> str:
        """The runtime build this node runs (:attr:`RuntimeDriver.build`; "" when
        unknown): nodes of a cluster must run the same one for images to move."""
        return self.driver.build

    def records(self) -> list[SandboxRecord]:
        """Every row, also of sandboxes being created or killed (:meth:`list` hides those)."""
        return self.store.all()

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        """The row of ``sandbox_id`` in whatever state, or None."""
        return self.store.get(sandbox_id)

    def on_record_change(self, listener) -> None:
        """Call ``listener(sandbox_id)`` after every write or delete of a row (on the
        writer's thread; it must be quick and never raise): a cluster node mirrors its
        rows to the cluster through it."""
        self.store.listeners.append(listener)

    @property
    def cache_bytes(self) -> int:
        """Bound of this node's image cache (bytes, ``FORKYARD_CACHE_BYTES``)."""
        return self.snapshots.cache.limit_bytes

    def cached_snapshots(self) -> list[str]:
        """Ids of the images this node's cache holds (placement prefers such a node for
        a restore of one)."""
        return self.snapshots.cache.image_ids()

    def repository_metrics(self) -> dict:
        """Snapshot repository and node-cache metrics (cache hits/misses, bytes fetched
        and uploaded, GC); see :meth:`SnapshotStore.metrics` for the shape."""
        return self.snapshots.metrics()

    def sandbox_for_file_signature(self, query: dict[str, str], operation: str) -> str | None:
        """The running sandbox whose envd access token produced ``query``'s v1 file-URL
        signature (the SDKs' ``download_url``/``upload_url`` of a secure sandbox:
        ``"v1_" + base64(sha256("path:operation:username:token[:expiration]"))``, e2b
        ``sandbox/signature.py``), or None. Such URLs carry no sandbox id when
        ``E2B_SANDBOX_URL`` is set; envd checks the signature again (and its expiry)."""
        sig = query.get("signature", "")
        if not sig.startswith("v1_") or len(sig) > 64:
            return None
        head = [query.get("path", ""), operation, query.get("username", "")]
        tail = [query["signature_expiration"]] if query.get("signature_expiration") else []
        for rec in self.store.all():
            if rec.envd_access_token is None or rec.id not in self._table.slots:
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
        try:
            self.get(sandbox_id)
        except NotFound:
            if (tomb := self.tombstones.get(sandbox_id)) is not None:  # (its row may still be "killing")
                return list(tomb.logs)
            raise
        return read_entries(self.settings.sandboxes_dir / sandbox_id / "console.log")

    async def metrics(self, sandbox_id: str) -> dict:
        """Usage of a running sandbox: envd's ``/metrics`` JSON (memory from the
        sandbox's own ``/proc/meminfo``, disk from ``statfs("/")``) with the CPU figures
        measured on the host (:class:`~forkyard.orchestrator.usage.CpuMeter`:
        ``cpu_used_pct`` 0-100 over the sandbox's CPU quota, ``cpu_count`` that quota)
        and the disk figures of ``statfs("/")`` inside (the sandbox's disk), else — an
        unbounded overlay (images of older runtimes) — from the host.

        Raises:
            NotFound: unknown or not running sandbox.
            CreateFailed: envd did not answer (500).
        """
        rec = self.get(sandbox_id)
        host, _ = self.target(sandbox_id, 0)
        try:
            m = await envd.get_json(self._http, host, "/metrics", rec.envd_access_token)
        except envd.EnvdError as e:
            raise CreateFailed(f"envd of sandbox {sandbox_id} did not answer /metrics: {e}") from e
        cpu = await self._cpu.percent(sandbox_id)
        if cpu is not None:
            m["cpu_used_pct"], m["cpu_count"] = cpu[0], max(1, round(cpu[1]))
        # envd's figures are statfs("/") inside, which shows the sandbox's disk (the
        # runtime bounds the writable layer at disk_mb), so `df /` inside and these agree.
        # Sandboxes restored from images of older runtimes report an unbounded overlay
        # there: take their disk (writable layer) from the host instead.
        if rec.disk_mb and 0 < int(m.get("disk_total") or 0) <= rec.disk_mb << 20:
            return m
        disk = await asyncio.to_thread(self.driver.disk_usage, self.settings.sandboxes_dir / sandbox_id)
        if disk is not None:
            m["disk_used"], m["disk_total"] = disk
        else:
            try:
                st = os.statvfs(self.settings.sandboxes_dir)
                m["disk_total"] = min(int(m.get("disk_total", 0)) or 1 << 62, st.f_blocks * st.f_frsize)
            except OSError:
                pass
        return m

    # ---- sandboxes ----------------------------------------------------------------
    async def create(self, template_id: str, timeout_s: int | None = None, metadata: dict[str, str] | None = None,
                     env_vars: dict[str, str] | None = None, auto_pause: bool | None = None, secure: bool = False,
                     vcpus: int | None = None, memory_mb: int | None = None, auto_resume: bool = False,
                     egress: EgressPolicy | None = None, public_traffic: bool = True, mask_host: str | None = None,
                     auto_pause_memory: bool | None = None, disk_mb: int | None = None,
                     volume_mounts: list[tuple[str, str]] | None = None) -> SandboxRecord:
        """Create and start a sandbox from a template or snapshot; the options and
        errors: :meth:`Creator.create`."""
        return await self._creator.create(
            template_id, timeout_s=timeout_s, metadata=metadata, env_vars=env_vars, auto_pause=auto_pause,
            secure=secure, vcpus=vcpus, memory_mb=memory_mb, auto_resume=auto_resume, egress=egress,
            public_traffic=public_traffic, mask_host=mask_host, auto_pause_memory=auto_pause_memory,
            disk_mb=disk_mb, volume_mounts=volume_mounts)

    async def kill(self, sandbox_id: str, only_if=None) -> None:
        """Kill a running or paused sandbox (:meth:`Teardown.kill`; raises NotFound)."""
        await self._teardown.kill(sandbox_id, only_if=only_if)

    async def set_network(self, sandbox_id: str, policy: EgressPolicy) -> SandboxRecord:
        """Replace a sandbox's egress policy (E2B ``PUT /sandboxes/{id}/network``): applied
        at once when it runs, and to the slot it keeps while hot-paused (its unfreeze is
        then filtered by the new rules: issue 25 item 4); stored for its next resume in any
        case (a cold resume or another node applies the record's policy to its new slot).

        Raises:
            NotFound: unknown sandbox.
        """
        table = self._table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            rec = table.get(sandbox_id)
            slot = table.slots.get(sandbox_id) or table.hot.slot(sandbox_id)
            if slot is not None:
                await asyncio.to_thread(self.network.set_egress, slot.index, policy)
            rec.egress = {} if policy.empty else policy.to_json()
            self.store.put(rec)
            return rec

    async def set_timeout(self, sandbox_id: str, timeout_s: int) -> SandboxRecord:
        """Set expiry to now + ``timeout_s`` (:meth:`Expiry.set_timeout`)."""
        return await self._expiry.set_timeout(sandbox_id, timeout_s)

    async def refresh(self, sandbox_id: str, duration_s: int | None) -> SandboxRecord:
        """Extend expiry to at least now + ``duration_s`` (:meth:`Expiry.refresh`)."""
        return await self._expiry.refresh(sandbox_id, duration_s)

    # ---- pause / resume -----------------------------------------------------------
    async def pause(self, sandbox_id: str, require_healthy: bool = False, only_if=None,
                    memory: bool = True) -> SandboxRecord:
        """Pause a running sandbox; behaviour and errors: :meth:`Pauser.pause`."""
        return await self._pauser.pause(sandbox_id, require_healthy=require_healthy, only_if=only_if, memory=memory)

    def pause_committed(self, rec: SandboxRecord) -> bool:
        """Whether paused ``rec``'s image is in the repository, so another node can
        resume it (:meth:`Pauser.committed`; True for anything not paused)."""
        return self._pauser.committed(rec)

    async def commit_staged_pauses(self) -> int:
        """Commit again the pause images a failed commit left staged on this node
        (:meth:`Pauser.commit_staged`); returns how many were committed."""
        return await self._pauser.commit_staged()

    async def resume(self, sandbox_id: str, timeout_s: int | None = None,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """Resume a paused sandbox under the same id (:meth:`Resumer.resume`)."""
        return await self._resumer.resume(sandbox_id, timeout_s, auto_pause)

    async def connect(self, sandbox_id: str, timeout_s: int, memory: bool | None = None) -> tuple[SandboxRecord, bool]:
        """E2B ``connect``: resume or extend; returns ``(record, resumed)`` (:meth:`Resumer.connect`)."""
        return await self._resumer.connect(sandbox_id, timeout_s, memory)

    async def wake(self, sandbox_id: str) -> bool:
        """Auto-resume on proxied traffic (:meth:`Resumer.wake`)."""
        return await self._resumer.wake(sandbox_id)

    # ---- snapshots and forks ------------------------------------------------------
    async def snapshot(self, sandbox_id: str, name: str | None = None, memory: bool = True) -> SnapshotMeta:
        """A reusable snapshot of a running sandbox (:meth:`Snapshotter.snapshot`)."""
        return await self._snapshotter.snapshot(sandbox_id, name, memory)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[SnapshotMeta]:
        """User-visible snapshots, oldest first, filtered by source sandbox / name."""
        return self._snapshotter.list_snapshots(sandbox_id, name)

    def delete_snapshot(self, ref: str) -> None:
        """Delete a user-visible snapshot (:meth:`Snapshotter.delete_snapshot`)."""
        self._snapshotter.delete_snapshot(ref)

    async def fork(self, sandbox_id: str, count: int = 1, timeout_s: int | None = None) -> list[SandboxRecord | Exception]:
        """Checkpoint once, restore ``count`` children (:meth:`Forker.fork`)."""
        return await self._forker.fork(sandbox_id, count, timeout_s)

    async def fork_export(self, sandbox_id: str, count: int, timeout_s: int | None = None
                          ) -> tuple[list[SandboxRecord | Exception], str]:
        """A fork whose image other nodes start children from (:meth:`Forker.fork_export`)."""
        return await self._forker.fork_export(sandbox_id, count, timeout_s)

    async def fork_children(self, image_id: str, count: int, timeout_s: int | None = None,
                            auto_pause: bool = True, egress: dict | None = None) -> list[SandboxRecord | Exception]:
        """Children of another node's fork image (:meth:`Forker.fork_children`)."""
        return await self._forker.fork_children(image_id, count, timeout_s, auto_pause, egress)

    # ---- cluster hand-over --------------------------------------------------------
    async def adopt(self, rec: SandboxRecord) -> SandboxRecord:
        """Take over a paused sandbox of another node (:meth:`Handover.adopt`)."""
        return await self._handover.adopt(rec)

    async def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox the cluster gave to another node (:meth:`Handover.forget`)."""
        await self._handover.forget(sandbox_id)

    async def delete_image(self, snapshot_id: str) -> bool:
        """Delete an exported ``fork`` image (:meth:`Handover.delete_image`)."""
        return await self._handover.delete_image(snapshot_id)
