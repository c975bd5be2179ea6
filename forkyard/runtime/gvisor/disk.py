"""A sandbox's disk: the size-limited host filesystem holding its writable layer.

gVisor keeps every write of a sandbox in its rootfs overlay, whose upper layer lives in
a "filestore" file under ``--overlay2=root:dir=<workdir>/overlay`` (a deleted file:
``du`` cannot see it). Left on the host's filesystem, one sandbox could fill the host
and break the database and the repository for everyone (measured: 2 GiB in 1.3 s).
So ``<workdir>/overlay`` is a mount of its own: a sparse file ``<workdir>/disk.img`` of
the sandbox's disk size (:func:`image_mb`: a little more, for ext4's metadata), formatted
ext4 and loop-mounted. Writes beyond it fail inside the sandbox with ENOSPC; the host
loses at most the disk size. Costs ~30 ms per start (truncate + mkfs + mount, measured);
the file only takes the blocks really written.

The mount is ``nosuid,nodev`` and executable: gVisor maps the filestore's pages into
the sandbox's address space, so programs and libraries written inside the sandbox run
from it (with ``noexec`` every ``PROT_EXEC`` mapping failed: SIGSEGV). What protects it
instead is in docs/security.md.

A checkpoint carries the filestore's contents (it is part of the sandbox's state), so
pause/resume and fork work unchanged: each restore gets a fresh disk.

:class:`SpareDisks` makes disks ahead of demand (a node keeps a few of its default
size, made and mounted while nothing starts): a start then takes one with a rename and
one ``mount(MS_MOVE)`` (well under 1 ms) instead of ~12-17 ms of ``mkfs`` and a loop
mount on its critical path (measured on resume: docs/runtime.md); :class:`SpareKeeper`
makes them in the background while no start needs the host.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from forkyard.hostfs import is_mounted, run_checked, unmount

log = logging.getLogger("forkyard.runtime.disk")

IMAGE_NAME = "disk.img"


class DiskError(Exception):
    """The disk could not be made or mounted (message names the step)."""


def _run(argv: list[str]) -> None:
    run_checked(argv, DiskError)


_MS_MOVE = 8192  # <linux/mount.h>
_libc = ctypes.CDLL(None, use_errno=True)


def _move_mount(source: Path, target: Path) -> None:
    """``mount --move source target`` as one syscall (no ``mount`` process).

    Raises:
        OSError: the kernel refused (e.g. ``source`` is not a mount point, or it sits
            under a shared mount).
    """
    if _libc.mount(os.fsencode(source), os.fsencode(target), None, _MS_MOVE, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"moving the mount {source} to {target}: {os.strerror(err)}")


def image_mb(size_mb: int) -> int:
    """Size (MiB) of the ext4 image holding a disk of ``size_mb`` MiB: a little more,
    for ext4's own metadata, so that the sentry's bound on the overlay (exactly
    ``size_mb``, what ``df /`` shows inside; see :func:`.runsc.overlay_flag`) is
    reached first and a full disk is a clean ENOSPC at the size the sandbox sees.
    Measured with :func:`_make`'s options: ext4 offers 96,264 KiB of a 96 MiB image
    and 4,177,452 KiB of 4 GiB (2.0 % and 0.4 % short); the margin is 1/64 + 4 MiB."""
    return size_mb + size_mb // 64 + 4


def _make(workdir: Path, overlay_dir: Path, size_mb: int) -> None:
    image = workdir / IMAGE_NAME
    fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, image_mb(size_mb) << 20)
    finally:
        os.close(fd)
    # No journal and no reserved blocks: a scratch layer, discarded with the sandbox.
    # It holds one file (runsc's filestore), so a handful of inodes and no room to grow
    # (no resize inode) keep ext4's metadata small (the default inode tables took 2.4 %).
    _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-N", "64", "-O", "^has_journal,^resize_inode",
          "-E", "lazy_itable_init=1,nodiscard", str(image)])
    # nosuid,nodev but not noexec: gVisor maps the filestore's pages into the sandbox,
    # and a noexec mount refuses PROT_EXEC mappings, so every program or library
    # written inside the sandbox crashed with SIGSEGV (docs/security.md says what
    # protects this mount instead).
    _run(["mount", "-o", "loop,nosuid,nodev", str(image), str(overlay_dir)])
    os.chmod(overlay_dir, 0o700)


def attach(workdir: Path, overlay_dir: Path, size_mb: int) -> None:
    """Make ``overlay_dir`` a ``size_mb`` MiB ext4 filesystem backed by a sparse
    ``<workdir>/disk.img`` (idempotent: an existing mount is kept).

    Raises:
        DiskError: truncate, mkfs or mount failed (nothing is left mounted).
    """
    overlay_dir.mkdir(parents=True, exist_ok=True)
    if is_mounted(overlay_dir):
        return
    _make(workdir, overlay_dir, size_mb)


async def provide(workdir: Path, overlay_dir: Path, size_mb: int, spares: SpareDisks | None,
                  keeper: SpareKeeper | None) -> None:
    """Give a starting sandbox its disk of ``size_mb`` MiB at ``overlay_dir``: a ready
    spare moved in when ``spares`` has one of that size (a rename and a mount move, on
    the loop), else one made now (:func:`attach`, in a thread); then ``keeper`` (if
    any) makes up the spare taken.

    Raises:
        DiskError: the disk could not be made or mounted.
    """
    if not (spares is not None and not is_mounted(overlay_dir) and spares.take_into(workdir, overlay_dir, size_mb)):
        await asyncio.to_thread(attach, workdir, overlay_dir, size_mb)
    if keeper is not None:
        keeper.refill()


def detach(workdir: Path, overlay_dir: Path) -> None:
    """Unmount ``overlay_dir`` (lazily when busy; the loop device is freed with the last
    user) and delete the disk image. Never raises."""
    try:
        if is_mounted(overlay_dir):
            unmount(overlay_dir)
    except OSError as e:
        log.warning("unmounting %s failed: %s", overlay_dir, e)
    try:
        (workdir / IMAGE_NAME).unlink(missing_ok=True)
    except OSError as e:
        log.warning("removing %s failed: %s", workdir / IMAGE_NAME, e)


def usage(overlay_dir: Path) -> tuple[int, int] | None:
    """``(used bytes, total bytes)`` of a sandbox's disk, None when it has none."""
    if not is_mounted(overlay_dir):
        return None
    st = os.statvfs(overlay_dir)
    return (st.f_blocks - st.f_bfree) * st.f_frsize, st.f_blocks * st.f_frsize


