"""The runsc binary: which one (resolved once, links included), its build, what it
supports, and running it with the node's global flags (``--root``, debug logging).
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import SHARE_ALL, SHARE_OFF, GVisorSettings, Settings
from forkyard.runtime.base import RuntimeError_, SandboxSpec
from forkyard.runtime.gvisor import spec as ocispec

log = logging.getLogger(__name__)

#: Hexadecimal addresses in runsc's messages (e.g. ``&{0xc000a1b2c0 …}``): internals
#: that mean nothing to a client.
POINTER = re.compile(r"0x[0-9a-f]{6,}")
_NOT_FOUND = ("does not exist", "not found", "no such file")
COMMAND_TIMEOUT_S = 30.0
#: Shell snippet run in a private mount namespace before exec'ing runsc: runsc ≤ 2024
#: refuses ``--network=sandbox`` when ``/proc/sys/net/core/rmem_default`` exists, which on
#: kernels ≥ 6 is true in every netns, so a tmpfs hides ``/proc/sys/net`` for this runsc
#: only (docs/runtime.md). Only ``run``/``restore`` need it.
_SYSNET_WORKAROUND = 'mount -t tmpfs -o size=4k,mode=0555 forkyard-sysnet /proc/sys/net && exec "$0" "$@"'
#: Same, also bind-mounting the real filesystem image (``{tar}``) over
#: :data:`~.spec.ROOTFS_TAR_PLACEHOLDER` (the annotation's constant value) for this runsc
#: only: the mount namespace is private, so the host and other starts see the empty tar.
_SYSNET_WITH_TAR = ('mount -t tmpfs -o size=4k,mode=0555 forkyard-sysnet /proc/sys/net'
                    ' && mount --bind {tar} {placeholder} && exec "$0" "$@"')


def missing(message: str) -> bool:
    """Whether runsc's ``message`` says the container does not exist."""
    low = message.lower()
    return any(s in low for s in _NOT_FOUND)


