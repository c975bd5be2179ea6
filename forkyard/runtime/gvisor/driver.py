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
* stdout/stderr of runsc ``run``/``restore`` — and so of the init process — go to
  ``<workdir>/console.log``; failures quote what runsc wrote there.

Errors: every failure raises :class:`~forkyard.runtime.base.RuntimeError_` whose message
contains runsc's own stderr.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from forkyard.config import Settings
from forkyard.runtime.base import (ExportTooLarge, RuntimeDriver, RuntimeError_, RuntimeMismatch, RuntimeUsage,
                                   SandboxSpec)
from forkyard.runtime.gvisor import disk
from forkyard.runtime.gvisor import spec as ocispec
from forkyard.runtime.gvisor import reaper
from forkyard.runtime.gvisor.reaper import ensure_reaper

log = logging.getLogger(__name__)

#: Shell snippet run in a private mount namespace before exec'ing runsc (netns bug).
_SYSNET_WORKAROUND = 'mount -t tmpfs -o size=4k,mode=0555 forkyard-sysnet /proc/sys/net && exec "$0" "$@"'
#: Same, also bind-mounting the real filesystem image (``{tar}``) over
#: :data:`~.spec.ROOTFS_TAR_PLACEHOLDER` (the annotation's constant value) for this runsc
#: only: the mount namespace is private, so the host and other starts see the empty tar.
_SYSNET_WITH_TAR = ('mount -t tmpfs -o size=4k,mode=0555 forkyard-sysnet /proc/sys/net'
                    ' && mount --bind {tar} {placeholder} && exec "$0" "$@"')
#: Hexadecimal addresses in runsc's messages (e.g. ``&{0xc000a1b2c0 …}``): internals
#: that mean nothing to a client.
_POINTER = re.compile(r"0x[0-9a-f]{6,}")
_NOT_FOUND = ("does not exist", "not found", "no such file")
#: Started next to init when present (see forkyard.templates.sudo): gVisor ignores
#: set-user-ID bits, so ``sudo`` for non-root users goes through this root broker.
SUDO_BROKER = "/usr/local/lib/forkyard/sudo-broker"
_BROKER_LAUNCH = f'[ -x {SUDO_BROKER} ] && {SUDO_BROKER} & exec "$@"'
START_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 30.0
#: Disks kept made ahead of demand by a node (``FORKYARD_SPARE_DISKS``; see
#: :class:`.disk.SpareDisks`): as many as a fork restores at once
#: (``FORKYARD_FORK_PARALLELISM``, 16; fork x16 measured 1.07x of raw with 16 spares,
#: 1.13-1.22x with 4), ~2 MB of host disk, one loop device and one mount each.
SPARE_DISKS = int(os.environ.get("FORKYARD_SPARE_DISKS", "16"))
#: Nudge every restored envd with SIGUSR1 (``runsc kill``, ~9-20 ms per restore) so it
#: re-registers its listener (``FORKYARD_ENVD_REARM=1``). Off by default: the epoll bug
#: it works around (gVisor issue 13920) is fixed in the pinned build (the epoll ready
#: list is rebuilt on restore, gVisor PR 14147), a restored envd answered as fast
#: without it (docs/runtime.md), and envd's accept poll still bounds a missed wake-up
#: to 1 s.
ENVD_REARM = os.environ.get("FORKYARD_ENVD_REARM", "0") == "1"
#: Restored sandboxes map their memory copy-on-write from the checkpoint's pages file
#: instead of copying it (runsc ``--share-restored-pages``, forkyard's runsc patch 0002;
#: docs/runtime.md "Memory"): children of one fork or snapshot share the host's page
#: cache of its image. On when the runsc build has the flag; ``FORKYARD_SHARE_RESTORED_PAGES=0``
#: turns it off (every restore copies its memory, as stock runsc does).
SHARE_RESTORED_PAGES = os.environ.get("FORKYARD_SHARE_RESTORED_PAGES", "1") != "0"
SHARE_PAGES_FLAG = "--share-restored-pages"
#: A sandbox that keeps running after a checkpoint (fork, snapshot) then maps its
#: unchanged memory from the image it just wrote instead of keeping its own copy
#: (``runsc checkpoint --share-saved-pages``, same patch): a fork source and its
#: children share one copy. Its next checkpoint first copies its still-shared pages back
#: (docs/runtime.md "Memory"). ``FORKYARD_SHARE_SAVED_PAGES=0`` turns it off; it needs
#: :data:`SHARE_RESTORED_PAGES` and uncompressed images.
SHARE_SAVED_PAGES = os.environ.get("FORKYARD_SHARE_SAVED_PAGES", "1") != "0"
#: Spare disks are made only once no start has ended for this long (s).
SPARE_QUIET_S = 0.25
CHECKPOINT_TIMEOUT_S = 300.0
#: File in every checkpoint image naming the runtime build that wrote it.
BUILD_FILE = "forkyard-runtime.json"


def _missing(message: str) -> bool:
    low = message.lower()
    return any(s in low for s in _NOT_FOUND)