class SpareDisks:
    """Disks of one size made ahead of demand, under ``root`` (``<data dir>/spare-disks``,
    0700): ``root/<n>/disk.img`` loop-mounted at ``root/<n>/overlay``, exactly as
    :func:`attach` makes them.

    :meth:`take_into` moves one into a sandbox's workdir: the image file is renamed
    (same filesystem; the loop device keeps its open file) and the mount moved with
    ``MS_MOVE``, so the sandbox's disk is then indistinguishable from one made in place
    and :func:`detach` removes it the same way. The owner calls :meth:`fill` (blocking,
    from a worker thread) when no start needs the CPU, and :meth:`clear` at start-up
    (leftovers of a crashed process) and shutdown. Thread-safe.

    A spare that cannot be moved in (``root`` on another filesystem than the workdirs,
    or under a shared mount, where ``MS_MOVE`` is refused) turns spares off: every
    start then makes its own disk, as without spares.

    Args:
        root: directory of the spares (created).
        count: spares kept ready (0: none).
        size_mb: their size (MiB): the node's default disk; starts that ask for another
            size make theirs in place.
    """

    def __init__(self, root: Path, count: int, size_mb: int):
        self.root = Path(root)
        self.count = max(0, count)
        self.size_mb = size_mb
        self._lock = threading.Lock()
        self._ready: list[Path] = []  # spare dirs, oldest first
        self._used: list[Path] = []  # emptied spare dirs, to remove
        self._next = 0
        self.hits = 0
        self.misses = 0

    def take_into(self, workdir: Path, overlay_dir: Path, size_mb: int) -> bool:
        """Move a ready spare to ``overlay_dir`` (an empty directory) and its image to
        ``workdir``/:data:`IMAGE_NAME`; False when ``size_mb`` is not the spares' size,
        none is ready, or the move failed (the caller makes a disk in place)."""
        if size_mb != self.size_mb:
            return False
        with self._lock:
            if not self._ready:
                self.misses += 1
                return False
            spare = self._ready.pop(0)
        try:
            os.rename(spare / IMAGE_NAME, workdir / IMAGE_NAME)
            try:
                _move_mount(spare / "overlay", overlay_dir)
            except OSError:
                os.rename(workdir / IMAGE_NAME, spare / IMAGE_NAME)
                raise
        except OSError as e:
            # EXDEV (spares on another filesystem than the workdirs) or EINVAL (a shared
            # parent mount: MS_MOVE refuses mounts under one) would fail every time.
            log.warning("using spare disk %s failed (%s); no more spare disks, starts make their own", spare, e)
            self._destroy(spare)
            with self._lock:
                self.misses += 1
                self.count = 0
            return False
        with self._lock:
            self.hits += 1
            # Removed by the next fill: right after the move, rmdir of the old mount
            # point took 2-60 ms here (measured), which the start need not wait for.
            self._used.append(spare)
        return True

    def wanted(self) -> bool:
        """Whether :meth:`fill` has work to do."""
        with self._lock:
            return len(self._ready) < self.count or bool(self._used)

    def fill(self, one: bool = True) -> None:
        """Remove emptied spare directories, then make spares until ``count`` are ready
        (just one with ``one``). Blocking (mkfs and a loop mount: ~12 ms each, measured).

        Raises:
            DiskError: making one failed (nothing of it is left).
        """
        with self._lock:
            used, self._used = self._used, []
        for d in used:
            shutil.rmtree(d, ignore_errors=True)
        while True:
            with self._lock:
                if len(self._ready) >= self.count:
                    return
                self._next += 1
                spare = self.root / str(self._next)
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            shutil.rmtree(spare, ignore_errors=True)
            (spare / "overlay").mkdir(parents=True)
            try:
                _make(spare, spare / "overlay", self.size_mb)
            except BaseException:
                self._destroy(spare)
                raise
            with self._lock:
                self._ready.append(spare)
            if one:
                return

    def mounts(self) -> list[str]:
        """Mount points of the ready spares (for metrics and leak checks)."""
        with self._lock:
            return [str(d / "overlay") for d in self._ready]

    def clear(self) -> None:
        """Unmount and remove every spare, and anything else under ``root`` (what a
        crashed process left). Never raises."""
        with self._lock:
            self._ready.clear()
            self._used.clear()
        try:
            with open("/proc/self/mounts") as f:
                stale = [line.split()[1] for line in f if line.split()[1].startswith(f"{self.root}/")]
        except OSError:
            stale = []
        for mnt in stale:
            self._umount(Path(mnt))
        shutil.rmtree(self.root, ignore_errors=True)

    def _destroy(self, spare: Path) -> None:
        self._umount(spare / "overlay")
        shutil.rmtree(spare, ignore_errors=True)

    @staticmethod
    def _umount(path: Path) -> None:
        try:
            if is_mounted(path):
                unmount(path)
        except OSError as e:
            log.warning("unmounting %s failed: %s", path, e)


