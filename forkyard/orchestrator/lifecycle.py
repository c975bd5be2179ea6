"""Pause, resume, snapshot and fork (mixed into :class:`Orchestrator`).

State machine (shared/DESIGN.md §4), each transition persisted before it acts:

* running → pausing → paused (checkpoint that stops the sandbox, image staged; the
  reply goes out here) → background: image committed as a ``pause`` snapshot, stopped
  runtime destroyed, slot freed → resuming → running (restore, same id);
* hot pause (:mod:`forkyard.orchestrator.hot`): running → pausing (freeze, then
  ``checkpoint --leave-running`` of the frozen sandbox) → paused, the frozen runtime kept
  with its slot → running by unfreezing it, or dropped later (the image committed as
  above is then what resume restores);
* running → snapshotting → running (``checkpoint --leave-running``; ``snapshot``);
* running → forking → running, plus ``count`` children creating → running, each
  restored from one staged image taken once (never committed: nothing needs it after).

Commit of every image goes through :class:`~forkyard.repository.snapshots.SnapshotStore`
(staging → fsync → rename), so a crash never leaves a half-written snapshot visible.
Pause images that no sandbox needs any more are deleted at once (a restore reads the
whole image; measured: deleting it afterwards does not affect the restored sandbox).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from pathlib import Path

from forkyard.ids import is_name, new_sandbox_id
from forkyard.obs import metrics
from forkyard.orchestrator import envd_client, timing
from forkyard.orchestrator.holds import hold
from forkyard.orchestrator.errors import BadRequest, Conflict, CreateFailed, NotFound, Unavailable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.runtime.base import ExportTooLarge
from forkyard.repository.errors import RepositoryError
from forkyard.repository.snapshots import ROOTFS_TAR, SnapshotMeta, new_snapshot_id
from forkyard.templates import registry

log = logging.getLogger("forkyard.orchestrator")

#: Metadata keys recording a fork child's lineage.
PARENT_KEY = "forkyard.parentSandboxID"
SNAPSHOT_KEY = "forkyard.snapshotID"
#: E2B fork limits (``POST /sandboxes/{id}/fork``): count 1…100 (default 1), timeout default 15 s.
MAX_FORKS = 100
FORK_DEFAULT_TIMEOUT_S = 15
#: Parallel restores during a fork (``FORKYARD_FORK_PARALLELISM``). Measured on 2 cores,
#: fork ×16: 4 → ~1.91 s, 8 → ~1.77–1.99 s, 16 → ~1.80 s (bench/bench_lifecycle.py).
FORK_PARALLELISM = int(os.environ.get("FORKYARD_FORK_PARALLELISM", "16"))
#: File in a pause's staging directory: the checkpoint finished, the image is complete.
PAUSE_MARKER = "checkpointed"


#: Metadata keys a template build leaves on its snapshot (forkyard.templates.build).
DEFAULT_USER_KEY = "forkyard.defaultUser"
DEFAULT_WORKDIR_KEY = "forkyard.defaultWorkdir"
#: Metadata key a template build puts on its sandbox and so on the snapshot it commits
#: (named after the template): such a snapshot *is* the template, not a user snapshot.
TEMPLATE_KEY = "forkyard.template"


def is_template_build(meta: SnapshotMeta) -> bool:
    """True when ``meta`` is a built template's own snapshot (kept out of the snapshot
    API: deleting it would delete the template)."""
    name = meta.metadata.get(TEMPLATE_KEY)
    return bool(name) and name in meta.names


def guest_defaults(image: SnapshotMeta | None) -> tuple[str | None, str | None]:
    """``(default user, default workdir)`` of envd in sandboxes started from ``image``:
    its recorded source defaults, else a template build's metadata, else ``(None, None)``."""
    if image is None:
        return None, None
    return (image.default_user or image.metadata.get(DEFAULT_USER_KEY),
            image.default_workdir or image.metadata.get(DEFAULT_WORKDIR_KEY))


def staged_memory(staging: Path) -> bool:
    """Whether the image staged under ``staging`` is a checkpoint (True) or a
    filesystem-only image (False: it holds :data:`ROOTFS_TAR`, or its temporary name)."""
    image = staging / "image"
    return not ((image / ROOTFS_TAR).exists() or (image / f"{ROOTFS_TAR}.tmp").exists())


class FsImageTooLarge(Conflict):
    """A filesystem-only pause/snapshot was refused: its image would be too large to
    resume (409); the sandbox keeps running."""


