"""Fault injectors of the chaos suite that need more than a signal: a network partition
of one node from the control plane, clock skew, a full disk.

* **Partition** (:func:`partition`): the node's process runs in a cgroup (v2) of its own
  and iptables drops its packets to the scheduler replicas' and Redis's ports
  (``-m cgroup --path``), so the node cannot reach the control plane while the gateway
  (and so every client) still reaches the node. Its sandboxes (runsc) are untouched.
* **Clock skew** (:func:`skewed_env`): ``wallclock.c`` (built here with gcc) preloaded
  into a process shifts its wall clock only; monotonic clocks, sleeps and timed waits stay
  true. (libfaketime broke sleeps and waits in CPython: see ``wallclock.c``.)
* **Disk full** (:func:`fill`): one file taking all but ``leave_mb`` of a filesystem.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

from _cluster import CGROUP2, Cluster
from conftest import TEST_ROOT

_CHAIN = "FYCHAOS"
_WALLCLOCK_C = Path(__file__).with_name("wallclock.c")


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=check)


def partition(c: Cluster, i: int) -> None:
    """Cut node ``i`` (started in a cgroup of its own: ``Cluster(node_cgroups=True)``)
    off from the schedulers and Redis — its packets to their ports are dropped, on new
    and established connections alike — leaving the gateway → node path open."""
    group = c.nodes[i].cgroup
    assert group is not None, "the cluster must start its nodes in cgroups (node_cgroups=True)"
    if _ipt("-nL", _CHAIN, check=False).returncode != 0:
        _ipt("-N", _CHAIN)
        _ipt("-I", "OUTPUT", "1", "-j", _CHAIN)
    rel = "/" + str(group.relative_to(CGROUP2))
    for port in list(c.sched_ports) + [c.redis_port]:
        _ipt("-A", _CHAIN, "-p", "tcp", "-d", "127.0.0.1", "--dport", str(port), "-m", "cgroup", "--path", rel,
             "-j", "DROP")


def unpartition(c: Cluster) -> None:
    """Remove every partition rule (idempotent)."""
    if _ipt("-nL", _CHAIN, check=False).returncode == 0:
        _ipt("-D", "OUTPUT", "-j", _CHAIN, check=False)
        _ipt("-F", _CHAIN, check=False)
        _ipt("-X", _CHAIN, check=False)


def wallclock_lib() -> Path:
    """The wall-clock shim (``wallclock.c``) as a shared object, built with gcc once per
    source version under ``TEST_ROOT/bin`` (0700), readable by root only (0600; the
    loader maps it without the file's execute bit; one built before this is narrowed)."""
    src = _WALLCLOCK_C.read_bytes()
    lib = TEST_ROOT / "bin" / f"wallclock-{hashlib.sha256(src).hexdigest()[:12]}.so"
    if not lib.exists():
        lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".tmp{os.getpid()}")
        subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(tmp), str(_WALLCLOCK_C), "-ldl"],
                       check=True)
        os.chmod(tmp, 0o600)
        os.replace(tmp, lib)
    os.chmod(lib, 0o600)
    return lib


def skewed_env(env: dict[str, str], offset_s: int) -> dict[str, str]:
    """``env`` with the wall-clock shim preloaded: the process's wall clock (and its
    children's, dynamically linked ones) ``offset_s`` seconds off; monotonic clocks,
    sleeps and timed waits untouched."""
    return dict(env, LD_PRELOAD=str(wallclock_lib()), FY_WALLCLOCK_OFFSET_S=str(int(offset_s)))


def fill(path: Path) -> list[Path]:
    """Fill the filesystem of ``path`` (files ``path/.chaos-fill*``: one fallocated, then
    1 MiB writes until ENOSPC); returns them (delete them to free the space)."""
    st = os.statvfs(path)
    big, rest = path / ".chaos-fill", path / ".chaos-fill-rest"
    free = st.f_bavail * st.f_frsize - (32 << 20)
    if free > 0:
        subprocess.run(["fallocate", "-l", str(free), str(big)], check=True)
    chunk = b"\0" * (1 << 20)
    with open(rest, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError:
            pass
    return [big, rest]
