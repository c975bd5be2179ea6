"""Runtime driver interface: how the orchestrator starts and stops sandboxes.

A driver owns the isolation boundary (gVisor now; QEMU/Firecracker later). It never
touches the database or the network slots: the orchestrator allocates a network slot,
passes its attachment (:attr:`SandboxSpec.network`, of the kind the driver takes:
:attr:`RuntimeDriver.attachment`) in :class:`SandboxSpec`, and records state. Commands and
files go through envd (started by the driver as the sandbox's init process), never
through the driver.

A driver also owns its image format: it writes images into directories it is given
(:meth:`RuntimeDriver.checkpoint`, :meth:`RuntimeDriver.export_filesystem`) with its own
file names, says what a directory holds (:meth:`RuntimeDriver.image_at`: an
:class:`Image` of an :class:`ImageKind`) and starts sandboxes from one
(:meth:`RuntimeDriver.create`). Above the driver an image is an opaque directory: the
repository stores and chunks its files, the orchestrator moves it around.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.network.base import NetnsAttachment


class RuntimeError_(Exception):
    """A runtime operation failed; ``str(exc)`` carries the runtime's own message."""


class ExportTooLarge(RuntimeError_):
    """A filesystem-only image would exceed its bound (:meth:`RuntimeDriver.export_filesystem`
    ``max_bytes``); nothing was kept and the sandbox is unchanged.

    Attributes:
        size: bytes exported when the export was stopped (a lower bound of the image).
        limit: the bound in bytes.
    """

    def __init__(self, size: int, limit: int):
        super().__init__(f"filesystem image larger than {limit >> 20} MiB (stopped at {size >> 20} MiB)")
        self.size, self.limit = size, limit


class RuntimeMismatch(RuntimeError_):
    """A checkpoint image was written by another runtime build than this driver's, so
    it is not restored (gVisor's checkpoint format is not stable across builds: an
    older image restored by a newer runsc fails or misbehaves).

    Attributes:
        image_build: the build recorded in the image (``runsc --version`` first line).
        build: this driver's build.
    """

    def __init__(self, image_build: str, build: str):
        self.image_build, self.build = image_build, build
        super().__init__(f"the checkpoint was made by {image_build!r} but this node runs {build!r}; "
                         f"restore it on a node with {image_build!r} (or reinstall that runtime build)")


class ImageKind(enum.Enum):
    """What an image holds."""

    #: Memory, processes and files: a sandbox started from it continues them.
    CHECKPOINT = "checkpoint"
    #: Files only (the sandbox's changes to its template): a sandbox started from it
    #: cold-boots its template with them laid over (new processes, new boot id).
    FILESYSTEM = "filesystem"


@dataclass(frozen=True)
class Image:
    """An image in a directory whose layout its driver owns.

    Attributes:
        path: the directory.
        kind: what it holds.
        build: the runtime build that wrote it (None: not recorded; images of a
            checkpoint are restored only by the build that wrote them,
            :class:`RuntimeMismatch`).
    """

    path: Path
    kind: ImageKind
    build: str | None = None


@dataclass
class SandboxSpec:
    """What a driver needs to start one sandbox, whatever the runtime.

    Attributes:
        sandbox_id: forkyard sandbox id (also the runtime container id).
        rootfs: template rootfs directory, shared read-only by all its sandboxes;
            writes land in a per-sandbox writable layer that the driver owns (a driver
            that boots a block device derives one from the directory and keeps it).
        network: the network slot's attachment the sandbox joins (for a driver whose
            :attr:`RuntimeDriver.attachment` is :class:`NetnsAttachment`: the network
            namespace it must run in, e.g. ``/run/netns/fy3s``).
        vcpus: CPU limit in cores.
        memory_mb: memory limit in MiB.
        hostname: hostname seen inside the sandbox.
        workdir: per-sandbox directory for the bundle, logs and writable state.
        env: environment for envd itself (PATH etc.); user env goes through envd ``/init``.
        disk_mb: disk size (MiB) of the writable layer, 0 for none.
        fork_child: the image restored is a fork's checkpoint (one source's, restored
            only as that source's children): a driver that shares restored pages only
            between fork children (:attr:`RuntimeDriver.shared_pages` ``"forks"``, the
            default) shares them for this restore.
    """

    sandbox_id: str
    rootfs: Path
    network: NetnsAttachment
    vcpus: int
    memory_mb: int
    hostname: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    #: size of the sandbox's writable layer in MiB (writes beyond: ENOSPC inside);
    #: 0 = unbounded (the host filesystem's free space).
    disk_mb: int = 0
    #: E2B volumes: ``(host directory, guest path)`` pairs bind-mounted read-write (the
    #: same at a restore as at the checkpoint: runsc compares the spec's mounts).
    volumes: list[tuple[Path, str]] = field(default_factory=list)
    fork_child: bool = False