class LifecycleMixin:
    """Pause/resume/snapshot/fork; relies on the Orchestrator's store, driver,
    snapshots, locks and ``_start``/``_teardown``/``_gc_images``."""

    # ---- helpers --------------------------------------------------------------------
    def _running(self, sandbox_id: str) -> SandboxRecord:
        rec = self.get(sandbox_id)
        if rec.state == "paused":
            raise Conflict(f"sandbox {sandbox_id} is paused")
        if rec.state != "running":
            raise Conflict(f"sandbox {sandbox_id} is busy ({rec.state}); retry shortly")
        return rec

    def _meta_for(self, rec: SandboxRecord, kind: str, snapshot_id: str,
                  names: list[str] | None = None, memory: bool = True) -> SnapshotMeta:
        """The :class:`SnapshotMeta` an image of ``rec`` is committed under (``memory``
        False: a filesystem-only image)."""
        return SnapshotMeta(
            snapshot_id=snapshot_id, kind=kind, template_id=rec.template_id, source_sandbox_id=rec.id,
            vcpus=rec.vcpus, memory_mb=rec.memory_mb, env_vars=dict(rec.env_vars),
            metadata=dict(rec.metadata), names=list(names or []),
            envd_access_token=rec.envd_access_token, parent_image_id=rec.metadata.get(SNAPSHOT_KEY),
            memory=memory, default_user=rec.default_user, default_workdir=rec.default_workdir,
            disk_mb=rec.disk_mb,
        )

    async def _stage(self, rec: SandboxRecord, snapshot_id: str, stop: bool = False) -> Path:
        """``runsc checkpoint`` of ``rec`` into a fresh staging directory (image in
        ``<it>/image``): ``--leave-running`` unless ``stop`` (pause: the sandbox stops
        once the image is complete; the stopped runtime is left for :meth:`_teardown`).
        Records the ``checkpoint`` phase (ms) for ``Server-Timing`` — the time the
        sentry holds the sandbox's tasks stopped.

        Raises:
            CreateFailed: staging or runsc failed; the staging directory is removed.
        """
        t0 = time.perf_counter()
        try:
            staging = self.snapshots.staging(snapshot_id)
            await self.driver.checkpoint(rec.id, staging / "image", leave_running=not stop, keep_stopped=stop)
        except BaseException as e:
            self.snapshots.discard(self.snapshots.staging_path(snapshot_id))
            if isinstance(e, Exception):
                raise CreateFailed(f"checkpoint of sandbox {rec.id} failed: {e}") from e
            raise
        timing.record("checkpoint", (time.perf_counter() - t0) * 1000)
        return staging

    def fs_image_limit(self, rec: SandboxRecord) -> int:
        """Largest filesystem-only image of ``rec`` (bytes) that a cold boot can lay back:
        ``settings.fs_image_memory_fraction`` of its memory (runsc lays the tar back
        inside the sandbox's memory limit; measured at 512 MiB: 100 MiB resumed, 150 MiB
        was OOM-killed at boot), and at most 90 % of its disk (sparse files come back
        fully allocated)."""
        limit = int(rec.memory_mb * self.settings.fs_image_memory_fraction) << 20
        if rec.disk_mb:
            limit = min(limit, (rec.disk_mb * 9 // 10) << 20)
        return max(limit, 1 << 20)

    @staticmethod
    def _too_large(rec: SandboxRecord, limit: int, size: int, detail: str) -> str:
        return (f"filesystem-only pause needs the changed files ({detail}; sparse files count at their full "
                f"size) to fit in {limit >> 20} MiB (part of the sandbox's {rec.memory_mb} MiB memory: resume "
                "lays them back inside it); pause with memory instead (the sandbox keeps running)")

    async def _stage_fs(self, rec: SandboxRecord, snapshot_id: str, thaw: bool) -> Path:
        """Filesystem-only image of ``rec`` into a fresh staging directory
        (``<it>/image/`` :data:`ROOTFS_TAR`): the sandbox is frozen, its writable layer
        exported, and — when ``thaw`` (snapshot) — continued; a pause leaves it frozen
        for :meth:`_teardown`. Records ``scan`` (the look for files too large, see
        :meth:`fs_image_limit`), ``freeze`` and ``export`` (ms) for
        ``Server-Timing``.

        Raises:
            FsImageTooLarge: the image would exceed :meth:`fs_image_limit` (409); the
                sandbox runs on (thawed), nothing is kept.
            CreateFailed: the runtime failed; the staging directory is removed and the
                sandbox runs on (thawed).
        """
        limit = self.fs_image_limit(rec)
        # One file above the bound: the export itself reads it whole into the sandbox's
        # memory (a 1 GiB sparse file got the sandbox OOM-killed), so refuse first.
        t_scan = time.perf_counter()
        big = await self.driver.large_changed_files(rec.id, limit)
        timing.record("scan", (time.perf_counter() - t_scan) * 1000)
        if big:
            name, size = max(big, key=lambda b: b[1])
            raise FsImageTooLarge(self._too_large(rec, limit, size, f"{name} alone is {size >> 20} MiB"))
        t0 = time.perf_counter()
        frozen = False
        try:
            staging = self.snapshots.staging(snapshot_id)
            await self.driver.freeze(rec.id)  # a consistent cut: nothing writes meanwhile
            frozen = True
            t1 = time.perf_counter()
            timing.record("freeze", (t1 - t0) * 1000)
            size = await self.driver.export_rootfs(rec.id, staging / "image" / ROOTFS_TAR, max_bytes=limit)
            timing.record("export", (time.perf_counter() - t1) * 1000)
            metrics.FS_IMAGE_BYTES.observe(size)
        except BaseException as e:
            self.snapshots.discard(self.snapshots.staging_path(snapshot_id))
            if frozen:
                await self._thaw_quietly(rec.id)
            if isinstance(e, ExportTooLarge):
                raise FsImageTooLarge(self._too_large(rec, limit, e.size, f"over {e.size >> 20} MiB")) from e
            if isinstance(e, Exception):
                raise CreateFailed(f"filesystem export of sandbox {rec.id} failed: {e}") from e
            raise
        if thaw:
            await self._thaw_quietly(rec.id)
        return staging

    async def _commit(self, staging: Path, meta: SnapshotMeta, keep_on_error: bool = False) -> SnapshotMeta:
        """Commit a staged image to the repository (in a thread); records ``commit`` (ms).

        Raises:
            RepositoryError: the repository failed (503); the staging directory is
                removed unless ``keep_on_error``.
            CreateFailed: local I/O failed; likewise.
        """
        t0 = time.perf_counter()
        try:
            meta = await asyncio.to_thread(self.snapshots.commit, staging, meta)
        except BaseException as e:
            if not keep_on_error:
                self.snapshots.discard(staging)
            if isinstance(e, RepositoryError):
                raise  # the API answers 503: the repository, not the sandbox, failed
            if isinstance(e, Exception):
                raise CreateFailed(f"commit of snapshot {meta.snapshot_id} failed: {e}") from e
            raise
        timing.record("commit", (time.perf_counter() - t0) * 1000)
        return meta

    async def _settle(self, sandbox_id: str) -> None:
        """Wait until a pause's background commit/teardown of ``sandbox_id`` is done
        (its outcome is already in the store); call with the sandbox's lock held."""
        task = self._pending.get(sandbox_id)
        if task is not None:
            await asyncio.wait([task])

    # ---- pause / resume ---------------------------------------------------------------
    @metrics.timed("pause")
    async def pause(self, sandbox_id: str, require_healthy: bool = False, only_if=None,
                    memory: bool = True) -> SandboxRecord:
        """Checkpoint memory + filesystem, stop the sandbox and free its CPU, memory and
        network slot; the id, metadata and settings stay.

        One ``runsc checkpoint`` (without ``--leave-running``): the sentry stops every
        task, writes the image and only then ends the sandbox, so nothing runs past the
        checkpoint. The answer goes out once the image is on local disk; committing it
        to the repository and removing the stopped runtime continue in the background
        (:meth:`_finish_pause`; resume, kill and shutdown wait for them).

        Crash-safe order: persist ``pausing``; checkpoint into staging (runsc runs in
        its own session and finishes even if the server dies); mark the staged image
        complete; persist ``paused``; commit; destroy. Restart waits for a checkpoint
        still running, then: sandbox still running → running (the checkpoint failed);
        stopped with a staged image → committed, paused (see
        :meth:`Orchestrator._commit_interrupted_pauses`). A commit that fails leaves the
        image staged on this node; resume and restart commit it again, and resume
        restores from the staged copy if the repository still refuses.

        With ``require_healthy`` (E2B ``requireHealthyGuest``) envd must answer
        ``/health`` within 2 s first, else :class:`Unavailable` (503) and the sandbox
        keeps running. ``only_if`` (``f(sandbox_id) -> bool``, checked under the lock)
        lets expiry back off when the sandbox was extended meanwhile.

        In a cluster (``settings.cluster``) the answer waits for the commit too, so the
        sandbox can resume on any node even if this one dies right after.

        ``memory`` False (E2B ``memory: false``, SDK ``mode="filesystem"``): a
        filesystem-only pause. The sandbox is frozen and its writable layer exported
        (:meth:`_stage_fs`, no checkpoint); the image is a ``pause`` snapshot with
        ``memory`` False, committed and the frozen runtime destroyed as above. Resume
        cold-boots the template with those files laid over it: same id, token, env vars,
        metadata and egress policy; a new boot id; no processes; ``/tmp`` and
        ``/dev/shm`` (tmpfs mounts, not the rootfs) start empty. Hot pause never
        applies to it (nothing would be kept to resume).

        Hot pause (``settings.hot_pause_s`` > 0, not in a cluster): the sandbox is frozen
        first and checkpointed with ``--leave-running`` (it stays frozen); the frozen
        runtime and its slot are kept so resume is an unfreeze, until dropped
        (:mod:`forkyard.orchestrator.hot`). Durability is the same: the image is
        committed in the background either way.

        Raises:
            NotFound: unknown sandbox (or it had died; it is removed).
            Conflict: already paused (409, as E2B) or busy.
            FsImageTooLarge: ``memory`` False and the changed files exceed
                :meth:`fs_image_limit` (409); the sandbox keeps running.
            Unavailable: ``require_healthy`` and envd did not answer.
            CreateFailed: runsc failed; the sandbox keeps running.
        """
        async with self._locks[sandbox_id]:
            if only_if is not None and not only_if(sandbox_id):
                return self.get(sandbox_id)
            rec = self._running(sandbox_id)
            if require_healthy:
                try:
                    await envd_client.wait_healthy(self._http, self.target(sandbox_id, 0)[0], 2.0)
                except TimeoutError as e:
                    raise Unavailable(f"envd of sandbox {sandbox_id} does not answer; not paused (it keeps running)") from e
            sid = new_snapshot_id()
            rec.state, rec.image_id = "pausing", sid
            self.store.put(rec)
            self._stopping.add(rec.id)  # the proxy answers "not running" from now on
            hot = memory and self._hot.enabled and await self._freeze(rec.id)
            try:
                await hold("pause.before-checkpoint", rec.id)
                try:
                    if memory:
                        staging = await self._stage(rec, sid, stop=not hot)
                    else:
                        staging = await self._stage_fs(rec, sid, thaw=False)
                except FsImageTooLarge:
                    rec.state, rec.image_id = "running", None  # thawed; nothing was kept
                    self.store.put(rec)
                    raise
                except CreateFailed as e:
                    if hot:
                        await self._thaw_quietly(rec.id)
                    try:
                        alive = await self.driver.is_running(rec.id)
                    except Exception:  # noqa: BLE001 — treat as dead
                        alive = False
                    if not alive:
                        log.error("sandbox %s is not running after a failed pause; removing it", rec.id)
                        await self._teardown(rec.id, rec.slot)
                        self.store.delete(rec.id)
                        raise NotFound(f"sandbox {rec.id} had stopped (its init exited or it ran out of memory) and was removed") from e
                    rec.state, rec.image_id = "running", None
                    self.store.put(rec)
                    raise CreateFailed(f"pause of sandbox {rec.id} failed: {e}") from e
                await hold("pause.checkpointed", rec.id)
                try:
                    (staging / PAUSE_MARKER).touch()
                except OSError as e:  # the sandbox has stopped: go on; a restart infers the marker
                    log.error("pause of %s: writing the checkpoint marker failed: %s", rec.id, e)
                # The slot stays recorded (and allocated) until the stopped runtime is gone.
                rec.state, rec.paused_at = "paused", time.time()
                self.store.put(rec)
                slot = self._slots.pop(rec.id, None)
                keep = hot and slot is not None
                if keep:
                    self._hot.keep(rec.id, slot)
                    await self._notify_gone(rec.id)  # open streams end, as for a stopping checkpoint
                meta = self._meta_for(rec, "pause", sid, memory=memory)
                task = self._pending[rec.id] = asyncio.create_task(
                    self._finish_pause(rec.id, staging, meta, rec.slot, keep_runtime=keep), name=f"pause-{rec.id}")
                if self.settings.cluster:
                    # Another node may have to resume it if this one dies next: answer only
                    # once the image is in the shared repository.
                    await asyncio.shield(task)
                return rec
            finally:
                self._stopping.discard(rec.id)

    async def _freeze(self, sandbox_id: str) -> bool:
        """Freeze a sandbox about to be hot-paused (records ``freeze``, ms). False when
        the runtime cannot: the pause then stops the sandbox as usual."""
        t0 = time.perf_counter()
        try:
            await self.driver.freeze(sandbox_id)
        except Exception as e:  # noqa: BLE001 — NotImplementedError included
            log.warning("hot pause of %s: freeze failed (%s); pausing without keeping it", sandbox_id, e)
            return False
        timing.record("freeze", (time.perf_counter() - t0) * 1000)
        return True

    async def _thaw_quietly(self, sandbox_id: str) -> None:
        try:
            await self.driver.thaw(sandbox_id)
        except Exception as e:  # noqa: BLE001 — the caller's liveness check decides
            log.error("thaw of %s after a failed pause failed: %s", sandbox_id, e)

    async def _finish_pause(self, sandbox_id: str, staging: Path, meta: SnapshotMeta,
                            slot_index: int | None, keep_runtime: bool = False) -> None:
        """Background half of :meth:`pause`: commit the staged image (kept staged when
        that fails), then destroy the stopped runtime and release its slot — unless
        ``keep_runtime`` (hot pause: the frozen sandbox stays until dropped)."""
        try:
            await hold("pause.before-commit", sandbox_id)
            try:
                await self._commit(staging, meta, keep_on_error=True)
            except Exception as e:  # noqa: BLE001
                log.error("pause of %s: commit failed (%s); its image stays staged on this node "
                          "and is committed again on resume or restart", sandbox_id, e)
            if keep_runtime:
                return
            await self._teardown(sandbox_id, slot_index)
            cur = self.store.get(sandbox_id)
            if cur is not None and cur.state == "paused":
                cur.slot = None
                self.store.put(cur)
        except Exception as e:  # noqa: BLE001 — a background task must not die silently
            log.error("finishing the pause of %s failed: %s", sandbox_id, e)
        finally:
            self._pending.pop(sandbox_id, None)

    async def _pause_image(self, rec: SandboxRecord) -> tuple[SnapshotMeta, Path | None]:
        """Where to resume ``rec`` from: ``(meta, None)`` for its committed pause image,
        or ``(meta, staged image dir)`` when its commit failed and the image is still
        staged on this node (restored from there: once the sandbox runs again the
        image is garbage, so nothing is left to commit).

        Raises:
            CreateFailed: neither a committed nor a staged image exists.
            RepositoryError: the repository failed (the API answers 503).
        """
        staging = self.snapshots.staging_path(rec.image_id or "-")
        if rec.image_id and (staging / PAUSE_MARKER).is_file():
            log.warning("resuming %s from its image staged on this node", rec.id)
            return (self._meta_for(rec, "pause", rec.image_id, memory=staged_memory(staging)),
                    staging / "image")
        image = await asyncio.to_thread(self.snapshots.get, rec.image_id or "")
        if image is None:
            raise CreateFailed(f"paused state of sandbox {rec.id} is missing from the repository")
        return image, None

    @metrics.timed("resume")
    async def resume(self, sandbox_id: str, timeout_s: int | None = None,
                     auto_pause: bool | None = None) -> SandboxRecord:
        """Restore a paused sandbox under the same id; processes, memory and files
        continue. Expiry is reset to now + ``timeout_s`` (default: its last timeout);
        ``auto_pause`` (when given) replaces its expiry action — only if it resumes.

        Raises:
            NotFound: unknown sandbox.
            Conflict: already running (409, as E2B) or busy.
            CreateFailed: restore failed; the sandbox stays paused.
        """
        if timeout_s is not None:
            timeout_s = self._check_timeout(timeout_s)
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            rec = self.get(sandbox_id)
            if rec.state == "running":
                raise Conflict(f"sandbox {sandbox_id} is already running")
            if rec.state != "paused":
                raise Conflict(f"sandbox {sandbox_id} is busy ({rec.state}); retry shortly")
            rec = await self._resume_locked(rec, timeout_s, auto_pause)
        self._gc_images_later()
        return rec

    async def _resume_locked(self, rec: SandboxRecord, timeout_s: int | None,
                             auto_pause: bool | None) -> SandboxRecord:
        # AtCapacity: it stays paused (a kept frozen copy stays kept). Kept copies are
        # not counted as holding memory: they are dropped first when memory runs low.
        self._admit(rec.vcpus, rec.memory_mb)
        if timeout_s is not None:
            rec.timeout_s = timeout_s
        if auto_pause is not None:
            rec.auto_pause = auto_pause
        image_id = rec.image_id
        if await self._unfreeze(rec):
            marked = self.snapshots.staging_path(image_id or "-")
            staged = marked / "image" if image_id and (marked / PAUSE_MARKER).is_file() else None
        else:
            t0 = time.perf_counter()
            image, staged = await self._pause_image(rec)
            t1 = time.perf_counter()
            timing.record("lookup", (t1 - t0) * 1000)
            # Persisted with the slot (the start's first write, before anything runs): a
            # crash before it leaves the row paused, which is what it still is then.
            rec.state = "resuming"
            phases: dict[str, float] = {}
            try:
                # The row written running also drops the pause image (one write, not two).
                await self._start(rec, image, rec.envd_access_token, image_dir=staged, phases=phases,
                                  forget_image=True)
                # "boot": a cold boot over a filesystem-only image; "restore": a checkpoint.
                timing.record("restore" if image.memory else "boot", (time.perf_counter() - t1) * 1000)
                for name, ms in phases.items():  # observed in Prometheus by _start
                    timing.add(name, ms)
            except BaseException:
                rec.state, rec.slot, rec.image_id = "paused", None, image_id
                self.store.put(rec)
                raise
        if staged is not None:
            self.snapshots.discard(staged.parent)
        if image_id:
            self._garbage.add(image_id)
        return rec

    async def _unfreeze(self, rec: SandboxRecord) -> bool:
        """Resume ``rec`` by unfreezing its kept runtime (hot pause; records ``thaw``,
        ms) and persist it running, its pause image forgotten. False when none is kept
        or the unfreeze failed (the kept runtime is then destroyed and the caller
        restores from the image)."""
        slot = self._hot.take(rec.id)
        if slot is None:
            return False
        t0 = time.perf_counter()
        try:
            await self.driver.thaw(rec.id)
        except Exception as e:  # noqa: BLE001
            log.warning("unfreezing %s failed (%s); restoring it from its image", rec.id, e)
            await self._teardown(rec.id, slot.index)
            rec.slot = None
            self.store.put(rec)
            return False
        timing.record("thaw", (time.perf_counter() - t0) * 1000)
        self._slots[rec.id] = slot
        now = time.time()
        rec.state, rec.slot, rec.paused_at, rec.image_id = "running", slot.index, None, None
        rec.started_at, rec.end_at = now, now + rec.timeout_s
        self.store.put(rec)
        return True

    async def connect(self, sandbox_id: str, timeout_s: int, memory: bool | None = None) -> tuple[SandboxRecord, bool]:
        """E2B ``connect``: resume a paused sandbox (expiry now + ``timeout_s``) or
        extend a running one's expiry to at least now + ``timeout_s`` (never shorten).
        Waits for a pause, resume, snapshot or fork in progress, so concurrent connects
        all see the result. Returns ``(record, resumed)``.

        ``memory`` False (E2B connect ``memory: false``, SDK ``on_resume="reboot"``):
        a no-op for a running sandbox or one paused filesystem-only; refused (400) for
        one paused with memory — forkyard cannot cold-boot from a memory checkpoint.

        Raises:
            NotFound, BadRequest (timeout; ``memory`` False on a memory pause),
            CreateFailed (restore failed; stays paused).
        """
        timeout_s = self._check_timeout(max(timeout_s, 1))
        async with self._locks[sandbox_id]:
            await self._settle(sandbox_id)
            rec = self.get(sandbox_id)
            if rec.state == "paused" and memory is False and await self._paused_with_memory(rec):
                raise BadRequest(f"sandbox {sandbox_id} was paused with its memory; a reboot from a memory "
                                 "snapshot (connect memory: false) is not supported by forkyard: connect "
                                 "without it to restore the memory snapshot")
            if rec.state == "paused":
                rec = await self._resume_locked(rec, timeout_s, None)
                resumed = True
            else:
                if rec.end_at < time.time() + timeout_s:
                    rec.end_at = time.time() + timeout_s
                    rec.timeout_s = timeout_s
                    self.store.put(rec)
                resumed = False
        if resumed:
            self._gc_images_later()
        return rec, resumed

    async def _paused_with_memory(self, rec: SandboxRecord) -> bool:
        """Whether paused ``rec`` resumes from a memory checkpoint (True) or cold-boots
        from a filesystem-only image (False)."""
        staging = self.snapshots.staging_path(rec.image_id or "-")
        if rec.image_id and (staging / PAUSE_MARKER).is_file():
            return staged_memory(staging)
        meta = await asyncio.to_thread(self.snapshots.get, rec.image_id or "")
        return meta is None or meta.memory

    async def wake(self, sandbox_id: str) -> bool:
        """Auto-resume (E2B ``autoResume``): resume ``sandbox_id`` for its own timeout if
        it is paused (or being paused) and was created with ``autoResume.enabled``; True
        when it runs now. A sandbox without auto-resume, unknown or gone: False.

        Raises:
            CreateFailed: the restore failed (it stays paused).
        """
        rec = self.store.get(sandbox_id)
        if rec is None or not rec.auto_resume:
            return False
        if rec.state == "running":
            return True  # another request resumed it meanwhile
        if rec.state not in ("paused", "pausing", "resuming"):
            return False
        try:
            await self.connect(sandbox_id, rec.timeout_s)
        except NotFound:
            return False
        return True

    # ---- snapshots --------------------------------------------------------------------
    @metrics.timed("snapshot")
    async def snapshot(self, sandbox_id: str, name: str | None = None, memory: bool = True) -> SnapshotMeta:
        """Persist the running sandbox's memory + filesystem as a reusable snapshot
        (usable as ``templateID``); the sandbox is stopped only for the checkpoint.
        A ``name`` already in use moves to the new snapshot (E2B semantics).
        ``memory`` False (E2B ``memory: false``): the filesystem only — the sandbox is
        frozen just while its writable layer is exported (``freeze`` + ``export``
        phases); sandboxes created from it cold-boot over those files.

        Raises:
            NotFound, Conflict (paused/busy), BadRequest (bad name),
            FsImageTooLarge (``memory`` False and the files exceed :meth:`fs_image_limit`;
            409, the sandbox keeps running),
            CreateFailed (runsc failed; the sandbox keeps running).
        """
        if name is not None and not is_name(name):
            raise BadRequest("snapshot name must be 1-64 of a-z, 0-9, '-' and '_', starting with a letter or digit")
        if name is not None and registry.resolve(self.settings, name) is not None:
            raise Conflict(f"{name!r} is a template; choose another snapshot name")
        async with self._locks[sandbox_id]:
            rec = self._running(sandbox_id)
            rec.state = "snapshotting"
            self.store.put(rec)
            try:
                sid = new_snapshot_id()
                staging = await (self._stage(rec, sid) if memory else self._stage_fs(rec, sid, thaw=True))
                await hold("snapshot.staged", rec.id)
                return await self._commit(staging, self._meta_for(rec, "snapshot", sid, [name] if name else [],
                                                                  memory=memory))
            finally:
                rec.state = "running"
                self.store.put(rec)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[SnapshotMeta]:
        """User-visible snapshots, oldest first, filtered by source sandbox / name."""
        out = [m for m in self.snapshots.list("snapshot") if not is_template_build(m)]
        if sandbox_id:
            out = [m for m in out if m.source_sandbox_id == sandbox_id]
        if name:
            out = [m for m in out if name in m.names or m.snapshot_id == name]
        return out

    def delete_snapshot(self, ref: str) -> None:
        """Delete a user-visible snapshot (id or name).

        Raises:
            NotFound: no such snapshot.
            Conflict: it is a built template's own snapshot (delete the template).
        """
        meta = self.snapshots.find(ref)
        if meta is not None and is_template_build(meta):
            raise Conflict(f"{ref!r} is the build of template {meta.metadata[TEMPLATE_KEY]!r}, not a snapshot; "
                           "delete the template instead (`forkyard template rm`, E2B `Template.delete`)")
        if meta is None or not self.snapshots.delete(meta.snapshot_id):
            raise NotFound(f"snapshot {ref!r} not found")

    # ---- fork -------------------------------------------------------------------------
    @metrics.timed("fork")
    async def fork(self, sandbox_id: str, count: int = 1, timeout_s: int | None = None) -> list[SandboxRecord | Exception]:
        """Checkpoint the running source once (it keeps running, id and expiry
        unchanged) and restore ``count`` children in parallel.

        Each child gets a new id, the source's memory, processes, files, env and
        resources, a new envd token, expiry now + ``timeout_s`` (default 15 s, E2B's),
        and lineage in its metadata (:data:`PARENT_KEY`, :data:`SNAPSHOT_KEY`).

        Returns:
            One entry per child, in order: its record, or the exception that stopped it.

        Raises:
            BadRequest: count outside 1…100 or bad timeout.
            NotFound / Conflict: unknown or not running source.
            CreateFailed: the checkpoint failed (the source keeps running).
        """
        if not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 1 and {MAX_FORKS}")
        timeout_s = self._check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        src = self.get(sandbox_id)
        self._admit(src.vcpus, src.memory_mb, count)  # before the checkpoint
        src, image, staging = await self._fork_stage(sandbox_id)
        # Children restore straight from the staged image: a fork image is never needed
        # after its children run, so it is not committed to the repository.
        try:
            await hold("fork.staged", sandbox_id)
            return await self._spawn_children(image, count, timeout_s, src.auto_pause, staging / "image",
                                              egress=src.egress)
        finally:
            self.snapshots.discard(staging)

    @metrics.timed("fork_export")
    async def fork_export(self, sandbox_id: str, count: int, timeout_s: int | None = None
                          ) -> tuple[list[SandboxRecord | Exception], str]:
        """:meth:`fork` for a cluster whose children do not all fit on this node: the
        one checkpoint is committed to the shared repository as a ``fork`` image, then
        ``count`` (0…100) children start here from it; other nodes start the rest with
        :meth:`fork_children`. Returns ``(children, fork image id)``; the caller deletes
        the image (:meth:`delete_image`) once every node's children run.

        Raises:
            as :meth:`fork`; RepositoryError when the commit fails (source keeps running).
        """
        if not isinstance(count, int) or not 0 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 0 and {MAX_FORKS}")
        timeout_s = self._check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        src = self.get(sandbox_id)
        self._admit(src.vcpus, src.memory_mb, count)
        src, image, staging = await self._fork_stage(sandbox_id)
        image = await self._commit(staging, image)
        return (await self._spawn_children(image, count, timeout_s, src.auto_pause, None, egress=src.egress),
                image.snapshot_id)

    @metrics.timed("fork_children")
    async def fork_children(self, image_id: str, count: int, timeout_s: int | None = None,
                            auto_pause: bool = True, egress: dict | None = None) -> list[SandboxRecord | Exception]:
        """Start ``count`` fork children on this node from a ``fork`` image another
        node exported (:meth:`fork_export`); each child is as a :meth:`fork` child of
        the image's source (memory, files, env, lineage), with ``auto_pause`` and the
        ``egress`` policy as the source's.

        Raises:
            BadRequest: count outside 1…100, bad timeout, or not a fork image.
            NotFound: no such image in the repository.
        """
        if not isinstance(count, int) or not 1 <= count <= MAX_FORKS:
            raise BadRequest(f"count must be between 1 and {MAX_FORKS}")
        timeout_s = self._check_timeout(FORK_DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        image = await asyncio.to_thread(self.snapshots.get, image_id)
        if image is None:
            raise NotFound(f"fork image {image_id!r} not found")
        if image.kind != "fork":
            raise BadRequest(f"{image_id!r} is a {image.kind} image, not a fork image")
        self._admit(image.vcpus, image.memory_mb, count)
        return await self._spawn_children(image, count, timeout_s, auto_pause, None, egress=egress)

    async def _fork_stage(self, sandbox_id: str) -> tuple[SandboxRecord, SnapshotMeta, Path]:
        """Checkpoint the running source (``--leave-running``) under its lock; returns
        ``(source, fork image meta, staging dir)``."""
        async with self._locks[sandbox_id]:
            src = self._running(sandbox_id)
            src.state = "forking"
            self.store.put(src)
            sid = new_snapshot_id()
            try:
                staging = await self._stage(src, sid)
            finally:
                src.state = "running"
                self.store.put(src)
        return src, self._meta_for(src, "fork", sid), staging

    async def _spawn_children(self, image: SnapshotMeta, count: int, timeout_s: int, auto_pause: bool,
                              image_dir: Path | None, egress: dict | None = None) -> list[SandboxRecord | Exception]:
        """Restore ``count`` children of ``image`` in parallel (:data:`FORK_PARALLELISM`)
        from ``image_dir`` (staged) or, when None, from the repository / node cache;
        each gets ``egress`` (the source's policy on a local fork).
        Records ``children`` and the slowest child's ``slot``/``runtime``/``envd`` (ms)."""
        now = time.time()
        kids = []
        for _ in range(count):
            kid = SandboxRecord(
                id=new_sandbox_id(), template_id=image.template_id, state="creating", slot=None,
                vcpus=image.vcpus, memory_mb=image.memory_mb, started_at=now, end_at=now + timeout_s,
                auto_pause=auto_pause,
                metadata={**image.metadata, PARENT_KEY: image.source_sandbox_id, SNAPSHOT_KEY: image.snapshot_id},
                env_vars=dict(image.env_vars), image_id=None, timeout_s=timeout_s,
                disk_mb=image.disk_mb or self.settings.default_disk_mb,
                envd_access_token=secrets.token_urlsafe(24) if image.envd_access_token else None,
                egress=dict(egress or {}),
            )
            kid.default_user, kid.default_workdir = guest_defaults(image)
            self.store.put(kid)
            kids.append(kid)
        await hold("fork.children-recorded", image.source_sandbox_id)
        sem = asyncio.Semaphore(FORK_PARALLELISM)
        child_phases: list[dict[str, float]] = []

        async def one(kid: SandboxRecord) -> SandboxRecord | Exception:
            async with sem:
                phases: dict[str, float] = {}
                child_phases.append(phases)
                try:
                    await hold("fork.child-start", kid.id)
                    await self._start(kid, image, image.envd_access_token, image_dir=image_dir, phases=phases)
                except Exception as e:  # noqa: BLE001 — reported per child
                    self.store.delete(kid.id)
                    return e
                return kid

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(k) for k in kids))
        timing.record("children", (time.perf_counter() - t0) * 1000)
        for name in ("slot", "runtime", "envd"):  # slowest child's phase
            timing.record(f"{name}-max", max((p.get(name, 0.0) for p in child_phases), default=0.0))
        return list(results)