class SpareKeeper:
    """Fills :class:`SpareDisks` in the background, one disk at a time, each only while
    ``busy()`` is False (no start in flight nor just ended: they need the CPU now; spares
    are for the next one).

    Args:
        spares: the disks to keep made.
        busy: whether starts need the host now.
    """

    def __init__(self, spares: SpareDisks, busy: Callable[[], bool]):
        self.spares = spares
        self.busy = busy
        self._task: asyncio.Task | None = None
        self._stopped = False

    def refill(self) -> None:
        """Start making disks until enough are ready (no-op while that runs)."""
        if not self._stopped and (self._task is None or self._task.done()):
            self._task = asyncio.get_running_loop().create_task(self._fill(), name="spare-disks")

    async def _fill(self) -> None:
        while not self._stopped and self.spares.wanted():
            # Also not right after a start: its caller still waits for that sandbox's envd.
            while self.busy():
                await asyncio.sleep(0.05)
            try:
                await asyncio.to_thread(self.spares.fill, True)
            except (DiskError, OSError) as e:
                log.warning("making a spare disk failed: %s; starts make their own", e)
                return

    async def stop(self) -> None:
        """Stop making disks (the one being made is finished) and remove the ready ones.
        Never raises."""
        self._stopped = True
        if self._task is not None:
            await asyncio.wait([self._task])
            self._task = None
        await asyncio.to_thread(self.spares.clear)