def _summarize(text: str, limit: int = 2000) -> str:
    """runsc's message without Go stack dumps, at most ``limit`` characters."""
    text = text.strip()
    cut = text.find("\ngoroutine ")
    if cut > 0:
        text = text[:cut].rstrip(" :\n") + " [stack trace omitted]"
    if len(text) > limit:
        text = text[: limit // 2] + " … " + text[-limit // 2 :]
    return text


def _remove_cgroups(sandbox_id: str) -> None:
    """Remove the sandbox's (empty) cgroup directories. runsc removes them on delete,
    but not after a failed ``run`` (measured: a bad netns left all nine v1 dirs)."""
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    root = Path("/sys/fs/cgroup")
    for path in [root / rel, *root.glob(f"*/{rel}")]:
        try:
            path.rmdir()
        except OSError:
            pass  # absent, or still has processes/children


_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_usage(sandbox_id: str, root: Path = _CGROUP_ROOT) -> RuntimeUsage | None:
    """CPU time and CPU limit of the sandbox's cgroup, or None when it has none.

    cgroup v1 (runsc's choice on hybrid hosts): ``cpuacct/<path>/cpuacct.usage`` (ns)
    and ``cpu/<path>/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; cgroup v2:
    ``<path>/cpu.stat`` ``usage_usec`` and ``cpu.max`` (kernel docs, cgroup-v1/cpuacct
    and cgroup-v2 "CPU"). No quota (``-1`` / ``max``) reads as the host's CPU count.
    gVisor's in-sandbox ``/proc/stat`` is all zeros (measured), hence the host side.
    """
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "cpuacct" / rel / "cpuacct.usage"
        if v1.exists():
            ns = int(v1.read_text())
            quota = int((root / "cpu" / rel / "cpu.cfs_quota_us").read_text())
            period = int((root / "cpu" / rel / "cpu.cfs_period_us").read_text())
        else:
            v2 = root / rel / "cpu.stat"
            if not v2.exists():
                return None
            stat = dict(line.split() for line in v2.read_text().splitlines() if line.strip())
            ns = int(stat["usage_usec"]) * 1000
            q, _, p = (root / rel / "cpu.max").read_text().strip().partition(" ")
            quota, period = (-1 if q == "max" else int(q)), int(p or 100000)
    except (OSError, ValueError, KeyError):
        return None  # the sandbox went away between the reads
    limit = quota / period if quota > 0 and period > 0 else float(os.cpu_count() or 1)
    return RuntimeUsage(cpu_ns=ns, cpu_limit=limit)


def cgroup_oom(sandbox_id: str, root: Path = _CGROUP_ROOT) -> tuple[int, int] | None:
    """``(oom kills, memory limit in bytes)`` of the sandbox's cgroup, or None when it
    has no memory cgroup (gone, or never made).

    cgroup v1: ``memory/<path>/memory.oom_control`` line ``oom_kill N`` (kernel ≥ 4.13)
    and ``memory.limit_in_bytes``; cgroup v2: ``<path>/memory.events`` ``oom_kill N``
    and ``memory.max`` (kernel docs, cgroup-v1/memory and cgroup-v2 "Memory"). Under
    gVisor the host's OOM killer acts on this cgroup and kills the sentry, i.e. the
    whole sandbox (measured: tests/test_runtime.py), so a count above 0 on a sandbox
    whose runtime stopped says why it stopped. A limit of ``max`` reads as 0.
    """
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "memory" / rel
        if (v1 / "memory.oom_control").exists():
            events, limit_file = v1 / "memory.oom_control", v1 / "memory.limit_in_bytes"
        elif (root / rel / "memory.events").exists():
            events, limit_file = root / rel / "memory.events", root / rel / "memory.max"
        else:
            return None
        fields = dict(line.split()[:2] for line in events.read_text().splitlines() if len(line.split()) >= 2)
        raw = limit_file.read_text().strip()
        return int(fields.get("oom_kill", 0)), (0 if raw == "max" else int(raw))
    except (OSError, ValueError):
        return None


def cgroup_memory_in_use(sandbox_id: str, root: Path = _CGROUP_ROOT) -> int | None:
    """Bytes of the sandbox's memory cgroup that the host cannot reclaim, or None when
    it has no memory cgroup: anonymous + shmem pages — cgroup v1 ``memory.stat``
    ``total_rss`` + ``total_shmem``, v2 ``anon`` + ``shmem`` (kernel docs cgroup-v1/memory,
    cgroup-v2 "memory.stat"). Under gVisor the sandbox's memory is the sentry's memory
    file, a memfd (shmem), plus the sentry's own heap (anon); pages shared from a
    checkpoint's pages file (:data:`SHARE_RESTORED_PAGES`) are page cache, which the
    host can evict and read back, so they are not counted."""
    rel = ocispec.cgroup_path(sandbox_id).lstrip("/")
    try:
        v1 = root / "memory" / rel / "memory.stat"
        if v1.exists():
            keys, path = ("total_rss", "total_shmem"), v1
        elif (root / rel / "memory.stat").exists():
            keys, path = ("anon", "shmem"), root / rel / "memory.stat"
        else:
            return None
        stat = dict(line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
        return sum(int(stat.get(k, 0)) for k in keys)
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3] not in (b"Z", b"X")


def runsc_build(runsc: str) -> str:
    """``runsc --version``'s first line (e.g. ``runsc version 0.0~20240729.0``), or
    ``"unknown"`` when it does not run. Blocking (≤ 10 s)."""
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0].strip() if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def runsc_supports(runsc: str, flag: str) -> bool:
    """True when ``runsc`` accepts the global boolean ``flag`` (``runsc FLAG --version``
    exits 0; an unknown flag exits 2). Blocking (≤ 10 s)."""
    try:
        return subprocess.run([runsc, flag, "--version"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def write_image_build(image_dir: Path, build: str) -> None:
    """Record ``build`` in checkpoint image ``image_dir`` (file :data:`BUILD_FILE`,
    JSON ``{"runtime": "gvisor", "build": ...}``); it travels with the image into the
    snapshot repository."""
    path = image_dir / BUILD_FILE
    path.write_text(json.dumps({"runtime": "gvisor", "build": build}))
    os.chmod(path, 0o600)


def image_rootfs_tar(image_dir: Path) -> str | None:
    """The :data:`~.spec.ROOTFS_TAR_ANNOTATION` value the checkpointed sandbox of
    ``image_dir`` was booted with (restore must pass the same), or None.

    Read from :data:`~.spec.ROOTFS_TAR_MARKER` (written by :meth:`GVisorDriver.checkpoint`),
    else — images from before the marker — from the metadata header of
    ``checkpoint.img``: ``gVisorSF``, 8 bytes of length, then JSON whose
    ``container_specs`` (a JSON string) maps container names to the OCI specs runsc
    compares at restore (the pinned runsc's format, not documented).
    """
    try:
        return (image_dir / ocispec.ROOTFS_TAR_MARKER).read_text().strip() or None
    except FileNotFoundError:
        pass
    except OSError:
        return None
    try:
        with open(image_dir / "checkpoint.img", "rb") as f:
            head = f.read(1 << 20)
        if not head.startswith(b"gVisorSF"):
            return None
        text = head[head.index(b"{"):].decode("utf-8", "replace")
        meta, _ = json.JSONDecoder().raw_decode(text)
        for spec in json.loads(meta.get("container_specs") or "{}").values():
            value = (spec.get("annotations") or {}).get(ocispec.ROOTFS_TAR_ANNOTATION)
            if value:
                return str(value)
    except (OSError, ValueError, AttributeError, TypeError):
        return None
    return None


def read_image_build(image_dir: Path) -> str | None:
    """The build recorded in ``image_dir``, or None for images written before builds
    were recorded (or with an unreadable record)."""
    try:
        return str(json.loads((image_dir / BUILD_FILE).read_text())["build"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        debug: pass ``--debug --debug-log=<data_dir>/runsc-debug/`` to runsc (default
            from ``FORKYARD_RUNSC_DEBUG=1``).
        extra_flags: more global runsc flags (e.g. ``["--platform=ptrace"]``).
        sudo_broker: start the template's sudo broker (if the rootfs has one) next to
            init: init becomes ``/bin/sh -c '<start broker> & exec "$@"' init…``, so
            init (envd) is still PID 1 and the broker its child. Costs ~50 ms of a cold
            boot (Python start-up) and nothing for restored sandboxes. Set False once
            envd starts the broker itself.
        checkpoint_compression: ``"none"`` (default) or ``"flate-best-speed"`` (runsc's
            default). Uncompressed images are faster to write and chunk/deduplicate
            better in the snapshot store, which compresses chunks itself.

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
    ):
        if overlay not in ("dir", "memory"):
            raise ValueError(f"overlay must be 'dir' or 'memory', not {overlay!r}")
        self.settings = settings
        self.init_argv = list(init_argv or [ocispec.ENVD_GUEST_PATH])
        self.overlay = overlay
        self.debug = os.environ.get("FORKYARD_RUNSC_DEBUG") == "1" if debug is None else debug
        self.extra_flags = list(extra_flags or [])
        self._pids: dict[str, int] = {}
        if checkpoint_compression not in ("none", "flate-best-speed"):
            raise ValueError(f"unknown checkpoint compression {checkpoint_compression!r}")
        self.checkpoint_compression = checkpoint_compression
        self.sudo_broker = sudo_broker
        # Resolved once, at start, links included: a later change of PATH (or a second
        # runsc earlier in it), or an install that moves the runsc link to a newer build,
        # must never switch builds under running sandboxes and their checkpoints.
        found = shutil.which(settings.runsc)
        self.runsc_path = os.path.realpath(found) if found else None
        self.build = runsc_build(self.runsc_path) if self.runsc_path else ""
        #: Restores share the image's pages (:data:`SHARE_RESTORED_PAGES`, see base).
        self.shares_restored_pages = bool(SHARE_RESTORED_PAGES and self.runsc_path
                                          and runsc_supports(self.runsc_path, SHARE_PAGES_FLAG))
        #: Leave-running checkpoints share the image with the sandbox (:data:`SHARE_SAVED_PAGES`).
        self.shares_saved_pages = (self.shares_restored_pages and SHARE_SAVED_PAGES
                                   and checkpoint_compression == "none")
        ensure_reaper()
        #: Start sandboxes under the node's reaper daemon (docs/runtime.md); off with
        #: FORKYARD_REAPER_DAEMON=0.
        self.reaper_daemon = os.environ.get("FORKYARD_REAPER_DAEMON", "1") != "0"
        #: Send a restored envd SIGUSR1 (:meth:`_rearm_envd`) before restore returns.
        self.rearm_envd = ENVD_REARM
        #: Disks made ahead of demand (:meth:`start_spares`); None: made at each start.
        self.spare_disks: disk.SpareDisks | None = None
        self._spare_task: asyncio.Task | None = None
        self._starts = 0  # run/restore in flight: spares are made only while none is
        self._last_start = 0.0  # time.monotonic() when the last one ended

    # ---- command plumbing -------------------------------------------------------------
    def _runsc(self) -> str:
        if self.runsc_path is None:
            raise RuntimeError_(f"runsc binary {self.settings.runsc!r} not found (set FORKYARD_RUNSC "
                                f"or install gVisor with ./deploy/up.sh)")
        return self.runsc_path

    def _global_flags(self) -> list[str]:
        flags = [f"--root={self.settings.runsc_root}"]
        if self.debug:
            logdir = self.settings.data_dir / "runsc-debug"
            logdir.mkdir(parents=True, exist_ok=True)
            flags += ["--debug", f"--debug-log={logdir}/"]
        return flags + self.extra_flags

    def _sandbox_flags(self, workdir: Path) -> list[str]:
        if self.overlay == "dir":
            overlay = f"root:dir={self._overlay_dir(workdir)}"
        else:
            overlay = "root:memory"
        # --net-disconnect-ok: without it a checkpoint fails as soon as any TCP
        # connection (even one in TIME_WAIT) exists ("endpoint cannot be saved in
        # connected state"); with it such connections are reset on save.
        return [
            "--network=sandbox",
            "--net-disconnect-ok",
            "--cpu-num-from-quota",
            f"--overlay2={overlay}",
            *([SHARE_PAGES_FLAG] if self.shares_restored_pages else []),
        ]

    @staticmethod
    def _overlay_dir(workdir: Path) -> Path:
        return workdir / "overlay"

    async def _run(self, args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> tuple[int, str, str]:
        """Run ``runsc <global flags> <args>``; return ``(rc, stdout, stderr)``.

        Raises:
            RuntimeError_: runsc missing, or it did not finish within ``timeout`` s.
        """
        argv = [self._runsc(), *self._global_flags(), *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            try:
                proc.kill()
            except ProcessLookupError:
                pass
            await proc.wait()
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise RuntimeError_(f"runsc {args[0]} timed out after {timeout:.0f} s") from None
        return proc.returncode, out.decode(errors="replace"), _summarize(err.decode(errors="replace"))

    # ---- spare disks --------------------------------------------------------------------
    async def start_spares(self, disk_mb: int) -> None:
        """Keep :data:`SPARE_DISKS` disks of ``disk_mb`` MiB (the node's default) made
        and mounted under ``<data dir>/spare-disks``, so a start with that disk size
        moves one in instead of making it (see :class:`.disk.SpareDisks`); leftovers of
        a crashed earlier process there are removed first. Only with ``overlay="dir"``."""
        if self.overlay != "dir" or SPARE_DISKS <= 0 or not disk_mb:
            return
        spares = disk.SpareDisks(self.settings.data_dir / "spare-disks", SPARE_DISKS, disk_mb)
        await asyncio.to_thread(spares.clear)
        self.spare_disks = spares
        self._refill_spares()

    def _refill_spares(self) -> None:
        if self.spare_disks is not None and (self._spare_task is None or self._spare_task.done()):
            self._spare_task = asyncio.get_running_loop().create_task(self._fill_spares(), name="spare-disks")

    async def _fill_spares(self) -> None:
        """Make spare disks one at a time, each only while no start is in flight nor
        ended in the last :data:`SPARE_QUIET_S` (they need the CPU now; spares are for
        the next one)."""
        spares = self.spare_disks
        while spares is not None and spares is self.spare_disks and spares.wanted():
            # Also not right after one: the caller still waits for that sandbox's envd.
            while self._starts or time.monotonic() - self._last_start < SPARE_QUIET_S:
                await asyncio.sleep(0.05)
            try:
                await asyncio.to_thread(spares.fill, True)
            except (disk.DiskError, OSError) as e:
                log.warning("making a spare disk failed: %s; starts make their own", e)
                return

    async def stop_spares(self) -> None:
        """Stop making spare disks and remove the ready ones. Never raises."""
        spares, self.spare_disks = self.spare_disks, None
        if self._spare_task is not None:
            await asyncio.wait([self._spare_task])  # finishes the disk it is making
            self._spare_task = None
        if spares is not None:
            await asyncio.to_thread(spares.clear)

    def spare_mounts(self) -> list[str]:
        """Mount points of the ready spare disks."""
        return self.spare_disks.mounts() if self.spare_disks is not None else []

    # ---- lifecycle ----------------------------------------------------------------------
    async def create(self, spec: SandboxSpec) -> None:
        """Start sandbox ``spec.sandbox_id`` with init (envd) as root, in ``spec.netns_path``.

        Uses ``runsc run --detach`` (measured faster than ``create`` + ``start``: one
        runsc invocation instead of two). Returns when runsc reports the container started.
        The slot's ``eth0`` must carry the guest address: runsc moves the address and
        routes into the sandbox, so a slot whose sandbox stopped must be re-``allocate``d
        before it serves another sandbox (``NetworkManager.allocate`` restores them).

        Raises:
            RuntimeError_: bad spec (missing rootfs/netns/envd), the id already exists,
                or runsc failed (message = runsc's output). Everything created here is
                removed first.
        """
        bundle = ocispec.bundle_dir(spec.workdir)
        await self._start(spec, "run", ["run", "--detach", f"--bundle={bundle}", spec.sandbox_id])

    async def restore(self, spec: SandboxSpec, image_dir: Path, phases: dict[str, float] | None = None) -> None:
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
        image_dir = Path(image_dir)
        if not image_dir.is_dir():
            raise RuntimeError_(f"checkpoint image {image_dir} does not exist")
        image_build = read_image_build(image_dir)
        if image_build is not None and image_build != self.build:
            raise RuntimeMismatch(image_build, self.build)
        bundle = ocispec.bundle_dir(spec.workdir)
        # A sandbox cold-booted from a filesystem-only image carries the rootfs-tar
        # annotation in its checkpoint, and runsc refuses a restore whose annotations
        # differ. Restore does not lay the tar again (the overlay comes from the image),
        # so the value only has to name a readable tar: the constant placeholder (an
        # empty tar), or — images from before it — the old per-image path, if present.
        if (image_dir / ocispec.ROOTFS_TAR_MARKER).is_file():  # a small file: no thread hop
            rootfs_tar = image_rootfs_tar(image_dir)
        else:  # images from before the marker: the checkpoint.img header is read (~1 ms)
            rootfs_tar = await asyncio.to_thread(image_rootfs_tar, image_dir)
        if rootfs_tar is not None:
            await asyncio.to_thread(self._provide_tar, rootfs_tar)
        # Images made before /tmp and /dev/shm were sized restore with the mounts they
        # were made with (a new /tmp mount over a restored one loses its files).
        await self._start(
            spec,
            "restore",
            ["restore", "--detach", f"--image-path={image_dir}", f"--bundle={bundle}", spec.sandbox_id],
            sized_tmp=(image_dir / ocispec.SIZED_TMP_MARKER).exists(),
            rootfs_tar=rootfs_tar,
            phases=phases,
        )
        if self.init_argv[0] == ocispec.ENVD_GUEST_PATH and self.rearm_envd:
            t0 = time.perf_counter()
            await self._rearm_envd(spec.sandbox_id)
            if phases is not None:
                phases["rearm"] = (time.perf_counter() - t0) * 1000

    @staticmethod
    def _provide_tar(value: str) -> None:
        """Make sure the rootfs-tar annotation ``value`` of an image names a readable
        tar (see :meth:`restore`): the placeholder is (re)created; an older image's
        per-image path must still exist. It is never recreated: it lies in the image
        cache or a staging directory, where an empty tar would pass for the real
        filesystem image of that snapshot (the cache adopts any directory there).

        Raises:
            RuntimeError_: an older image's path is gone, or the placeholder could not
                be created.
        """
        path = Path(value)
        try:
            if path == ocispec.ROOTFS_TAR_PLACEHOLDER:
                ocispec.ensure_empty_tar(path)
                return
        except OSError as e:
            raise RuntimeError_(f"cannot create {path}: {e}") from e
        if not path.is_file():
            raise RuntimeError_(
                f"this checkpoint was made (before forkyard recorded it otherwise) from a sandbox booted over "
                f"filesystem image {value}, which is gone; runsc restores it only with that file present")

    async def _rearm_envd(self, sandbox_id: str) -> None:
        """Tell a restored envd to re-register its listening socket (SIGUSR1, ~9-20 ms
        of ``runsc kill``); only with :data:`ENVD_REARM`.

        runsc (0.0~20240729) resets every TCP connection of a checkpoint
        (``--net-disconnect-ok``); when the image held any, the restored listening
        socket's existing edge-triggered epoll registration never fired again, so Go's
        poller never woke envd's Accept: clients connected and then waited forever.
        envd re-registers the socket on SIGUSR1 (and by itself within ~1 s otherwise, see
        envd ``server.RearmListener``). The pinned build marks every epoll interest
        ready at restore (gVisor PR 14147), so this is off by default
        (docs/runtime.md). Best effort: a failure is logged, not raised.
        """
        try:
            rc, _, err = await self._run(["kill", sandbox_id, "USR1"])
        except RuntimeError_ as exc:
            rc, err = -1, str(exc)
        if rc != 0:
            log.warning("runsc kill %s USR1 (envd listener rearm) failed: %s", sandbox_id, err)

    def _process_argv(self) -> list[str]:
        """argv of the container's first process (init, maybe behind the broker launch)."""
        if not self.sudo_broker:
            return list(self.init_argv)
        return ["/bin/sh", "-c", _BROKER_LAUNCH, self.init_argv[0], *self.init_argv]

    def _container_files_exist(self, sandbox_id: str) -> bool:
        root = self.settings.runsc_root
        try:
            return any(p.name.startswith(f"{sandbox_id}_") for p in root.iterdir())
        except FileNotFoundError:
            return False

    async def _start(self, spec: SandboxSpec, op: str, args: list[str], sized_tmp: bool = True,
                     rootfs_tar: str | None = None, phases: dict[str, float] | None = None) -> None:
        """Write the bundle and run ``runsc <args>`` (``run`` or ``restore``) in a private
        mount namespace. A cold boot over ``spec.rootfs_upper_tar`` annotates the spec
        with :data:`~.spec.ROOTFS_TAR_PLACEHOLDER` and bind-mounts the real tar over it
        in that namespace; a restore passes ``rootfs_tar`` (the image's annotation)."""
        sid = spec.sandbox_id
        if not Path(spec.rootfs).is_dir():
            raise RuntimeError_(f"rootfs {spec.rootfs} is not a directory")
        if not os.path.exists(spec.netns_path):
            raise RuntimeError_(f"network namespace {spec.netns_path} does not exist")
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
        if self._container_files_exist(sid):
            raise RuntimeError_(f"runsc {op} {sid}: a container with this id already exists")
        if spec.rootfs_upper_tar is not None and not Path(spec.rootfs_upper_tar).is_file():
            raise RuntimeError_(f"filesystem image {spec.rootfs_upper_tar} does not exist")

        self._starts += 1
        try:
            await self._start_counted(spec, op, args, sized_tmp, rootfs_tar, phases, envd)
        finally:
            self._starts -= 1
            self._last_start = time.monotonic()

    async def _start_counted(self, spec: SandboxSpec, op: str, args: list[str], sized_tmp: bool,
                             rootfs_tar: str | None, phases: dict[str, float] | None, envd: Path | None) -> None:
        """:meth:`_start` after its checks, counted in ``_starts``."""
        sid = spec.sandbox_id
        self.settings.runsc_root.mkdir(parents=True, exist_ok=True)
        spec.workdir.mkdir(parents=True, exist_ok=True)
        phases = {} if phases is None else phases
        t0 = time.perf_counter()
        if self.overlay == "dir":
            overlay = self._overlay_dir(spec.workdir)
            overlay.mkdir(parents=True, exist_ok=True)
            if spec.disk_mb:
                spares = self.spare_disks
                try:
                    if (spares is not None and not disk.is_mounted(overlay)
                            and spares.take_into(spec.workdir, overlay, spec.disk_mb)):
                        pass  # moved in: a rename and a syscall, no thread hop needed
                    else:
                        await asyncio.to_thread(disk.attach, spec.workdir, overlay, spec.disk_mb)
                except disk.DiskError as e:
                    raise RuntimeError_(f"sandbox {sid}: disk of {spec.disk_mb} MiB: {e}") from e
                if spares is not None:
                    self._refill_spares()
        phases["disk"] = (time.perf_counter() - t0) * 1000
        snippet = _SYSNET_WORKAROUND
        if spec.rootfs_upper_tar is not None:
            placeholder = ocispec.ROOTFS_TAR_PLACEHOLDER
            try:
                await asyncio.to_thread(ocispec.ensure_empty_tar, placeholder)
            except OSError as e:
                raise RuntimeError_(f"cannot create {placeholder}: {e}") from e
            rootfs_tar = str(placeholder)
            snippet = _SYSNET_WITH_TAR.format(tar=shlex.quote(str(Path(spec.rootfs_upper_tar).resolve())),
                                              placeholder=shlex.quote(str(placeholder)))
        ocispec.write_bundle(spec, self._process_argv(), envd, sized_tmp=sized_tmp, rootfs_tar=rootfs_tar)

        console = spec.workdir / "console.log"
        argv = [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", snippet,
            self._runsc(), *self._global_flags(), *self._sandbox_flags(spec.workdir),
            *(["--allow-rootfs-tar-annotation"] if rootfs_tar is not None else []), *args,
        ]  # fmt: skip
        ok = False
        t1 = time.perf_counter()
        try:
            with open(console, "ab") as out:
                offset = out.tell()
                proc = await self._spawn_detached(argv, out)
            try:
                rc = await asyncio.wait_for(proc.wait(), START_TIMEOUT_S)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                raise RuntimeError_(f"runsc {op} {sid} timed out after {START_TIMEOUT_S:.0f} s") from None
            if rc != 0:
                with open(console, "rb") as f:
                    f.seek(offset)
                    full = f.read()[-20000:].decode(errors="replace")
                # The whole of it (gVisor internals, heap addresses) stays in the log and
                # console.log; the error, which reaches API clients, carries a short form.
                log.warning("runsc %s %s failed (exit %s): %s", op, sid, rc, _summarize(full))
                said = _POINTER.sub("0x…", _summarize(full, limit=400))
                raise RuntimeError_(f"runsc {op} {sid} failed (exit {rc}): {said or 'no output'}")
            phases["runsc"] = (time.perf_counter() - t1) * 1000
            ok = True
        finally:
            if not ok:
                await asyncio.shield(self._cleanup(sid, spec.workdir))

    async def _spawn_detached(self, argv: list[str], out):
        """Start ``argv`` (``runsc run/restore --detach`` in its wrapper) with stdout and
        stderr to the file ``out``, as a child of the node's reaper daemon
        (:func:`.reaper.spawn`): the sandbox and gofer it leaves behind are then reaped
        at once when they die, also after this server process was restarted. Falls back
        to a child of this process (reaped by this process's reaper thread, or by PID 1
        after a restart: ~1-2 s per destroy) when the daemon cannot be used.

        Returns:
            an object with ``pid``, ``async wait() -> int`` and ``kill()``.
        """
        if self.reaper_daemon:
            try:
                with open(os.devnull, "rb") as devnull:
                    return await reaper.spawn(self.settings.runsc_root, argv, devnull.fileno(), out.fileno(),
                                              out.fileno())
            except OSError as e:
                log.warning("reaper daemon unavailable (%s); runsc runs as this process's child", e)
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)

    def _state_file(self, sandbox_id: str) -> dict | None:
        """runsc's on-disk container state (internal format; None if absent/unreadable)."""
        try:
            for path in self.settings.runsc_root.glob(f"{sandbox_id}_sandbox:*.state"):
                return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        return None

    async def _kill_sandbox_process(self, sandbox_id: str) -> None:
        """SIGKILL the sandbox process and wait (≤ 2 s) until it is reaped.

        ``runsc delete --force`` does the same but then polls every 100 ms; killing
        first and waiting here (the reaper reaps within a millisecond or so) makes
        destroy ~100 ms faster. Best effort: any surprise leaves the work to runsc.
        """
        st = self._state_file(sandbox_id)
        try:
            pid = int((st or {}).get("sandbox", {}).get("pid") or 0)
        except (TypeError, ValueError, AttributeError):
            return
        if pid <= 1 or not _pid_alive(pid):
            return
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(b"runsc-sandbox"):
                    return  # pid reused by something else
            os.kill(pid, 9)
        except (OSError, ProcessLookupError):
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while os.path.exists(f"/proc/{pid}") and loop.time() < deadline:
            await asyncio.sleep(0.002)
        # The gofer exits once the sandbox is gone; make sure, so no runsc process
        # outlives destroy (runsc delete signals it but does not wait for it).
        try:
            gofer = int((st or {}).get("goferPid") or 0)
        except (TypeError, ValueError):
            gofer = 0
        if gofer > 1 and _pid_alive(gofer):
            try:
                with open(f"/proc/{gofer}/cmdline", "rb") as f:
                    if f.read().startswith(b"runsc-gofer"):
                        os.kill(gofer, 9)
            except OSError:
                return
            deadline = loop.time() + 2.0
            while os.path.exists(f"/proc/{gofer}") and loop.time() < deadline:
                await asyncio.sleep(0.002)

    async def _cleanup(self, sandbox_id: str, workdir: Path | None) -> str | None:
        """Force-delete the container and remove bundle + overlay; return runsc's error
        (None on success or when it did not exist). Never raises."""
        error = None
        try:
            await self._kill_sandbox_process(sandbox_id)
            rc, _, err = await self._run(["delete", "--force", sandbox_id])
            if rc != 0 and not _missing(err):
                error = err or f"exit {rc}"
        except RuntimeError_ as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001
            error = repr(exc)
        if error is None:
            _remove_cgroups(sandbox_id)
        if workdir is not None:
            disk.detach(workdir, self._overlay_dir(workdir))
            for path in (ocispec.bundle_dir(workdir), self._overlay_dir(workdir)):
                shutil.rmtree(path, ignore_errors=True)
        return error

    def disk_usage(self, workdir: Path) -> tuple[int, int] | None:
        """``(used, total)`` bytes of the sandbox's disk (its writable layer), None when
        it has no disk of its own."""
        return disk.usage(self._overlay_dir(workdir))

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
            rc, out, _ = await self._run(["state", sandbox_id])
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
        rc, out, err = await self._run(["list", "--format=json"])
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
        rc, out, err = await self._run(["state", sandbox_id])
        if rc != 0:
            if _missing(err):
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
        if _pid_alive(pid):
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
        return pid > 0 and _pid_alive(pid)

    async def usage(self, sandbox_id: str) -> RuntimeUsage | None:
        """The sandbox's cgroup CPU figures (see :func:`cgroup_usage`)."""
        return cgroup_usage(sandbox_id)

    def memory_in_use(self, sandbox_ids: list[str]) -> dict[str, int]:
        """Unreclaimable host memory (bytes) of each sandbox with a memory cgroup
        (:func:`cgroup_memory_in_use`); ~20 µs a sandbox."""
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
        rc, _, err = await self._run(["pause", sandbox_id])
        if rc != 0:
            raise RuntimeError_(f"runsc pause {sandbox_id} failed: {err}")

    async def thaw(self, sandbox_id: str) -> None:
        """Continue a frozen sandbox (``runsc resume``).

        Raises:
            RuntimeError_: runsc failed (message = its stderr).
        """
        rc, _, err = await self._run(["resume", sandbox_id])
        if rc != 0:
            raise RuntimeError_(f"runsc resume {sandbox_id} failed: {err}")

    async def is_frozen(self, sandbox_id: str) -> bool:
        """True when the sandbox exists and is frozen (runsc status ``paused``)."""
        st = await self.state(sandbox_id)
        return bool(st) and st.get("status") == "paused"

    async def large_changed_files(self, sandbox_id: str, min_bytes: int) -> list[tuple[str, int]] | None:
        """``[(path, apparent size in bytes)]`` of the running sandbox's rootfs files
        larger than ``min_bytes`` that are not unchanged template files, or None when
        they cannot be listed (no ``find`` with ``-printf`` in the template, or runsc
        failed). Sparse files count at their apparent size.

        ``runsc tar rootfs-upper`` reads each file whole into the sentry's memory
        (measured: a 1 GiB sparse file got a 512 MiB sandbox OOM-killed during the
        export, while 150 MiB of files in total exported fine), so one file too large
        must be found before the export starts; a byte count of the tar stream cannot
        stop it. Runs ``find / -xdev -type f -size +N`` inside (``runsc exec``, as
        root; ~0.5-3 s, the rootfs is walked); a file whose template copy (host side)
        has the same size and mtime is the unchanged lower layer and is left out.
        """
        try:
            rc, out, err = await self._run(
                ["exec", "--user=0:0", sandbox_id, "find", "/", "-xdev", "-type", "f",
                 "-size", f"+{max(0, min_bytes)}c", "-printf", r"%s %T@ %p\n"],
                timeout=CHECKPOINT_TIMEOUT_S)
        except RuntimeError_ as e:
            log.warning("listing large files of %s failed: %s", sandbox_id, e)
            return None
        if rc not in (0, 1) or (rc == 1 and not out):  # 1: some paths unreadable (e.g. /proc races)
            log.warning("listing large files of %s failed (exit %s): %s", sandbox_id, rc, err)
            return None
        root = None
        st = self._state_file(sandbox_id)
        try:
            rootfs = Path((st or {}).get("spec", {}).get("root", {}).get("path") or "")
            root = rootfs if str(rootfs) not in ("", ".") else None
        except AttributeError:
            root = None
        found = []
        for line in out.splitlines():
            size_s, _, rest = line.partition(" ")
            mtime_s, _, name = rest.partition(" ")
            try:
                size, mtime = int(size_s), float(mtime_s)
            except ValueError:
                continue
            if root is not None:
                try:
                    lower = os.lstat(root / name.lstrip("/"))
                    if lower.st_size == size and abs(lower.st_mtime - mtime) < 1e-3:
                        continue  # the template's own file, unchanged
                except (OSError, ValueError):
                    pass
            found.append((name, size))
        return found

    async def export_rootfs(self, sandbox_id: str, path: Path, max_bytes: int | None = None) -> int:
        """Write the sandbox's rootfs overlay upper layer to ``path`` as a tar
        (``runsc tar rootfs-upper``): new and changed files with their modes, owners and
        xattrs, deletions of template files as whiteouts (character devices 0/0) and
        replaced directories as opaque ones. :meth:`create` lays it back with
        :attr:`SandboxSpec.rootfs_upper_tar`. The upper layer's directory tree lives in
        the sentry's memory (only file data is in the host filestore, an unlinked file),
        so runsc is the only way to read it. Works on a frozen sandbox (measured: 50 MB
        in 0.17 s). Separate mounts (``/tmp``, ``/dev/shm``) are not part of it.
        Written to ``<path>.tmp``, fsynced and renamed. Returns the tar's bytes.

        runsc writes the tar into a FIFO that this process copies to ``<path>.tmp``,
        counting: with ``max_bytes``, once the tar passes it the FIFO is closed (the
        sentry's next write fails with EPIPE and it stops) — a sparse file is written
        at its full apparent size, so only the stream itself shows how large the image
        is, and an unbounded export of a large layer got the sandbox OOM-killed.

        Raises:
            ExportTooLarge: the tar exceeded ``max_bytes``; nothing is left at ``path``.
            RuntimeError_: runsc failed (message = its stderr); nothing is left at ``path``.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        fifo = path.with_name(path.name + ".fifo")
        fifo.unlink(missing_ok=True)
        os.mkfifo(fifo, 0o600)
        state = {"size": 0, "over": False}

        def _copy() -> None:
            rfd = os.open(fifo, os.O_RDONLY)  # blocks until runsc opens it (or _unblock)
            try:
                with open(tmp, "wb") as out:
                    os.chmod(tmp, 0o600)
                    while chunk := os.read(rfd, 1 << 20):
                        state["size"] += len(chunk)
                        if max_bytes is not None and state["size"] > max_bytes:
                            state["over"] = True
                            return
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            finally:
                os.close(rfd)

        def _unblock() -> None:
            # runsc exited without opening the FIFO: open it ourselves so _copy's open
            # returns (and reads EOF once we close it).
            try:
                fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
                os.close(fd)
            except OSError:
                pass

        copier = asyncio.ensure_future(asyncio.to_thread(_copy))
        try:
            try:
                rc, _, err = await self._run(["tar", "rootfs-upper", f"--file={fifo}", sandbox_id],
                                             timeout=CHECKPOINT_TIMEOUT_S)
            finally:
                if not copier.done():
                    await asyncio.to_thread(_unblock)
                await asyncio.shield(copier)
            if state["over"]:
                raise ExportTooLarge(state["size"], max_bytes or 0)
            if rc != 0 or not tmp.is_file():
                raise RuntimeError_(f"runsc tar rootfs-upper {sandbox_id} failed: {err or 'no archive written'}")
            os.replace(tmp, path)
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
            return state["size"]
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            fifo.unlink(missing_ok=True)

    # ---- checkpoint / restore ------------------------------------------------------------
    def _checkpointing(self) -> list[str]:
        """Ids that a ``runsc --root=<ours> checkpoint`` process is working on now."""
        root = f"--root={self.settings.runsc_root}"
        ids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                argv = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            args = [a.decode(errors="replace") for a in argv if a]
            if root in args and "checkpoint" in args:
                ids.append(args[-1])
        return ids

    async def wait_checkpoints(self, timeout_s: float) -> list[str]:
        """Wait (≤ ``timeout_s``, polling every 50 ms) until no ``runsc checkpoint`` of
        this root runs — one started by a server that was killed keeps going, and the
        sandbox's fate (stopped with a complete image, or still running) is only known
        once it ends. Returns the ids still checkpointing at the deadline."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while ids := await asyncio.to_thread(self._checkpointing):
            if asyncio.get_running_loop().time() >= deadline:
                return ids
            await asyncio.sleep(0.05)
        return []

    async def checkpoint(self, sandbox_id: str, image_dir: Path, leave_running: bool,
                         keep_stopped: bool = False) -> None:
        """Write the sandbox's memory and filesystem (overlay) state into ``image_dir``
        (``runsc checkpoint``; created if missing).

        With ``leave_running`` the sandbox continues afterwards (fork/snapshot; runsc
        saves, then restores it in place). Without it the sentry stops the sandbox right
        after the image is complete — nothing runs past the checkpoint (pause) — and the
        driver deletes the stopped container (its bundle and overlay too) so the same id
        can be restored, unless ``keep_stopped`` (the caller destroys it later).
        runsc runs in its own session: a server killed meanwhile does not stop it (see
        :meth:`wait_checkpoints`).

        Raises:
            RuntimeError_: runsc failed (message = its stderr); the sandbox is left as
                runsc left it.
        """
        image_dir = Path(image_dir)
        image_dir.mkdir(parents=True, exist_ok=True)
        args = ["checkpoint", f"--image-path={image_dir}", f"--compression={self.checkpoint_compression}"]
        if leave_running:
            args.append("--leave-running")
            if self.shares_saved_pages:
                args.append("--share-saved-pages")
        rc, _, err = await self._run([*args, sandbox_id], timeout=CHECKPOINT_TIMEOUT_S)
        if rc != 0:
            raise RuntimeError_(f"runsc checkpoint {sandbox_id} failed: {err}")
        write_image_build(image_dir, self.build)
        st = None
        bundle = ocispec.bundle_dir(self.settings.sandboxes_dir / sandbox_id)
        if not bundle.is_dir():
            st = await self.state(sandbox_id)
            bundle = Path(st["bundle"]) if st and st.get("bundle") else bundle
        if ocispec.has_sized_tmp(bundle):  # see restore
            (image_dir / ocispec.SIZED_TMP_MARKER).write_text("1\n")
        # See restore: the same annotation must be passed again (empty file: none).
        rootfs_tar = ocispec.rootfs_tar_annotation(bundle)
        (image_dir / ocispec.ROOTFS_TAR_MARKER).write_text((rootfs_tar or "") + "\n")
        if not leave_running and not keep_stopped:
            st = st or await self.state(sandbox_id)
            workdir = Path(st["bundle"]).parent if st and st.get("bundle") else None
            error = await self._cleanup(sandbox_id, workdir)
            if error is not None:
                raise RuntimeError_(f"runsc delete {sandbox_id} after checkpoint failed: {error}")
