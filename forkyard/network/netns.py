"""Network namespaces from Python threads: create, enter, remove, and set sysctls in one.

Every operation runs in a short-lived thread that moves *itself* into a namespace with
libc ``setns``/``unshare`` (a thread's network namespace is its own: the process and the
event loop stay where they are), and pyroute2's ``IPRoute`` opened inside that thread
talks netlink in that namespace. No helper process is started.

Why by hand and not pyroute2's own namespace support (``pyroute2.netns.create``,
``IPRoute(netns=...)``, ``NetNS``): pyroute2 0.9 forks a child process for each of
those (``pyroute2.process.ChildProcess``: the child enters the namespace, makes the
netlink socket and hands it back over a Unix socket), and it has no way to write a
sysctl or run ``iptables-restore`` inside a namespace, so a pure-pyroute2 slot also
needs ``ip netns exec`` processes. So this module is for speed: measured with
``bench/bench_netns.py`` (the same slot built both ways, alternated, 30 each, on the
2-core dev machine with other work running, load ≈ 12), a pure-pyroute2 build took
p50 980 ms / p95 2290 ms against 269 / 648 ms here: 3.6x. A slot's build is on the path
of every start that finds no spare slot (``FORKYARD_SPARE_SLOTS``).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

#: Where named network namespaces are bound (iproute2's place, so ``ip netns`` sees them).
NETNS_DIR = Path("/run/netns")

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")


def check(rc: int, what: str) -> None:
    """Raise ``OSError`` (errno and ``what``) when a libc call returned non-zero."""
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def in_thread(fn: Callable[[], T]) -> T:
    """Run ``fn`` in a fresh thread (which may change its own netns) and return its value."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 — re-raised in the caller
            box["error"] = exc

    t = threading.Thread(target=target, name="forkyard-netns")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def off_loop(method: Callable[..., T]) -> Callable[..., T]:
    """pyroute2's sync API cannot run in a thread with a running asyncio loop; run the
    method in a fresh thread in that case (it still blocks the caller)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return method(*args, **kwargs)
        return in_thread(lambda: method(*args, **kwargs))

    return wrapper


def enter_netns(path: str) -> None:
    """setns the *calling thread* into the netns at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        check(_libc.setns(fd, _CLONE_NEWNET), f"setns {path}")
    finally:
        os.close(fd)


_netns_dir_lock = threading.Lock()


def _prepare_netns_dir() -> None:
    """Make ``/run/netns`` a shared mount point, as iproute2 does, so netns bind mounts
    propagate to mount namespaces created earlier."""
    with _netns_dir_lock:
        NETNS_DIR.mkdir(parents=True, exist_ok=True)
        target = str(NETNS_DIR).encode()
        if _libc.mount(b"", target, b"none", _MS_SHARED | _MS_REC, None) == 0:
            return
        check(_libc.mount(target, target, b"none", _MS_BIND | _MS_REC, None), "bind /run/netns")
        check(_libc.mount(b"", target, b"none", _MS_SHARED | _MS_REC, None), "share /run/netns")


def create_netns(name: str, then: Callable[[], None]) -> None:
    """Create the named netns ``/run/netns/<name>`` and run ``then()`` inside it."""
    _prepare_netns_dir()
    path = NETNS_DIR / name
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
    os.close(fd)

    def body() -> None:
        check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        check(
            _libc.mount(b"/proc/thread-self/ns/net", str(path).encode(), b"none", _MS_BIND, None),
            f"bind netns {path}",
        )
        then()

    try:
        in_thread(body)
    except BaseException:
        remove_netns(name)
        raise


def remove_netns(name: str) -> None:
    """Unmount and unlink ``/run/netns/<name>``; missing is fine."""
    path = NETNS_DIR / name
    _libc.umount2(str(path).encode(), _MNT_DETACH)
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def is_nsfs(path: Path) -> bool:
    """True when ``path`` is a bound namespace (another filesystem than its directory)."""
    try:
        return os.stat(path).st_dev != os.stat(NETNS_DIR).st_dev
    except OSError:
        return False


def netns_in_use(path: str) -> bool:
    """True when some process runs in the netns bound at ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            ns = os.stat(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        if ns.st_ino == st.st_ino and ns.st_dev == st.st_dev:
            return True
    return False


def sysctl(key: str, value: str) -> None:
    """Write a sysctl of the *calling thread's* netns (``key`` like ``net/ipv4/ip_forward``)."""
    with open(f"/proc/sys/{key}", "w") as f:
        f.write(value)


def disable_ipv6_defaults() -> None:
    """Disable IPv6 on every interface of the calling thread's netns (now and later)."""
    for scope in ("all", "default"):
        try:
            sysctl(f"net/ipv6/conf/{scope}/disable_ipv6", "1")
        except FileNotFoundError:  # IPv6 not compiled in
            return


def enable_ipv6_loopback() -> None:
    """Give ``lo`` of the calling thread's netns its ``::1`` back (after
    :func:`disable_ipv6_defaults`, which disables IPv6 on every interface): runsc
    (``--network=sandbox``) builds the sandbox's loopback from the addresses ``lo`` has
    in the netns (runsc/sandbox/network.go ``loopbackLink``), so without it binding
    ``::1`` inside failed with EADDRNOTAVAIL. Loopback traffic never leaves the
    sandbox; other interfaces stay IPv4-only."""
    try:
        sysctl("net/ipv6/conf/lo/disable_ipv6", "0")
    except FileNotFoundError:  # IPv6 not compiled in
        return