@dataclass
class RuntimeUsage:
    """Resource use of one sandbox as the host sees it.

    Attributes:
        cpu_ns: CPU time used by every process of the sandbox since it started
            (nanoseconds; monotonic while the sandbox lives).
        cpu_limit: CPUs the sandbox may use (its CPU quota / period), e.g. 2.0.
    """

    cpu_ns: int
    cpu_limit: float


class RuntimeDriver(abc.ABC):
    """Abstract sandbox runtime. All methods are coroutines and raise
    :class:`RuntimeError_` with the runtime's message on failure."""

    name: str = "abstract"
    #: Runtime build this driver runs (e.g. ``runsc version 0.0~20240729.0``); recorded
    #: in every checkpoint image, and a restore of an image of another build raises
    #: :class:`RuntimeMismatch`. Empty when unknown.
    build: str = ""
    #: Which sandboxes restored from one image share its unchanged memory pages on the
    #: host (a page is copied when a sandbox writes it) instead of each holding a copy:
    #: ``"forks"`` (fork children, :attr:`SandboxSpec.fork_child`, and their source),
    #: ``"all"`` (every restore) or ``""`` (none).
    shared_pages: str = ""
    #: The kind of network attachment it runs sandboxes on (:attr:`SandboxSpec.network`);
    #: the composition root pairs it with a network whose slots carry that kind.
    attachment: type = NetnsAttachment

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec, image: Image | None = None,
                     phases: dict[str, float] | None = None) -> None:
        """Start a sandbox running envd as init: fresh from ``spec.rootfs`` (``image``
        None), from ``spec.rootfs`` with a :attr:`ImageKind.FILESYSTEM` image's files
        laid over it, or restored from a :attr:`ImageKind.CHECKPOINT` image (``spec``
        may name another id, slot and workdir than the checkpointed sandbox: a fork).
        Returns once the runtime reports it running (envd readiness is the
        orchestrator's job). ``phases`` (when given) receives the runtime's own phase
        durations (ms). On failure everything it created is removed before raising.

        Raises:
            RuntimeMismatch: a checkpoint written by another runtime build.
            RuntimeError_: the runtime failed (its message).
        """

    @abc.abstractmethod
    async def destroy(self, sandbox_id: str, workdir: Path | None = None) -> None:
        """Kill and delete the sandbox and its writable layer. Idempotent: an unknown
        id is not an error."""

    @abc.abstractmethod
    async def list_ids(self) -> list[str]:
        """Ids of every sandbox this driver has on the host (running or stopped)."""

    @abc.abstractmethod
    async def is_running(self, sandbox_id: str) -> bool:
        """True when the sandbox exists and its processes are running."""

    async def alive(self, sandbox_id: str) -> bool:
        """Cheap liveness check for periodic monitoring (default: :meth:`is_running`)."""
        return await self.is_running(sandbox_id)

    async def freeze(self, sandbox_id: str) -> None:
        """Stop all of the sandbox's tasks in place (memory and connections kept)."""
        raise NotImplementedError(f"{self.name} runtime cannot freeze")

    async def thaw(self, sandbox_id: str) -> None:
        """Continue a frozen sandbox."""
        raise NotImplementedError(f"{self.name} runtime cannot thaw")

    async def is_frozen(self, sandbox_id: str) -> bool:
        """True when the sandbox exists and is frozen."""
        return False

    async def checkpoint(self, sandbox_id: str, into: Path, leave_running: bool,
                         keep_stopped: bool = False, fork: bool = False) -> Image:
        """Write memory + filesystem state of the sandbox into directory ``into`` (a
        :attr:`ImageKind.CHECKPOINT` image, returned); without ``leave_running`` the
        sandbox stops once the image is complete (and is deleted unless
        ``keep_stopped``: then :meth:`destroy` removes it later). ``fork``: the image
        is a fork's, restored only as the sandbox's children (a driver that shares
        pages with fork children may let the sandbox share them too)."""
        raise NotImplementedError(f"{self.name} runtime has no checkpoint")

    def image_at(self, path: Path) -> Image:
        """What the image directory ``path`` (staged or committed; written by this
        driver's :meth:`checkpoint` or :meth:`export_filesystem`, possibly still being
        written) holds. Blocking, cheap (a few ``stat`` calls)."""
        raise NotImplementedError(f"{self.name} runtime has no images")

    async def wait_checkpoints(self, timeout_s: float) -> list[str]:
        """Wait (≤ ``timeout_s``) until no checkpoint started by an earlier server
        process is still running; returns the ids still checkpointing at the deadline."""
        return []

    async def large_changed_files(self, sandbox_id: str, min_bytes: int) -> list[tuple[str, int]] | None:
        """``[(path, apparent bytes)]`` of the sandbox's changed files larger than
        ``min_bytes``, or None when the runtime cannot tell (then nothing is checked)."""
        return None

    async def export_filesystem(self, sandbox_id: str, into: Path, max_bytes: int | None = None) -> int:
        """Write the sandbox's writable filesystem layer (its changes to the template
        rootfs: new and changed files, directories, deletions) into directory ``into``
        as a :attr:`ImageKind.FILESYSTEM` image that :meth:`create` takes back. The
        sandbox keeps its state (the caller freezes it for a consistent cut). The image
        is either complete or absent (temporary names, fsync, rename). Returns its size
        in bytes. With ``max_bytes`` an image larger than that raises
        :class:`ExportTooLarge` (nothing is left)."""
        raise NotImplementedError(f"{self.name} runtime cannot export its filesystem")

    async def prepare(self, default_disk_mb: int) -> None:
        """Keep made ahead of demand what starts of the node's default sandbox need
        (gVisor: disks of ``default_disk_mb`` MiB; a VM driver: block images, booted
        VMs), after removing any that a crashed earlier process left. Called by the
        node's orchestrator at start; drivers used otherwise make everything on demand.
        Default: nothing."""

    async def shutdown(self) -> None:
        """Remove what :meth:`prepare` keeps (node shutdown). Never raises."""

    def spare_mounts(self) -> list[str]:
        """Host mount points held by what :meth:`prepare` keeps (metrics, leak checks)."""
        return []

    def disk_usage(self, workdir: Path) -> tuple[int, int] | None:
        """``(used, total)`` bytes of the disk of the sandbox whose workdir is
        ``workdir``, None when it has no disk of its own. Blocking."""
        return None

    async def usage(self, sandbox_id: str) -> RuntimeUsage | None:
        """Host-side resource use of a running sandbox, or None when the runtime has
        no such figure (then callers report what the sandbox itself says)."""
        return None

    def memory_in_use(self, sandbox_ids: list[str]) -> dict[str, int]:
        """Host memory each of ``sandbox_ids`` holds that the host cannot take back
        (bytes; anonymous and shared-memory pages, not page cache), for the ones the
        runtime can measure. Blocking, cheap (a file read per sandbox). Default: none."""
        return {}

    async def death_cause(self, sandbox_id: str) -> str | None:
        """Why a sandbox whose runtime stopped without being asked to stopped (e.g.
        ``"out of memory (limit 512 MiB)"``), or None when the runtime cannot tell.
        Call before :meth:`destroy` (which removes the evidence)."""
        return None
