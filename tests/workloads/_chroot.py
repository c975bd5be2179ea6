"""Run a script natively on the host in a chroot of a template's rootfs, as ``user``.

The reference for the workload tests: the same script, the same rootfs, no gVisor — a
step that fails inside a sandbox but passes here is forkyard's failure, not the
script's. Everything happens in private mount and PID namespaces (``unshare``): an
overlayfs over the (read-only) rootfs, ``/proc``, ``/dev``, a private ``/dev/shm``, the
template's sudo broker (as in a sandbox); when the script ends, the kernel kills every
process left in the PID namespace (servers it started, the broker) and the mounts go
with the mount namespace, so nothing is left on the host but ``scratch``.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

from forkyard.templates.base import USER_NAME, USER_UID
from forkyard.guest.sudo import BROKER_PATH

#: gid of group ``sudo`` in Debian's base-passwd (the broker admits its members).
SUDO_GID = 27
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def run(rootfs: Path, scratch: Path, script: str, env: dict[str, str], timeout: float,
        cgroup: Path | None = None) -> subprocess.CompletedProcess:
    """Run bash ``script`` as ``user`` (uid 1000, groups user and sudo) in a chroot of
    ``rootfs`` whose writes go to ``scratch`` (created; the caller removes it), with
    ``env`` added to a login-like environment. Returns the completed process (text
    output, both streams). With ``cgroup`` (a cgroup directory, e.g. a cgroup v1
    ``cpuacct`` one), everything runs in that cgroup (bench/bench_workload.py counts
    its CPU time).

    Raises:
        subprocess.TimeoutExpired: it ran longer than ``timeout`` s (the namespace's
            processes are killed with it).
    """
    scratch.mkdir(parents=True, exist_ok=True)
    for d in ("upper", "work", "root"):
        (scratch / d).mkdir(exist_ok=True)
    root = scratch / "root"
    envs = {"HOME": f"/home/{USER_NAME}", "USER": USER_NAME, "LOGNAME": USER_NAME, "PATH": PATH,
            "LANG": "C.UTF-8", **env}
    q = shlex.quote
    outer = " && ".join([
        f"mount -t overlay overlay -o lowerdir={q(str(rootfs))},upperdir={q(str(scratch / 'upper'))},"
        f"workdir={q(str(scratch / 'work'))} {q(str(root))}",
        f"mount -t proc proc {q(str(root / 'proc'))}",
        f"mount --bind /dev {q(str(root / 'dev'))}",
        f"mount -t tmpfs -o mode=1777,size=256m shm {q(str(root / 'dev/shm'))}",
        f"mkdir -p {q(str(root / 'run/forkyard'))}",
        f"{{ chroot {q(str(root))} {BROKER_PATH} >/dev/null 2>&1 & }}",
        f"exec chroot --userspec={USER_UID}:{USER_UID} --groups={USER_UID},{SUDO_GID} {q(str(root))} "
        f"/usr/bin/env -i {' '.join(q(f'{k}={v}') for k, v in envs.items())} "
        f"/bin/bash -c {q(f'cd ~ && {script}')}",
    ])
    argv = ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--propagation", "private", "sh", "-c", outer]
    if cgroup is not None:
        argv = ["sh", "-c", f'echo $$ > {q(str(cgroup / "cgroup.procs"))} && exec "$@"', "sh", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
