"""gVisor (runsc) runtime driver.

One sandbox = one runsc container (container id = sandbox id) under
``--root settings.runsc_root``:

* OCI bundle at ``<workdir>/bundle/config.json`` (see :mod:`.spec`); root = the template
  rootfs with ``root.readonly = false`` and runsc's rootfs overlay, so every write goes to
  a per-sandbox layer and the template directory is never modified. The overlay medium is
  ``dir=<workdir>/overlay`` by default: a host file (page cache, reclaimable) rather than
  sandbox RAM — with ``memory`` a 700 MB write in a 512 MiB sandbox got the sandbox
  OOM-killed; with ``dir`` it succeeded (measured). The overlay is part of a checkpoint.
* ``--network=sandbox`` in the slot's netns (path in the spec). runsc ≤ 2024 refuses to
  start when ``/proc/sys/net/core/rmem_default`` exists, which on kernels ≥ 6 is true in
  every netns; runsc is therefore started in a private mount namespace with a tmpfs over
  ``/proc/sys/net`` (``unshare --mount --propagation private`` + ``mount``), see
  docs/runtime.md. Only ``run``/``restore`` need it.
* cgroups: ``/forkyard/<id>`` with memory limit and CPU quota from the spec (runsc
  creates and removes them; the sentry also sizes its ``MemTotal`` from the limit).
* stdout/stderr of runsc ``run``/``restore`` — and so of the init process — go through
  a pipe into ``<workdir>/console.log``, bounded (:mod:`.console`); failures quote what
  runsc wrote there. That file is the sandbox's (anything inside can write to it);
  forkyard's own entries about the sandbox go to ``<workdir>/events.log``
  (:mod:`forkyard.runtime.events`), which nothing inside can reach.

Errors: every failure raises :class:`~forkyard.runtime.base.RuntimeError_` whose message
contains runsc's own stderr.

This module is the driver's interface methods and how a sandbox is started and removed;
the rest is beside it: :mod:`.runsc` (the binary, its flags, running it), :mod:`.image`
(the image format), :mod:`.export` (filesystem-only images), :mod:`.process` (runsc's
processes and state), :mod:`.cgroups`, :mod:`.disk` (per-sandbox disks and spares),
:mod:`.spec` (the OCI bundle), :mod:`.reaper`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path

from forkyard.config import SHARE_OFF, GVisorSettings, Settings
from forkyard.runtime.base import (Image, ImageKind, RuntimeDriver, RuntimeError_, RuntimeMismatch, RuntimeUsage,
                                   SandboxSpec)
from forkyard.runtime import events
from forkyard.runtime.gvisor import console as console_mod
from forkyard.runtime.gvisor import disk, export
from forkyard.runtime.gvisor import image as image_mod
from forkyard.runtime.gvisor import spec as ocispec
from forkyard.runtime.gvisor.cgroups import cgroup_memory_in_use, cgroup_oom, cgroup_usage, remove_cgroups
from forkyard.runtime.gvisor.process import (checkpointing, container_files_exist, kill_sandbox_process, pid_alive,
                                             rearm_envd, spawn_detached, state_file)
from forkyard.runtime.gvisor.reaper import ensure_reaper
from forkyard.runtime.gvisor.runsc import (POINTER, SHARE_SAVED_FLAG, Runsc, missing, overlay_dir, probe_features,
                                          sandbox_flags, summarize)

log = logging.getLogger(__name__)

#: forkyard's own log entry for a successful start, by runsc command.
_STARTED = {"run": "sandbox started (boot)", "restore": "sandbox started from its snapshot (restore)"}


START_TIMEOUT_S = 60.0
#: Spare disks are made only once no start has ended for this long (s).
SPARE_QUIET_S = 0.25
CHECKPOINT_TIMEOUT_S = 300.0


class GVisorDriver(RuntimeDriver):
    """Runs sandboxes as runsc containers.

    Args:
        settings: uses ``runsc`` (binary), ``runsc_root`` (state dir), ``envd_binary``
            and ``data_dir``.
        init_argv: argv of the init process (default: envd at ``/usr/local/bin/envd``).
            The envd binary is bind-mounted read-only at that path when it exists; it is
            required only when ``init_argv[0]`` is that path.
        overlay: rootfs overlay medium, ``"dir"`` (file under ``<workdir>/overlay``,
            default) or ``"memory"`` (sandbox RAM).
        debug: pass ``--debug --debug-log=<data_dir>/runsc-debug/`` to runsc (default:
            ``runtime.runsc_debug``).
        extra_flags: more global runsc flags (e.g. ``["--platform=ptrace"]``).
        sudo_broker: start the template's sudo broker (if the rootfs has one) next to
            init: init becomes ``/bin/sh -c '<start broker> & exec "$@"' init…``, so
            init (envd) is still PID 1 and the broker its child. Costs ~50 ms of a cold
            boot (Python start-up) and nothing for restored sandboxes. Set False once
            envd starts the broker itself.
        checkpoint_compression: ``"none"`` (default) or ``"flate-best-speed"`` (runsc's
            default). Uncompressed images are faster to write and chunk/deduplicate
            better in the snapshot store, which compresses chunks itself.
        runtime: the driver's tunables (default: read now, :class:`~forkyard.config.GVisorSettings`).

    Creating a driver makes this process a child subreaper with a reaper thread
    (:mod:`.reaper`) so dead sandboxes are reaped at once.
    """

    name = "gvisor"

    def __init__(
        self,
        settings: Settings,
        init_argv: list[str] | None = None,
        overlay: str = "dir",
        debug: bool | None = None,
        extra_flags: list[str] | None = None,
        checkpoint_compression: str = "none",
        sudo_broker: bool = True,
        runtime: GVisorSettings | None = None,
    ):
        if overlay not in ("dir", "memory"):
            raise ValueError(f"overlay must be 'dir' or 'memory', not {overlay!r}")
        self.settings = settings
        runtime = runtime or GVisorSettings()
        self.runtime = runtime
        self.init_argv = list(init_argv or [ocispec.ENVD_GUEST_PATH])
        self.overlay = overlay
        #: The node's runsc: binary, build, global flags (:class:`.runsc.Runsc`).
        self.runsc = Runsc(settings, runtime.runsc_debug if debug is None else debug, extra_flags)
        self._pids: dict[str, int] = {}
        if checkpoint_compression not in ("none", "flate-best-speed"):
            raise ValueError(f"unknown checkpoint compression {checkpoint_compression!r}")
        self.checkpoint_compression = checkpoint_compression
        self.sudo_broker = sudo_broker
        self.runsc_path = self.runsc.path
        self.build = self.runsc.build
        #: What this runsc can do with these settings (:func:`.runsc.probe_features`).
        self.features = probe_features(self.runsc_path, runtime, checkpoint_compression)
        #: How new sandboxes mount ``/tmp`` (:attr:`.runsc.Features.new_tmp`).
        self.new_tmp = self.features.new_tmp
        #: Which restores share the image's pages (see :attr:`RuntimeDriver.shared_pages`).
        self.shared_pages = "" if self.features.share_scope == SHARE_OFF else self.features.share_scope
        ensure_reaper()
        #: Start sandboxes under the node's reaper daemon (docs/runtime.md).
        self.reaper_daemon = runtime.reaper_daemon
        #: Send a restored envd SIGUSR1 (:func:`.process.rearm_envd`) before a restore returns.
        self.rearm_envd = runtime.envd_rearm
        #: Disks made ahead of demand (:meth:`prepare`); None: made at each start.
        self.spare_disks: disk.SpareDisks | None = None
        self._spare_keeper: disk.SpareKeeper | None = None
        self._starts = 0  # run/restore in flight: spares are made only while none is
        self._last_start = 0.0  # time.monotonic() when the last one ended

    # ---- spare disks --------------------------------------------------------------------
    async def prepare(self, default_disk_mb: int) -> None:
        """Keep ``runtime.spare_disks`` disks of ``default_disk_mb`` MiB (the node's
        default) made and mounted under ``<data dir>/spare-disks``, so a start with that
        disk size moves one in instead of making it (see :class:`.disk.SpareDisks`);
        leftovers of a crashed earlier process there are removed first. Disks are made
        only while no start is in flight nor ended in the last :data:`SPARE_QUIET_S`.
        Only with ``overlay="dir"``."""
        count = self.runtime.spare_disks
        if self.overlay != "dir" or count <= 0 or not default_disk_mb:
            return
        spares = disk.SpareDisks(self.settings.data_dir / "spare-disks", count, default_disk_mb)
        await asyncio.to_thread(spares.clear)
        self.spare_disks = spares
        self._spare_keeper = disk.SpareKeeper(
            spares, busy=lambda: bool(self._starts) or time.monotonic() - self._last_start < SPARE_QUIET_S)
        self._spare_keeper.refill()

    async def shutdown(self) -> None:
        """Stop making spare disks and remove the ready ones. Never raises."""
        keeper, self._spare_keeper, self.spare_disks = self._spare_keeper, None, None
        if keeper is not None:
            await keeper.stop()

    def spare_mounts(self) -> list[str]:
        """Mount points of the ready spare disks."""
        return self.spare_disks.mounts() if self.spare_disks is not None else []

    # ---- lifecycle ----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec, image: Image | None = None,
                     phases: dict[str, float] | None = None) -> None:
        """Start sandbox ``spec.sandbox_id`` with init (envd) as root, in the network
        namespace of ``spec.network``: a cold boot of ``spec.rootfs`` (``image`` None),
        one with a filesystem-only image laid over it (its :data:`.image.ROOTFS_TAR` as
        the writable layer's initial contents: files, directories and deletions), or a
        restore of a checkpoint (:meth:`_restore`). ``phases`` (when given) receives
        ``disk`` (the sandbox's disk made and mounted) and ``runsc`` (runsc until it
        exited) in ms, and for a restore ``rearm``.

        A cold boot uses ``runsc run --detach`` (measured faster than ``create`` +
        ``start``: one runsc invocation instead of two). Returns when runsc reports the
        container started. The slot's ``eth0`` must carry the guest address: runsc moves
        the address and routes into the sandbox, so a slot whose sandbox stopped must be
        re-``allocate``d before it serves another sandbox (``NetnsNetwork.allocate``
        restores them).

        Raises:
            RuntimeMismatch: a checkpoint of another runsc build.
            RuntimeError_: bad spec (missing rootfs/netns/envd/image), the id already
                exists, or runsc failed (message = runsc's output). Everything created
                here is removed first.
        """
        if image is not None and image.kind is ImageKind.CHECKPOINT:
            return await self._restore(spec, image, phases)
        upper = image.path / image_mod.ROOTFS_TAR if image is not None else None
        bundle = ocispec.bundle_dir(spec.workdir)
        await self._start(spec, "run", ["run", "--detach", f"--bundle={bundle}", spec.sandbox_id], tmp=self.new_tmp,
                          upper_tar=upper, phases=phases)

    async def _restore(self, spec: SandboxSpec, image: Image, phases: dict[str, float] | None = None) -> None:
        """Start a new sandbox from a checkpoint image (``runsc restore --detach``).

        ``spec`` may name a different id, netns and workdir than the checkpointed sandbox
        (fork); the guest addressing is identical in every slot, so listening sockets keep
        working. The rootfs must be the same template. ``phases`` (when given) receives
        ``disk`` (the sandbox's disk made and mounted), ``runsc`` (``runsc restore`` until
        it exits) and ``rearm`` (envd's listener nudge) in ms.

        Raises:
            RuntimeMismatch: the image records another runtime build than
                :attr:`build` (images from before builds were recorded are restored).
            RuntimeError_: as for :meth:`create`, or the image is missing/invalid.
        """
        image_dir = image.path
        if not image_dir.is_dir():
            raise RuntimeError_(f"checkpoint image {image_dir} does not exist")
        if image.build is not None and image.build != self.build:
            raise RuntimeMismatch(image.build, self.build)
        bundle = ocispec.bundle_dir(spec.workdir)
        # A sandbox cold-booted from a filesystem-only image carries the rootfs-tar
        # annotation in its checkpoint, and runsc refuses a restore whose annotations
        # differ. Restore does not lay the tar again (the overlay comes from the image),
        # so the value only has to name a readable tar: the constant placeholder (an
        # empty tar), or — images from before it — the old per-image path, if present.
        if (image_dir / ocispec.ROOTFS_TAR_MARKER).is_file():  # a small file: no thread hop
            rootfs_tar = image_mod.image_rootfs_tar(image_dir)
        else:  # images from before the marker: the checkpoint.img header is read (~1 ms)
            rootfs_tar = await asyncio.to_thread(image_mod.image_rootfs_tar, image_dir)
        if rootfs_tar is not None:
            await asyncio.to_thread(image_mod.provide_tar, rootfs_tar)
        # An image restores with the /tmp and /dev/shm mounts it was made with (a new
        # /tmp mount over a restored one would hide its files): see ocispec.TMP_ROOTFS.
        await self._start(
            spec,
            "restore",
            ["restore", "--detach", f"--image-path={image_dir}", f"--bundle={bundle}", spec.sandbox_id],
            tmp=ocispec.image_tmp(image_dir),
            rootfs_tar=rootfs_tar,
            phases=phases,
        )
        if self.init_argv[0] == ocispec.ENVD_GUEST_PATH and self.rearm_envd:
            t0 = time.perf_counter()
            await rearm_envd(self.runsc, spec.sandbox_id)
            if phases is not None:
                phases["rearm"] = (time.perf_counter() - t0) * 1000

    async def _start(self, spec: SandboxSpec, op: str, args: list[str], tmp: str,
                     rootfs_tar: str | None = None, phases: dict[str, float] | None = None,
                     upper_tar: Path | None = None) -> None:
        """Write the bundle and run ``runsc <args>`` (``run`` or ``restore``) in a private
        mount namespace. A cold boot over ``upper_tar`` (a filesystem-only image's tar)
        annotates the spec with :data:`~.spec.ROOTFS_TAR_PLACEHOLDER` and bind-mounts the
        real tar over it in that namespace; a restore passes ``rootfs_tar`` (the image's
        annotation)."""
        sid = spec.sandbox_id
        if not Path(spec.rootfs).is_dir():
            raise RuntimeError_(f"rootfs {spec.rootfs} is not a directory")
        if not os.path.exists(spec.network.netns_path):
            raise RuntimeError_(f"network namespace {spec.network.netns_path} does not exist")
        envd: Path | None = Path(self.settings.envd_binary)
        if not envd.is_file():
            if self.init_argv[0] == ocispec.ENVD_GUEST_PATH:
                raise RuntimeError_(f"envd binary {envd} not found (build envd first)")
            envd = None
        init = self.init_argv[0]
        if init != ocispec.ENVD_GUEST_PATH and not (
            init.startswith("/") and os.path.lexists(Path(spec.rootfs) / init.lstrip("/"))
        ):
            raise RuntimeError_(f"init {init!r} does not exist in rootfs {spec.rootfs}")
        if container_files_exist(self.settings.runsc_root, sid):
            raise RuntimeError_(f"runsc {op} {sid}: a container with this id already exists")
        if upper_tar is not None and not Path(upper_tar).is_file():
            raise RuntimeError_(f"filesystem image {upper_tar} does not exist")

        self._starts += 1
        try:
            await self._start_counted(spec, op, args, tmp, rootfs_tar, phases, envd, upper_tar)
        finally:
            self._starts -= 1
            self._last_start = time.monotonic()

    async def _start_counted(self, spec: SandboxSpec, op: str, args: list[str], tmp: str, rootfs_tar: str | None,
                             phases: dict[str, float] | None, envd: Path | None, upper_tar: Path | None) -> None:
        """:meth:`_start` after its checks, counted in ``_starts``."""
        sid = spec.sandbox_id
        self.settings.runsc_root.mkdir(parents=True, exist_ok=True)
        spec.workdir.mkdir(parents=True, exist_ok=True)
        phases = {} if phases is None else phases
        t0 = time.perf_counter()
        if self.overlay == "dir":
            overlay = overlay_dir(spec.workdir)
            overlay.mkdir(parents=True, exist_ok=True)
            if spec.disk_mb:
                try:
                    await disk.provide(spec.workdir, overlay, spec.disk_mb, self.spare_disks, self._spare_keeper)
                except disk.DiskError as e:
                    raise RuntimeError_(f"sandbox {sid}: disk of {spec.disk_mb} MiB: {e}") from e
        phases["disk"] = (time.perf_counter() - t0) * 1000
        if upper_tar is not None:
            placeholder = ocispec.ROOTFS_TAR_PLACEHOLDER
            try:
                await asyncio.to_thread(ocispec.ensure_empty_tar, placeholder)
            except OSError as e:
                raise RuntimeError_(f"cannot create {placeholder}: {e}") from e
            rootfs_tar = str(placeholder)
        ocispec.write_bundle(spec, ocispec.process_argv(self.init_argv, self.sudo_broker), envd, tmp=tmp, rootfs_tar=rootfs_tar)

        console = spec.workdir / "console.log"
        flags = sandbox_flags(spec, self.overlay, self.features.shares(spec.fork_child))
        argv = self.runsc.start_argv(flags, args, upper_tar=upper_tar, annotated=rootfs_tar is not None)
        ok = False
        t1 = time.perf_counter()
        try:
            offset = console_mod.size(console)
            proc = await spawn_detached(self.settings.runsc_root, argv, console, self.settings.console_log_max_bytes,
                                        use_daemon=self.reaper_daemon)
            try:
                rc = await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                events.record(spec.workdir, "error", f"runsc {op} timed out after {START_TIMEOUT_S:.0f} s")
                raise RuntimeError_(f"runsc {op} {sid} timed out after {START_TIMEOUT_S:.0f} s") from None
            if rc != 0:
                full = console_mod.tail(console, offset)
                # The whole of it (gVisor internals, heap addresses) stays in the log and
                # console.log; the error, which reaches API clients, carries a short form.
                log.warning("runsc %s %s failed (exit %s): %s", op, sid, rc, summarize(full))
                said = POINTER.sub("0x…", summarize(full, limit=400))
                events.record(spec.workdir, "error", f"runsc {op} failed (exit {rc})")
                raise RuntimeError_(f"runsc {op} {sid} failed (exit {rc}): {said or 'no output'}")
            events.record(spec.workdir, "info", _STARTED.get(op, f"sandbox started (runsc {op})"))
            phases["runsc"] = (time.perf_counter() - t1) * 1000
            ok = True
        finally:
            if not ok:
                await asyncio.shield(self._cleanup(sid, spec.workdir))

    async def _cleanup(self, sandbox_id: str, workdir: Path | None) -> str | None:
        """Force-delete the container and remove bundle + overlay; return runsc's error
        (None on success or when it did not exist). Never raises."""
        error = None
        try:
            await kill_sandbox_process(self.settings.runsc_root, sandbox_id)
            rc, _, err = await self.runsc.run(["delete", "--force", sandbox_id])
            if rc != 0 and not missing(err):
                error = err or f"exit {rc}"
        except RuntimeError_ as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001
            error = repr(exc)
        if error is None:
            remove_cgroups(sandbox_id)
        if workdir is not None:
            disk.detach(workdir, overlay_dir(workdir))
            for path in (ocispec.bundle_dir(workdir), overlay_dir(workdir)):
                shutil.rmtree(path, ignore_errors=True)
        return error

    def disk_usage(self, workdir: Path) -> tuple[int, int] | None:
        """``(used, total)`` bytes of the sandbox's disk (its writable layer), None when
        it has no disk of its own."""
        return disk.usage(overlay_dir(workdir))

    async def destroy(self, sandbox_id: str, workdir: Path | None = None) -> None:
        """Kill and delete the sandbox (``runsc delete --force``) and remove its bundle
        and writable layer. Idempotent: an unknown id is not an error.

        Args:
            workdir: the sandbox's workdir; when None it is derived from the bundle path
                runsc recorded.

        Raises:
            RuntimeError_: runsc could not delete it (message = runsc's stderr).
        """
        self._pids.pop(sandbox_id, None)
        if workdir is None:
            rc, out, _ = await self.runsc.run(["state", sandbox_id])
            if rc == 0:
                try:
                    workdir = Path(json.loads(out)["bundle"]).parent
                except (ValueError, KeyError):
                    workdir = None
        error = await self._cleanup(sandbox_id, workdir)
        if error is not None:
            raise RuntimeError_(f"runsc delete {sandbox_id} failed: {error}")

    async def list_ids(self) -> list[str]:
        """Ids of every runsc container under ``runsc_root`` (any status).

        Raises:
            RuntimeError_: ``runsc list`` failed.
        """
        if not self.settings.runsc_root.is_dir():
            return []
        rc, out, err = await self.runsc.run(["list", "--format=json"])
        if rc != 0:
            raise RuntimeError_(f"runsc list failed: {err}")
        try:
            items = json.loads(out or "null") or []
        except ValueError as exc:
            raise RuntimeError_(f"runsc list returned invalid JSON: {out[:200]!r}") from exc
        return [item["id"] for item in items]

    async def state(self, sandbox_id: str) -> dict | None:
        """runsc's state JSON for the sandbox (``id``, ``status``, ``pid``, ``bundle``…),
        or None when it does not exist.

        Raises:
            RuntimeError_: ``runsc state`` failed for another reason.
        """
        rc, out, err = await self.runsc.run(["state", sandbox_id])
        if rc != 0:
            if missing(err):
                return None
            raise RuntimeError_(f"runsc state {sandbox_id} failed: {err}")
        try:
            return json.loads(out)
        except ValueError as exc:
            raise RuntimeError_(f"runsc state {sandbox_id} returned invalid JSON: {out[:200]!r}") from exc

    async def alive(self, sandbox_id: str) -> bool:
        """Cheap liveness check for monitoring: True while the sandbox process runsc
        reported for it (cached after the first ``runsc state``) exists. A sandbox
        whose init (envd) exited or that the OOM killer hit reads False."""
        pid = self._pids.get(sandbox_id)
        if pid is None:
            st = await self.state(sandbox_id)
            if st is None or not st.get("pid"):
                return False
            pid = self._pids[sandbox_id] = int(st["pid"])
        if pid_alive(pid):
            return True
        self._pids.pop(sandbox_id, None)
        return False

    async def is_running(self, sandbox_id: str) -> bool:
        """True when runsc reports the sandbox ``running`` and its sandbox process is
        alive (not a zombie).

        Raises:
            RuntimeError_: ``runsc state`` failed other than "does not exist".
        """
        st = await self.state(sandbox_id)
        if st is None or st.get("status") != "running":
            return False
        pid = int(st.get("pid") or 0)
        return pid > 0 and pid_alive(pid)

    async def usage(self, sandbox_id: str) -> RuntimeUsage | None:
        """The sandbox's cgroup CPU figures (see :func:`cgroup_usage`)."""
        return cgroup_usage(sandbox_id)

    def memory_in_use(self, sandbox_ids: list[str]) -> dict[str, int]:
        """Unreclaimable host memory (bytes) of each sandbox with a memory cgroup
        (:func:`.cgroups.cgroup_memory_in_use`); ~20 µs a sandbox."""
        out = {}
        for sid in sandbox_ids:
            n = cgroup_memory_in_use(sid)
            if n is not None:
                out[sid] = n
        return out

    async def death_cause(self, sandbox_id: str) -> str | None:
        """Why a sandbox whose runtime stopped by itself stopped, read from its memory
        cgroup before :meth:`destroy` removes it (:func:`cgroup_oom`): ``"out of memory
        (limit 512 MiB)"`` when the host's OOM killer acted on it, else None."""
        oom = cgroup_oom(sandbox_id)
        if oom is None or oom[0] == 0:
            return None
        return f"out of memory (limit {oom[1] >> 20} MiB)" if oom[1] else "out of memory"

    async def freeze(self, sandbox_id: str) -> None:
        """Stop every task of the sandbox in place (``runsc pause``); memory and
        connections stay. A frozen sandbox can still be checkpointed.

        Raises:
            RuntimeError_: runsc failed (message = its stderr).
        """
        await self.runsc.check(["pause", sandbox_id])

    async def thaw(self, sandbox_id: str) -> None:
        """Continue a frozen sandbox (``runsc resume``).

        Raises:
            RuntimeError_: runsc failed (message = its stderr).
        """
        await self.runsc.check(["resume", sandbox_id])

    async def is_frozen(self, sandbox_id: str) -> bool:
        """True when the sandbox exists and is frozen (runsc status ``paused``)."""
        st = await self.state(sandbox_id)
        return bool(st) and st.get("status") == "paused"

    # ---- checkpoint / restore ------------------------------------------------------------
    async def wait_checkpoints(self, timeout_s: float) -> list[str]:
        """Wait (≤ ``timeout_s``, polling every 50 ms) until no ``runsc checkpoint`` of
        this root runs — one started by a server that was killed keeps going, and the
        sandbox's fate (stopped with a complete image, or still running) is only known
        once it ends. Returns the ids still checkpointing at the deadline."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while ids := await asyncio.to_thread(checkpointing, self.settings.runsc_root):
            if asyncio.get_running_loop().time() >= deadline:
                return ids
            await asyncio.sleep(0.05)
        return []

    async def checkpoint(self, sandbox_id: str, into: Path, leave_running: bool,
                         keep_stopped: bool = False, fork: bool = False) -> Image:
        """Write the sandbox's memory and filesystem (overlay) state into directory
        ``into`` (``runsc checkpoint``; created if missing) and what its restore needs
        (:mod:`.image`); returns the image.

        With ``leave_running`` the sandbox continues afterwards (fork/snapshot; runsc
        saves, then restores it in place). Without it the sentry stops the sandbox right
        after the image is complete — nothing runs past the checkpoint (pause) — and the
        driver deletes the stopped container (its bundle and overlay too) so the same id
        can be restored, unless ``keep_stopped`` (the caller destroys it later).
        ``fork`` (with ``leave_running``): the sandbox then maps its unchanged memory
        from the image (``--share-saved-pages``) when the node shares fork children's
        pages (:attr:`.runsc.Features.shares`); every leave-running checkpoint does
        when it shares all restores. runsc runs in its own session: a server killed
        meanwhile does not stop it (see :meth:`wait_checkpoints`).

        Raises:
            RuntimeError_: runsc failed (message = its stderr); the sandbox is left as
                runsc left it.
        """
        image_dir = Path(into)
        image_dir.mkdir(parents=True, exist_ok=True)
        args = ["checkpoint", f"--image-path={image_dir}", f"--compression={self.checkpoint_compression}"]
        if leave_running:
            args.append("--leave-running")
            if self.features.shares_saved_pages and self.features.shares(fork):
                args.append(SHARE_SAVED_FLAG)
        await self.runsc.check([*args, sandbox_id], timeout=CHECKPOINT_TIMEOUT_S)
        image_mod.write_image_build(image_dir, self.build)
        st = None
        bundle = ocispec.bundle_dir(self.settings.sandboxes_dir / sandbox_id)
        if not bundle.is_dir():
            st = await self.state(sandbox_id)
            bundle = Path(st["bundle"]) if st and st.get("bundle") else bundle
        image_mod.write_markers(image_dir, bundle)  # what its restore must pass again
        if not leave_running and not keep_stopped:
            st = st or await self.state(sandbox_id)
            workdir = Path(st["bundle"]).parent if st and st.get("bundle") else None
            error = await self._cleanup(sandbox_id, workdir)
            if error is not None:
                raise RuntimeError_(f"runsc delete {sandbox_id} after checkpoint failed: {error}")
        return Image(image_dir, ImageKind.CHECKPOINT, self.build)

    def image_at(self, path: Path) -> Image:
        """What image directory ``path`` holds (:func:`.image.image_at`)."""
        return image_mod.image_at(path)

    # ---- filesystem-only images ----------------------------------------------------------
    async def large_changed_files(self, sandbox_id: str, min_bytes: int) -> list[tuple[str, int]] | None:
        """The sandbox's changed files over ``min_bytes`` (:func:`.export.large_changed_files`)."""
        return await export.large_changed_files(self.runsc, state_file(self.settings.runsc_root, sandbox_id),
                                                sandbox_id, min_bytes)

    async def export_filesystem(self, sandbox_id: str, into: Path, max_bytes: int | None = None) -> int:
        """Write the sandbox's overlay upper layer into ``into`` as its filesystem-only
        image (:data:`.image.ROOTFS_TAR`, :func:`.export.export_rootfs`); returns its bytes.

        Raises:
            ExportTooLarge: over ``max_bytes``; RuntimeError_: runsc failed. Nothing is left.
        """
        return await export.export_rootfs(self.runsc, sandbox_id, Path(into) / image_mod.ROOTFS_TAR, max_bytes)