def summarize(text: str, limit: int = 2000) -> str:
    """runsc's message without Go stack dumps, at most ``limit`` characters."""
    text = text.strip()
    cut = text.find("\ngoroutine ")
    if cut > 0:
        text = text[:cut].rstrip(" :\n") + " [stack trace omitted]"
    if len(text) > limit:
        text = text[: limit // 2] + " … " + text[-limit // 2 :]
    return text


def runsc_build(runsc: str) -> str:
    """``runsc --version``'s first line (e.g. ``runsc version 0.0~20240729.0``), or
    ``"unknown"`` when it does not run. Blocking (≤ 10 s)."""
    try:
        out = subprocess.run([runsc, "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0].strip() if out.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def runsc_keeps_tmp(runsc: str) -> bool:
    """Whether the runsc binary has forkyard's patch 0002 (it honours
    :data:`~.spec.TMP_ANNOTATION`, keeping ``/tmp`` on the rootfs): its name is in the
    binary. A build from before the patch shares the version string (boot-only patches
    are left out of it, deploy/runsc/build.sh) but would put its own unsized tmpfs over
    ``/tmp``. Searches the binary (~100 MB, mapped: 20-80 ms measured); False when
    unreadable."""
    try:
        with open(runsc, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return m.find(ocispec.TMP_ANNOTATION.encode()) >= 0
    except (OSError, ValueError):
        return False


#: runsc's flag (forkyard's runsc patch 0020) that makes a restore map the image's pages
#: copy-on-write instead of copying them (docs/runtime.md "Memory").
SHARE_PAGES_FLAG = "--share-restored-pages"
#: Its ``runsc checkpoint --leave-running`` counterpart: the source maps the image it wrote.
SHARE_SAVED_FLAG = "--share-saved-pages"


def runsc_supports(runsc: str, flag: str) -> bool:
    """True when ``runsc`` accepts the global boolean ``flag`` (``runsc FLAG --version``
    exits 0; an unknown flag exits 2). Blocking (≤ 10 s)."""
    try:
        return subprocess.run([runsc, flag, "--version"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def overlay_dir(workdir: Path) -> Path:
    """Where a sandbox's writable layer lives on the host (``<workdir>/overlay``)."""
    return workdir / "overlay"


def overlay_flag(spec: SandboxSpec, overlay: str) -> str:
    """``--overlay2`` for ``spec``: where the writable layer lives (``overlay``: ``dir``,
    a host directory on the sandbox's disk, or ``memory``; the one place that chooses
    its medium) and how large it is.

    ``size=`` (the sandbox's disk, ``disk_mb`` MiB; none when 0) bounds the overlay's
    upper tmpfs inside the sentry, and the root overlay reports its upper layer in
    ``statfs`` (gVisor ``overlay.statFS``, as Linux's ``ovl_statfs``): so ``df /``
    inside shows the disk's size and what was written to it, instead of an unbounded
    8.0E. The host-side disk (:mod:`.disk`) stays the hard bound.
    """
    medium = f"root:dir={overlay_dir(spec.workdir)}" if overlay == "dir" else "root:memory"
    return f"--overlay2={medium},size={spec.disk_mb}m" if spec.disk_mb else f"--overlay2={medium}"


def sandbox_flags(spec: SandboxSpec, overlay: str, share_pages: bool) -> list[str]:
    """runsc's per-sandbox flags for a ``run``/``restore`` of ``spec`` (before the
    command): network, CPU count, the overlay (:func:`overlay_flag`) and
    :data:`SHARE_PAGES_FLAG` when restores share the image's pages."""
    # --net-disconnect-ok: without it a checkpoint fails as soon as any TCP
    # connection (even one in TIME_WAIT) exists ("endpoint cannot be saved in
    # connected state"); with it such connections are reset on save.
    return [
        "--network=sandbox",
        "--net-disconnect-ok",
        "--cpu-num-from-quota",
        overlay_flag(spec, overlay),
        *([SHARE_PAGES_FLAG] if share_pages else []),
    ]


@dataclass(frozen=True)
class Features:
    """What a node's runsc build does with its settings, probed once at start.

    Attributes:
        new_tmp: how new sandboxes mount ``/tmp``: :data:`~.spec.TMP_ROOTFS` (on their
            disk) when the build has forkyard's patch 0002, else :data:`~.spec.TMP_SIZED`
            (a tmpfs of a quarter of their memory, as before).
        shares_saved_pages: leave-running checkpoints share the image with the sandbox,
            for the ones :attr:`share_scope` names (restores share,
            ``runtime.share_saved_pages`` and no checkpoint compression).
        share_scope: which restores map the image's pages instead of copying them:
            :data:`~forkyard.config.SHARE_FORKS` (a fork's checkpoint and its children
            only), :data:`~forkyard.config.SHARE_ALL`, or :data:`~forkyard.config.SHARE_OFF`
            (none: asked for, or a build without :data:`SHARE_PAGES_FLAG`, patch 0020).
    """

    new_tmp: str
    shares_saved_pages: bool
    share_scope: str = SHARE_OFF

    def shares(self, fork: bool) -> bool:
        """Whether a restore from (or a leave-running checkpoint into) a ``fork``'s
        image, or another one, maps the image's pages shared (restores; for
        checkpoints also check :attr:`shares_saved_pages`)."""
        return self.share_scope == SHARE_ALL or (fork and self.share_scope != SHARE_OFF)


def probe_features(path: str | None, runtime: GVisorSettings, compression: str) -> Features:
    """Probe runsc at ``path`` (None: not installed) for :class:`Features`; logs a
    warning for each asked-for feature the build lacks. Blocking (≤ 10 s, one
    ``--version`` run and a search of the binary)."""
    keeps_tmp = bool(path) and runsc_keeps_tmp(path)
    if path and not keeps_tmp:
        log.warning("%s lacks forkyard's runsc patch 0002 (deploy/runsc/build.sh): sandboxes get a /tmp "
                    "tmpfs of a quarter of their memory instead of /tmp on their disk", path)
    asked = runtime.share_restored_pages != SHARE_OFF
    shares = bool(asked and path and runsc_supports(path, SHARE_PAGES_FLAG))
    if asked and path and not shares:
        log.warning("FORKYARD_SHARE_RESTORED_PAGES=%s but %s lacks %s (forkyard's runsc patch 0020, "
                    "deploy/runsc/build.sh): restores copy their memory", runtime.share_restored_pages, path,
                    SHARE_PAGES_FLAG)
    return Features(new_tmp=ocispec.TMP_ROOTFS if keeps_tmp else ocispec.TMP_SIZED,
                    shares_saved_pages=shares and runtime.share_saved_pages and compression == "none",
                    share_scope=runtime.share_restored_pages if shares else SHARE_OFF)


class Runsc:
    """The runsc of a node.

    Args:
        settings: ``runsc`` (binary; a bare name is looked up in PATH), ``runsc_root``
            (state dir), ``data_dir`` (debug logs).
        debug: pass ``--debug --debug-log=<data_dir>/runsc-debug/``.
        extra_flags: more global flags (e.g. ``["--platform=ptrace"]``).

    Attributes:
        path: the binary, resolved once at start, links included: a later change of
            PATH (or a second runsc earlier in it), or an install that moves the runsc
            link to a newer build, must never switch builds under running sandboxes and
            their checkpoints. None when not found.
        build: its ``--version`` line ("" when not found).
    """

    def __init__(self, settings: Settings, debug: bool = False, extra_flags: list[str] | None = None):
        self.settings = settings
        self.debug = debug
        self.extra_flags = list(extra_flags or [])
        found = shutil.which(settings.runsc)
        self.path = os.path.realpath(found) if found else None
        self.build = runsc_build(self.path) if self.path else ""

    def binary(self) -> str:
        """The binary's path.

        Raises:
            RuntimeError_: none was found.
        """
        if self.path is None:
            raise RuntimeError_(f"runsc binary {self.settings.runsc!r} not found (set FORKYARD_RUNSC "
                                f"or install gVisor with ./deploy/up.sh)")
        return self.path

    def global_flags(self) -> list[str]:
        """Flags every runsc command of this node takes."""
        flags = [f"--root={self.settings.runsc_root}"]
        if self.debug:
            logdir = self.settings.data_dir / "runsc-debug"
            logdir.mkdir(parents=True, exist_ok=True)
            flags += ["--debug", f"--debug-log={logdir}/"]
        return flags + self.extra_flags

    async def run(self, args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> tuple[int, str, str]:
        """Run ``runsc <global flags> <args>``; return ``(rc, stdout, stderr)``.

        Raises:
            RuntimeError_: runsc missing, or it did not finish within ``timeout`` s.
        """
        argv = [self.binary(), *self.global_flags(), *args]
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
        return proc.returncode, out.decode(errors="replace"), summarize(err.decode(errors="replace"))

    async def check(self, args: list[str], timeout: float = COMMAND_TIMEOUT_S) -> str:
        """:meth:`run` ``args`` (the command, then its operands, the container id last);
        returns its stdout.

        Raises:
            RuntimeError_: as :meth:`run`, or runsc exited non-zero ("runsc COMMAND ID
                failed: " and its stderr).
        """
        rc, out, err = await self.run(args, timeout)
        if rc != 0:
            raise RuntimeError_(f"runsc {args[0]} {args[-1]} failed: {err}")
        return out

    def start_argv(self, sandbox_flags: list[str], args: list[str], upper_tar: Path | None = None,
                   annotated: bool = False) -> list[str]:
        """argv of a ``runsc run/restore`` (``sandbox_flags``: the flags of this sandbox;
        ``args``: the command and its operands) in a private mount namespace with the
        ``/proc/sys/net`` workaround; a cold boot over filesystem image ``upper_tar`` also
        gets it bind-mounted over the placeholder there; ``annotated``: the spec carries
        the rootfs-tar annotation."""
        if upper_tar is None:
            snippet = _SYSNET_WORKAROUND
        else:
            snippet = _SYSNET_WITH_TAR.format(tar=shlex.quote(str(Path(upper_tar).resolve())),
                                              placeholder=shlex.quote(str(ocispec.ROOTFS_TAR_PLACEHOLDER)))
        return [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", snippet,
            self.binary(), *self.global_flags(), *sandbox_flags,
            *(["--allow-rootfs-tar-annotation"] if annotated else []), *args,
        ]  # fmt: skip
