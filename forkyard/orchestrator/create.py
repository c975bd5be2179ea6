"""Creating sandboxes: admission, a cold start from a template or snapshot, or a
hand-out from the warm pool (:mod:`forkyard.orchestrator.pool`, whose sandboxes are
booted and destroyed here).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from pathlib import Path

import httpx

from forkyard.config import ENVD_PORT, Settings
from forkyard.guest import envd
from forkyard.ids import new_sandbox_id
from forkyard.network.base import Network
from forkyard.network.egress import EgressPolicy
from forkyard.obs import metrics
from forkyard.orchestrator import images, timing
from forkyard.orchestrator.admission import Capacity
from forkyard.orchestrator.errors import BadRequest, CreateFailed, NotFound
from forkyard.orchestrator.volumes.store import check_mount_path
from forkyard.orchestrator.expiry import check_timeout
from forkyard.orchestrator.hot import available_memory_pct
from forkyard.orchestrator.pool import NotPoolable, Pooled, WarmPool
from forkyard.orchestrator.spare_slots import SlotAllocator
from forkyard.orchestrator.start import ENVD_READY_TIMEOUT_S, HOSTNAME, Starter
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.pkgcache import install_script
from forkyard.repository.snapshots import SnapshotStore
from forkyard.runtime.base import RuntimeDriver, SandboxSpec

log = logging.getLogger("forkyard.orchestrator")


class Creator:
    """Creates sandboxes and keeps the warm pool.

    Args:
        settings: node defaults (vCPUs, memory, disk), ``pool`` targets, ``cluster``.
        table: the sandboxes.
        driver: boots pooled sandboxes; says whether one still runs.
        network: applies egress policies (``set_egress``, blocking).
        snapshots: snapshots a create may start from.
        capacity: admission.
        slots: slots for pooled sandboxes.
        starter: starts created sandboxes.
        teardown: removes pooled sandboxes.
        http: the client envd calls go through.

    Attributes:
        pool: the warm pool (none in a cluster: the scheduler places by the capacity a
            node reports, and a node's pool would either be hidden from it or look like
            user sandboxes).
    """

    def __init__(self, settings: Settings, table: SandboxTable, driver: RuntimeDriver, network: Network,
                 snapshots: SnapshotStore, capacity: Capacity, slots: SlotAllocator, starter: Starter,
                 teardown: Teardown, http: httpx.AsyncClient):
        self.settings = settings
        self.table = table
        self.driver = driver
        self.network = network
        self.snapshots = snapshots
        self.capacity = capacity
        self.slots = slots
        self.starter = starter
        self.teardown = teardown
        self.http = http
        self.pool = WarmPool(
            targets={} if settings.cluster else dict(settings.pool),
            boot=self._pool_boot, destroy=self._pool_destroy,
            room=lambda vcpus, mem, held: capacity.fits(table.store.all(), vcpus, mem, 1, held),
            busy=lambda: table.starting > 0, available_pct=available_memory_pct,
            defaults=(settings.default_vcpu, settings.default_memory_mb), new_id=new_sandbox_id,
        )

    # ---- admission ----------------------------------------------------------------
    def admit(self, vcpus: int, memory_mb: int, count: int = 1) -> None:
        """Admission of ``count`` user sandboxes (:meth:`Capacity.check` over the user
        sandboxes); the warm pool yields to them (:meth:`_pool_yield`).

        Raises:
            AtCapacity: they do not fit beside the user sandboxes.
        """
        self.capacity.check(self.table.store.all(), vcpus, memory_mb, count)
        self._pool_yield(vcpus, memory_mb, count)

    def _pool_yield(self, vcpus: int, memory_mb: int, count: int = 1) -> None:
        """After admitting ``count`` user sandboxes of ``vcpus``/``memory_mb`` that have no
        row yet: drop pooled sandboxes until the pool fits beside every user sandbox."""
        if self.pool.enabled:
            self.pool.make_room(lambda held: self.capacity.fits(self.table.store.all(), vcpus, memory_mb, count, held))

    # ---- create -------------------------------------------------------------------
    @metrics.timed("create")
    async def create(
        self,
        template_id: str,
        timeout_s: int | None = None,
        metadata: dict[str, str] | None = None,
        env_vars: dict[str, str] | None = None,
        auto_pause: bool | None = None,
        secure: bool = False,
        vcpus: int | None = None,
        memory_mb: int | None = None,
        auto_resume: bool = False,
        egress: EgressPolicy | None = None,
        public_traffic: bool = True,
        mask_host: str | None = None,
        auto_pause_memory: bool | None = None,
        disk_mb: int | None = None,
        volume_mounts: list[tuple[str, str]] | None = None,
    ) -> SandboxRecord:
        """Create and start a sandbox from a template or a snapshot (id or name) and
        wait for envd.

        Args:
            timeout_s: seconds until expiry (1 … 86400; default 300).
            auto_pause: pause (True) or kill (False) at expiry; None: the node's
                ``default_auto_pause``, recorded as such (``auto_pause_default``).
            auto_pause_memory: False = that pause keeps the filesystem only (E2B
                ``autoPauseMemory``); None/True = a full memory pause.
            auto_resume: proxied traffic resumes the sandbox when paused
                (``Orchestrator.wake``).
            egress: outbound traffic policy, enforced from before the sandbox starts.
            public_traffic: False = user ports need the ``traffic_token`` generated here.
            mask_host: Host header for user-port requests (``${PORT}`` = the port).
            secure: generate an envd access token that clients must send (always
                done for snapshots whose source had one).
            disk_mb: disk size (MiB) instead of the template's or snapshot's (a template
                build's own ``diskSizeMB``); at least the snapshot's, within the node's
                bounds (:func:`forkyard.orchestrator.images.check_disk_mb`). Default: the
                snapshot's, else the template's, else ``FORKYARD_DISK_MB``.
            volume_mounts: E2B ``volumeMounts`` as ``(volume name, guest path)`` pairs
                (:func:`forkyard.orchestrator.volumes.store.check_mount_path`); never from the pool.

        Raises:
            NotFound: unknown template/snapshot.
            BadRequest: out-of-range timeout or disk size.
            CreateFailed: runtime or envd failure; everything half-made is removed.
        """
        timeout_s = check_timeout(timeout_s)
        tmpl = images.resolve(self.settings, template_id)
        snap = await asyncio.to_thread(self.snapshots.find, template_id) if tmpl is None else None
        if snap is None and tmpl is None:
            raise NotFound(f"template {template_id!r} not found")
        inherited = (snap.disk_mb if snap else tmpl.disk_mb) or self.settings.default_disk_mb
        if disk_mb is not None:
            try:
                images.check_disk_mb(self.settings, disk_mb)
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
            auto_pause=self.settings.default_auto_pause if auto_pause is None else auto_pause,
            auto_pause_default=auto_pause is None,
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
        rec.default_user, rec.default_workdir = images.guest_defaults(snap)
        if volume_mounts:
            base = tmpl if tmpl is not None else images.resolve(self.settings, rec.template_id)
            rec.volume_mounts = await asyncio.to_thread(self._resolve_volumes, volume_mounts,
                                                        base.rootfs if base is not None else None)
        old_token = snap.envd_access_token if snap else None
        if secure or old_token:
            rec.envd_access_token = secrets.token_urlsafe(24)
        store = self.table.store
        self.capacity.check(store.all(), rec.vcpus, rec.memory_mb)  # no await until put: atomic
        pooled = None
        if snap is None and not rec.volume_mounts and self._poolable(tmpl, vcpus, memory_mb, disk_mb):
            pooled = self.pool.take(tmpl.template_id, images.template_stamp(self.settings, tmpl.template_id))
            if pooled is not None:
                rec.id, rec.slot = pooled.sandbox_id, pooled.slot.index
        self._pool_yield(rec.vcpus, rec.memory_mb)
        store.put(rec)
        if pooled is not None:
            t0 = time.perf_counter()
            try:
                await self._handout(rec, pooled)
                self.pool.record(tmpl.template_id, hit=True)
                timing.record("pool", (time.perf_counter() - t0) * 1000)
                await self._configure_packages(rec)
                return rec
            except CreateFailed:
                store.delete(rec.id)  # cold below, under a new id
                rec.id, rec.slot = new_sandbox_id(), None
                store.put(rec)
            except BaseException:
                store.delete(rec.id)
                raise
        if tmpl is not None and snap is None and self.pool.pools(tmpl.template_id):
            self.pool.record(tmpl.template_id, hit=False)
        phases: dict[str, float] = {}
        try:
            await self.starter.start(rec, snap, old_token, phases=phases)
        except BaseException:
            store.delete(rec.id)
            raise
        for name, ms in phases.items():  # (observed in Prometheus by the start)
            timing.add(name, ms)
        await self._configure_packages(rec)
        return rec

    #: The node's package cache (:class:`forkyard.pkgcache.PackageCache`) when it runs
    #: one (``FORKYARD_PACKAGE_CACHE=on``), set by the orchestrator; None: off.
    package_cache = None

    async def _configure_packages(self, rec: SandboxRecord) -> None:
        """Point ``pip``, ``npm`` and ``apt`` of new sandbox ``rec`` at the package cache
        (its configuration files, :func:`forkyard.pkgcache.install_script`, for the
        services that answer now): one root command through envd. Nothing with the cache
        off. A failure is logged, not raised: the sandbox works, fetching as without the
        cache."""
        cache = self.package_cache
        if cache is None:
            return
        files = cache.guest_files()
        if not files:
            return
        tail: list[str] = []
        try:
            host, _ = self.table.target(rec.id, ENVD_PORT)
            rc = await envd.run(self.http, host, install_script(files), user="root", cwd="/", timeout_s=30,
                                access_token=rec.envd_access_token, on_line=lambda s, line: tail.append(line))
        except Exception as e:  # noqa: BLE001 — the sandbox itself is fine
            log.warning("package cache: configuring sandbox %s failed: %s", rec.id, e)
            return
        if rc != 0:
            log.warning("package cache: configuring sandbox %s failed (exit code %s): %s", rec.id, rc,
                        tail[-1][:200] if tail else "")

    #: E2B volumes (:class:`forkyard.orchestrator.volumes.store.Volumes`), set by the orchestrator.
    volumes = None

    def _resolve_volumes(self, mounts: list[tuple[str, str]], rootfs: Path | None) -> list[dict]:
        """``[{"id", "name", "path"}]`` of ``mounts`` into a sandbox of template
        ``rootfs`` (:func:`forkyard.orchestrator.volumes.store.check_mount_path`).

        Raises:
            BadRequest: an unknown volume, a bad or repeated path.
        """
        out, paths = [], set()
        for name, path in mounts:
            path = check_mount_path(path, rootfs)
            if path in paths:
                raise BadRequest(f"volumeMounts: path {path!r} is given twice")
            paths.add(path)
            try:
                vol = self.volumes.by_name(name) if isinstance(name, str) else None
            except NotFound:
                vol = None
            if vol is None:
                raise BadRequest(f"volumeMounts: volume {name!r} not found")
            out.append({"id": vol.id, "name": vol.name, "path": path})
        return out

    # ---- the warm pool ------------------------------------------------------------
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
        a start does (expiry from now).

        Raises:
            CreateFailed: it died meanwhile or envd refused ``/init``; the pooled
                sandbox is destroyed (the caller falls back to a cold create).
        """
        self.table.starting += 1
        try:
            if not await self.driver.alive(e.sandbox_id):
                raise CreateFailed(f"pooled sandbox {e.sandbox_id} is no longer running")
            if rec.egress:  # before anything of the caller's runs in it
                await asyncio.to_thread(self.network.set_egress, e.slot.index, EgressPolicy.from_json(rec.egress))
            await envd.init(self.http, e.slot.outer_ip, env_vars=rec.env_vars, access_token=rec.envd_access_token,
                            default_user="user")
        except BaseException as err:
            log.warning("hand-out of pooled sandbox %s failed: %r", e.sandbox_id, err)
            await asyncio.shield(self._pool_destroy(e))
            if isinstance(err, Exception) and not isinstance(err, CreateFailed):
                raise CreateFailed(f"hand-out of pooled sandbox {e.sandbox_id} failed: {err!r}") from err
            raise
        finally:
            self.table.starting -= 1
        self.table.mark_running(rec, e.slot)

    async def _pool_boot(self, e: Pooled) -> None:
        """Boot pooled sandbox ``e`` as a cold create of its template would (node default
        vCPUs, memory and disk, hostname, a slot of its own) until envd answers
        ``/health``; no ``/init`` is sent (that is the hand-out's).

        Raises:
            NotPoolable: the template is not a rootfs template built here.
            Exception: the runtime, the network or envd failed (everything made is removed).
        """
        tmpl = images.resolve(self.settings, e.template_id)
        if tmpl is None:
            raise NotPoolable(f"no rootfs template {e.template_id!r} is built on this node")
        e.stamp = images.template_stamp(self.settings, e.template_id)

        def note(index: int) -> None:
            e.slot_index = index

        try:
            slot = await self.slots.reserve(note)
            e.slot = slot
            workdir = self.starter.fresh_workdir(e.sandbox_id)
            spec = SandboxSpec(
                sandbox_id=e.sandbox_id, rootfs=tmpl.rootfs, network=slot.attachment,
                vcpus=e.vcpus, memory_mb=e.memory_mb, hostname=HOSTNAME, workdir=workdir,
                disk_mb=tmpl.disk_mb or self.settings.default_disk_mb,  # as a cold create's
            )
            await self.driver.create(spec)
            await envd.wait_healthy(self.http, slot.outer_ip, ENVD_READY_TIMEOUT_S)
            await self.driver.alive(e.sandbox_id)  # caches its pid: the hand-out's check is a kill(0)
        except BaseException:
            await asyncio.shield(self._pool_destroy(e))
            raise

    async def _pool_destroy(self, e: Pooled) -> None:
        """Remove pooled sandbox ``e``: runtime, slot, workdir. Never raises."""
        await self.teardown.destroy(e.sandbox_id, e.slot_index)
        e.slot_index = None
