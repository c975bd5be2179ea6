"""Starting a sandbox's runtime: fresh from its template, or restored from an image
(a checkpoint, or a filesystem-only image laid over the template), in a slot of its own,
until its envd answers and has its ``/init``.

Create, resume and fork all start sandboxes through :class:`Starter`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from dataclasses import dataclass

import httpx

from forkyard.config import Settings
from forkyard.guest import envd
from forkyard.ids import is_sandbox_id
from forkyard.network.base import Network
from forkyard.network.egress import EgressPolicy
from forkyard.obs import metrics
from forkyard.orchestrator import images
from forkyard.orchestrator.errors import Conflict, CreateFailed, NotFound, OrchestratorError
from forkyard.orchestrator.spare_slots import SlotAllocator
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.orchestrator.volumes.store import LeaseUnavailable, VolumeHeld
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore
from forkyard.runtime.base import RuntimeDriver, RuntimeMismatch, SandboxSpec

log = logging.getLogger("forkyard.orchestrator")

#: How long a start waits for envd to answer (s).
ENVD_READY_TIMEOUT_S = 20.0
#: Hostname every sandbox sees (E2B's).
HOSTNAME = "e2b.local"


@dataclass(eq=False, repr=False)
class Starter:
    """Starts sandboxes.

    Args:
        settings: ``sandboxes_dir`` (work directories), ``templates_dir``.
        table: the sandboxes (a started one is marked running there).
        driver: creates and restores runtimes.
        network: applies egress policies to slots (``set_egress``, blocking).
        snapshots: images in the repository / node cache.
        slots: slot allocation.
        teardown: removes what a failed start made.
        http: the client envd calls go through (no keep-alive: slot addresses are reused).
    """

    settings: Settings
    table: SandboxTable
    driver: RuntimeDriver
    network: Network
    snapshots: SnapshotStore
    slots: SlotAllocator
    teardown: Teardown
    http: httpx.AsyncClient

    #: E2B volumes (:class:`forkyard.orchestrator.volumes.store.Volumes`), set by the orchestrator.
    volumes = None

    def _volume_dirs(self, rec: SandboxRecord, wait_s: float = 0.0) -> list[tuple[Path, str]]:
        """``(host directory, guest path)`` of each of ``rec``'s volumes, mounted (in a
        cluster: once this node holds their leases, waiting up to ``wait_s`` for another
        node to give one back).

        Raises:
            CreateFailed: a volume is gone or cannot be mounted.
            VolumeHeld: another node mounts one (409); LeaseUnavailable (503).
        """
        out = []
        for m in rec.volume_mounts:
            try:
                out.append((self.volumes.ensure_mounted(self.volumes.get(m["id"]), wait_s), m["path"]))
            except (VolumeHeld, LeaseUnavailable):
                raise
            except OrchestratorError as e:
                raise CreateFailed(f"volume {m['name']!r} of sandbox {rec.id}: {e}") from e
        return out

    def fresh_workdir(self, sandbox_id: str) -> Path:
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

    async def start(self, rec: SandboxRecord, image: SnapshotMeta | None, old_token: str | None,
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
        tmpl = images.resolve(self.settings, rec.template_id)
        if tmpl is None:
            raise NotFound(f"template {rec.template_id!r} of sandbox {rec.id} not found")
        phases = {} if phases is None else phases
        t0 = time.perf_counter()
        self.table.starting += 1
        try:
            slot = await self.slots.alloc(rec)
            if rec.egress:  # before anything runs in the slot: no unfiltered moment
                await asyncio.to_thread(self.network.set_egress, slot.index, EgressPolicy.from_json(rec.egress))
            t1 = time.perf_counter()
            phases["slot"] = (t1 - t0) * 1000
            workdir = self.fresh_workdir(rec.id)
            spec = SandboxSpec(
                sandbox_id=rec.id, rootfs=tmpl.rootfs, network=slot.attachment,
                vcpus=rec.vcpus, memory_mb=rec.memory_mb, hostname=HOSTNAME, workdir=workdir,
                disk_mb=rec.disk_mb,
                # a resume or restore may follow a move: the old node gives the lease back soon
                volumes=await asyncio.to_thread(self._volume_dirs, rec,
                                                0.0 if image is None else self.settings.volume_lease_wait_s),
                fork_child=image is not None and image.kind == "fork",
            )
            # A filesystem-only image is a cold boot of the template with the saved
            # writable layer laid over it (new boot id; processes do not survive); a
            # checkpoint is a restore. The driver reads which from the image directory.
            restore_phases = phases if image is not None and image.memory else None
            if image is None:
                await self.driver.create(spec)
            elif image_dir is not None:
                await self.driver.create(spec, self.driver.image_at(image_dir), phases=restore_phases)
            else:
                # Materializes the image from the repository when this node lacks it.
                path = await asyncio.to_thread(self.snapshots.image, image.snapshot_id)
                if image.memory:
                    phases["image"] = (time.perf_counter() - t1) * 1000
                try:
                    await self.driver.create(spec, self.driver.image_at(path), phases=restore_phases)
                finally:
                    self.snapshots.release(image.snapshot_id)
            t2 = time.perf_counter()
            phases["runtime"] = (t2 - t1) * 1000
            cold = image is None or not image.memory
            if cold or old_token != rec.envd_access_token or rec.env_vars != image.env_vars:
                # A template build records its final USER and WORKDIR on its snapshot
                # (forkyard.templates.build); the record carries them on (rows from
                # before: the image's). A restored envd keeps its workdir in memory.
                user, workdir = images.guest_defaults(image)
                user = rec.default_user or user or "user"
                workdir = (rec.default_workdir or workdir) if cold else None
                # A cold-booted envd holds no token yet: nothing to prove.
                await envd.init(self.http, slot.outer_ip, env_vars=rec.env_vars, access_token=rec.envd_access_token,
                                current_token=None if cold else old_token, default_user=user,
                                default_workdir=workdir, wait_s=ENVD_READY_TIMEOUT_S)
            else:
                await envd.wait_healthy(self.http, slot.outer_ip, ENVD_READY_TIMEOUT_S)
            phases["envd"] = (time.perf_counter() - t2) * 1000
        except BaseException as e:
            log.warning("start of %s failed: %r", rec.id, e)
            await asyncio.shield(self.teardown.destroy(rec.id, rec.slot))
            rec.slot = None
            if isinstance(e, (CreateFailed, NotFound, VolumeHeld, LeaseUnavailable, asyncio.CancelledError)) \
                    or not isinstance(e, Exception):
                raise
            if isinstance(e, RuntimeMismatch):
                raise Conflict(f"sandbox {rec.id} cannot be restored here: {e}") from e
            if image is not None and image_dir is None and self.snapshots.get(image.snapshot_id) is None:
                raise NotFound(f"snapshot {image.snapshot_id} was deleted while sandbox {rec.id} was being restored from it") from e
            what = "restoring" if image else "creating"
            raise CreateFailed(f"{what} sandbox {rec.id} from {rec.template_id!r} failed: {str(e) or repr(e)}") from e
        finally:
            self.table.starting -= 1
        for name, ms in phases.items():  # Prometheus/tracing: slot, runtime, envd of this start
            metrics.observe_phase(name, ms / 1000)
        if forget_image:
            rec.image_id = None
        self.table.mark_running(rec, slot)
