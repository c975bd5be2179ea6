"""OCI runtime spec (``config.json``) for one forkyard sandbox under runsc."""

from __future__ import annotations

import json
import os
from pathlib import Path

from forkyard.guest.files import hosts_file
from forkyard.guest.sudo import BROKER_PATH
from forkyard.runtime.base import SandboxSpec

#: Started next to init when present (see :mod:`forkyard.guest.sudo`): gVisor ignores
#: set-user-ID bits, so ``sudo`` for non-root users goes through this root broker.
BROKER_LAUNCH = f'[ -x {BROKER_PATH} ] && {BROKER_PATH} & exec "$@"'


def process_argv(init_argv: list[str], sudo_broker: bool) -> list[str]:
    """argv of the container's first process: ``init_argv`` (envd), behind
    :data:`BROKER_LAUNCH` when ``sudo_broker``."""
    if not sudo_broker:
        return list(init_argv)
    return ["/bin/sh", "-c", BROKER_LAUNCH, init_argv[0], *init_argv]


#: Where the envd binary appears inside every sandbox.
ENVD_GUEST_PATH = "/usr/local/bin/envd"
#: Docker's default set plus SYS_PTRACE (debuggers/strace inside the sandbox). gVisor is
#: the isolation boundary; these only act on the sentry's emulated kernel. NET_RAW is
#: left out (runsc strips it anyway unless ``--net-raw``).
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_MKNOD",
    "CAP_AUDIT_WRITE",
    "CAP_SETFCAP",
    "CAP_SYS_PTRACE",
]
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
CPU_PERIOD_US = 100_000
#: OCI annotation naming a ``runsc tar rootfs-upper`` archive that runsc lays into a new
#: container's rootfs upper layer (gVisor docs, user_guide/rootfs_snapshot).
ROOTFS_TAR_ANNOTATION = "dev.gvisor.tar.rootfs.upper"
#: The one value forkyard gives :data:`ROOTFS_TAR_ANNOTATION`: an empty tar (10,240
#: zero bytes, two end-of-archive blocks) over which the driver bind-mounts the real
#: archive in runsc's private mount namespace at a cold boot. runsc records the boot
#: spec's annotations in every checkpoint and refuses a restore whose annotations differ
#: ("Annotations does not match across checkpoint restore"), so a per-image path would
#: make a sandbox once cold-booted from a filesystem-only image unrestorable once that
#: path is gone or differs; a constant path that always exists (as the empty tar) is
#: restorable anywhere.
ROOTFS_TAR_PLACEHOLDER = Path("/run/forkyard/rootfs-upper.tar")
#: Bytes of an empty tar archive (POSIX: two 512-byte zero blocks; GNU tar pads a record
#: to 20 blocks, 10,240 bytes, which is what we write).
EMPTY_TAR = b"\0" * 10240
NOFILE = 65536
def nproc_limit(memory_mb: int) -> int:
    """Processes (threads included) one non-root user may run in a sandbox
    (``RLIMIT_NPROC``, enforced by gVisor): one per 2 MiB of memory, at least 64 (256
    for E2B's default 512 MiB). Measured here (gVisor 20240729, 512 MiB): 1,100
    ``sleep`` processes as ``user`` got the whole sandbox OOM-killed; with this limit a
    fork bomb gets EAGAIN and the sandbox lives on."""
    return max(64, memory_mb // 2)


def tmpfs_size_mb(memory_mb: int) -> int:
    """Size of a sandbox's ``/dev/shm`` tmpfs (MiB; and of ``/tmp`` in images of
    :data:`TMP_SIZED`): a quarter of its memory, which it lives in. (gVisor would
    otherwise mount a tmpfs as large as the host's RAM, which fills past the sandbox's
    memory limit and gets the whole sandbox OOM-killed.)"""
    return max(16, memory_mb // 4)


#: How a sandbox's ``/tmp`` is mounted. A restore must use the mounts its image was
#: made with (runsc compares the spec's mounts; a new ``/tmp`` mount over a restored
#: one would hide its files), so each checkpoint records its kind (:func:`image_tmp`).
#:
#: * ``rootfs`` (every sandbox started now): ``/tmp`` is a directory of the root
#:   overlay, as on E2B's VM disk: ``mv``/``ln`` between ``/tmp`` and ``~`` work, it is
#:   bounded by the sandbox's disk and kept by every pause. runsc would mount a tmpfs
#:   over an empty ``/tmp`` by itself; :data:`TMP_ANNOTATION` stops that (forkyard's
#:   runsc patch 0002). ``/dev/shm`` is a tmpfs of :func:`tmpfs_size_mb`.
#: * ``sized`` (images from 2026-11-30 to this change, :data:`SIZED_TMP_MARKER`):
#:   ``/tmp`` and ``/dev/shm`` tmpfs of :func:`tmpfs_size_mb` each.
#: * ``internal`` (older images): no ``/tmp`` mount in the spec, so runsc's own
#:   unsized tmpfs; ``/dev/shm`` unsized.
TMP_ROOTFS, TMP_SIZED, TMP_INTERNAL = "rootfs", "sized", "internal"
#: OCI annotation (runsc patch 0002) that keeps ``/tmp`` on the rootfs, and its value.
TMP_ANNOTATION = "dev.forkyard.tmp"


def bundle_dir(workdir: Path) -> Path:
    """OCI bundle directory of a sandbox (holds ``config.json``)."""
    return workdir / "bundle"


def cgroup_path(sandbox_id: str) -> str:
    """cgroup path runsc creates for the sandbox (under every v1 controller / v2 root)."""
    return f"/forkyard/{sandbox_id}"


#: File in a checkpoint image saying its sandbox had the sized ``/tmp`` and
#: ``/dev/shm`` mounts (:data:`TMP_SIZED`).
SIZED_TMP_MARKER = "forkyard-sized-tmp"
#: File in a checkpoint image saying its sandbox had ``/tmp`` on the rootfs
#: (:data:`TMP_ROOTFS`).
ROOTFS_TMP_MARKER = "forkyard-tmp-on-rootfs"


def image_tmp(image_dir: Path) -> str:
    """The ``/tmp`` kind (:data:`TMP_ROOTFS`, :data:`TMP_SIZED` or :data:`TMP_INTERNAL`)
    of the sandbox checkpointed in ``image_dir``, from its marker files."""
    if (image_dir / ROOTFS_TMP_MARKER).exists():
        return TMP_ROOTFS
    if (image_dir / SIZED_TMP_MARKER).exists():
        return TMP_SIZED
    return TMP_INTERNAL


def tmp_marker(tmp: str) -> str | None:
    """The marker file a checkpoint of a sandbox of ``/tmp`` kind ``tmp`` carries
    (None for :data:`TMP_INTERNAL`)."""
    return {TMP_ROOTFS: ROOTFS_TMP_MARKER, TMP_SIZED: SIZED_TMP_MARKER}.get(tmp)


#: File in a checkpoint image naming the :data:`ROOTFS_TAR_ANNOTATION` value its
#: sandbox was booted with (restore must pass the same annotations); empty when it had
#: none (so restore need not read ``checkpoint.img``'s header to find out: ~1 ms).
ROOTFS_TAR_MARKER = "forkyard-rootfs-tar-annotation"


def ensure_empty_tar(path: Path) -> None:
    """Create ``path`` as an empty tar (:data:`EMPTY_TAR`, mode 0600; parents 0700) when
    it is missing or not that. Atomic (temporary name + rename), so concurrent callers
    and readers only ever see a complete archive.

    Raises:
        OSError: the file could not be written.
    """
    try:
        if path.stat().st_size == len(EMPTY_TAR) and path.read_bytes() == EMPTY_TAR:
            return
    except OSError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, EMPTY_TAR)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def rootfs_tar_annotation(bundle: Path) -> str | None:
    """The :data:`ROOTFS_TAR_ANNOTATION` value in the bundle's ``config.json``, or None."""
    try:
        value = (json.loads((bundle / "config.json").read_text()).get("annotations") or {}).get(ROOTFS_TAR_ANNOTATION)
    except (OSError, ValueError, AttributeError):
        return None
    return str(value) if value else None


def bundle_tmp(bundle: Path) -> str:
    """The ``/tmp`` kind of the sandbox whose bundle is ``bundle`` (read from its
    ``config.json``; :data:`TMP_INTERNAL` when unreadable)."""
    try:
        data = json.loads((bundle / "config.json").read_text())
    except (OSError, ValueError):
        return TMP_INTERNAL
    if (data.get("annotations") or {}).get(TMP_ANNOTATION) == TMP_ROOTFS:
        return TMP_ROOTFS
    if any(m.get("destination") == "/tmp" for m in data.get("mounts", [])):
        return TMP_SIZED
    return TMP_INTERNAL


def build_spec(
    spec: SandboxSpec,
    init_argv: list[str],
    envd_binary: Path | None,
    etc_dir: Path,
    tmp: str = TMP_ROOTFS,
    rootfs_tar: str | None = None,
) -> dict:
    """Return the OCI spec dict for ``spec``.

    Args:
        spec: the sandbox to start.
        init_argv: argv of the init process (envd), run as root.
        envd_binary: host path bind-mounted read-only at :data:`ENVD_GUEST_PATH`, or None
            to mount nothing there.
        etc_dir: per-sandbox host directory holding the generated ``hosts`` and
            ``hostname`` files (bind-mounted over the template's).
        tmp: how ``/tmp`` and ``/dev/shm`` are mounted (:data:`TMP_ROOTFS` and the
            other kinds; ``ValueError`` for an unknown one).
        rootfs_tar: value of :data:`ROOTFS_TAR_ANNOTATION` (normally
            :data:`ROOTFS_TAR_PLACEHOLDER`), or None for no annotation.
    """
    env = dict(DEFAULT_ENV)
    env.update(spec.env)
    mounts: list[dict] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/etc/hosts", "type": "bind", "source": str(etc_dir / "hosts"), "options": ["rbind", "rw"]},
        {"destination": "/etc/hostname", "type": "bind", "source": str(etc_dir / "hostname"), "options": ["rbind", "ro"]},
    ]
    if tmp not in (TMP_ROOTFS, TMP_SIZED, TMP_INTERNAL):
        raise ValueError(f"unknown /tmp kind {tmp!r}")
    annotations: dict[str, str] = {}
    if tmp != TMP_INTERNAL:
        size = f"size={tmpfs_size_mb(spec.memory_mb)}m"
        mounts[3]["options"].append(size)  # /dev/shm
    if tmp == TMP_SIZED:
        mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs",
                       "options": ["nosuid", "nodev", "mode=1777", size]})
    elif tmp == TMP_ROOTFS:
        annotations[TMP_ANNOTATION] = TMP_ROOTFS
    for host_dir, guest in spec.volumes:
        # Served by the gofer like the rootfs: the sentry resolves every path (and every
        # link the sandbox makes) in the sandbox's own VFS, so nothing inside reaches
        # above ``host_dir``. nosuid/nodev as the host mount itself.
        mounts.append({"destination": guest, "type": "bind", "source": str(host_dir),
                       "options": ["rbind", "rw", "nosuid", "nodev"]})
    if envd_binary is not None:
        mounts.append(
            {"destination": ENVD_GUEST_PATH, "type": "bind", "source": str(envd_binary), "options": ["rbind", "ro"]}
        )
    out = {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(init_argv),
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": "/",
            "capabilities": {k: list(CAPABILITIES) for k in ("bounding", "effective", "permitted", "inheritable")},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": NOFILE, "soft": NOFILE},
                        {"type": "RLIMIT_NPROC", "hard": nproc_limit(spec.memory_mb),
                         "soft": nproc_limit(spec.memory_mb)}],
            "noNewPrivileges": False,
        },
        "root": {"path": str(spec.rootfs), "readonly": False},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "network", "path": spec.network.netns_path},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
            ],
            "cgroupsPath": cgroup_path(spec.sandbox_id),
            "resources": {
                "memory": {"limit": int(spec.memory_mb) * 1024 * 1024},
                "cpu": {"quota": int(spec.vcpus) * CPU_PERIOD_US, "period": CPU_PERIOD_US},
            },
        },
    }
    if rootfs_tar is not None:
        # runsc fills the rootfs overlay's upper layer from this tar before init starts
        # (honoured only with ``--allow-rootfs-tar-annotation``; gVisor "Rootfs Snapshot").
        annotations[ROOTFS_TAR_ANNOTATION] = rootfs_tar
    if annotations:
        out["annotations"] = annotations
    return out


def write_bundle(
    spec: SandboxSpec, init_argv: list[str], envd_binary: Path | None, tmp: str = TMP_ROOTFS,
    rootfs_tar: str | None = None,
) -> Path:
    """Write ``<workdir>/bundle/config.json`` and the per-sandbox ``/etc`` files.

    Returns:
        The bundle directory.
    """
    bdir = bundle_dir(spec.workdir)
    etc_dir = bdir / "etc"
    etc_dir.mkdir(parents=True, exist_ok=True)
    (etc_dir / "hosts").write_text(hosts_file(spec.hostname))
    (etc_dir / "hostname").write_text(spec.hostname + "\n")
    for name in ("hosts", "hostname"):  # bind-mounted: every user inside reads them
        (etc_dir / name).chmod(0o644)
    data = build_spec(spec, init_argv, envd_binary, etc_dir, tmp=tmp, rootfs_tar=rootfs_tar)
    tmp = bdir / "config.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, bdir / "config.json")
    return bdir
