"""Network slots: per-sandbox network namespaces, veths and NAT (see :mod:`.base`).

Slot ``N`` (0 ≤ N < 16384) uses the /30 ``OUTER_NET + 4·N`` of the outer range
(default ``10.209.0.0/16``)::

    root netns                 middle netns fy<N>                  sandbox netns fy<N>s
    fyv<N>  host_ip/30  ◄────► vo   outer_ip/30 (default via host_ip)
                               vg   GUEST_GATEWAY/30  ◄──────────► eth0 GUEST_IP/30
                                                                   (default via GUEST_GATEWAY)

* host_ip = base+1, outer_ip = base+2.
* middle netns nat: ``PREROUTING -i vo -d outer_ip → DNAT GUEST_IP`` (the host reaches any
  guest port at ``outer_ip:port``) and ``POSTROUTING -o vo → MASQUERADE`` (egress).
* root netns (:meth:`NetworkManager.setup_host`): ``ip_forward=1``; chains
  ``FORKYARD-INPUT`` (drop everything from ``fyv+`` except replies: sandboxes cannot reach
  host services, the API port or a slot's host address), ``FORKYARD-FORWARD`` (no
  slot-to-slot traffic, no link-local/metadata addresses, no new connections from outside
  into slots, egress allowed), ``FORKYARD-OUTPUT`` (only root on the host connects to a
  slot: other local users are refused) and nat ``FORKYARD-POSTROUTING`` (masquerade the
  outer range leaving the host).
* IPv6 is disabled on every slot interface but the sandbox netns's ``lo`` (``::1``, which
  runsc copies into the sandbox's loopback).

All netns work runs in short-lived threads that ``setns``/``unshare`` themselves; no
helper processes except one ``iptables-restore`` per slot. Operations are blocking; call
them from a thread in async code (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import ipaddress
import logging
import os
import re
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from forkyard.config import GUEST_GATEWAY, GUEST_IP, GUEST_PREFIXLEN, Settings
from forkyard.guest.files import host_nameservers
from forkyard.network.base import Slot

log = logging.getLogger(__name__)

NETNS_DIR = Path("/run/netns")
#: Default outer range: one /30 per slot, 16384 slots.
OUTER_NET = "10.209.0.0/16"
MAX_SLOTS = 16384
#: Default name prefix: netns ``fy<N>``/``fy<N>s``, host veth ``fyv<N>``.
PREFIX = "fy"
MIDDLE_OUTER_IF = "vo"
MIDDLE_GUEST_IF = "vg"
GUEST_IF = "eth0"
CHAIN_PREFIX = "FORKYARD-"
#: Destinations sandboxes may never reach (RFC 1918, CGNAT, link-local incl. cloud
#: metadata, loopback, this-network, TEST-NETs, multicast/reserved).
BLOCKED_EGRESS = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/3",
]

_CLONE_NEWNET = 0x40000000
_MS_BIND = 4096
_MS_REC = 16384
_MS_SHARED = 1 << 20
_MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)

T = TypeVar("T")


class NetworkError(Exception):
    """A network slot or host operation failed; the message says which step and why."""


# --------------------------------------------------------------------------- netns helpers


def _check(rc: int, what: str) -> None:
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _in_thread(fn: Callable[[], T]) -> T:
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


def _off_loop(method: Callable[..., T]) -> Callable[..., T]:
    """pyroute2's sync API cannot run in a thread with a running asyncio loop; run the
    method in a fresh thread in that case (it still blocks the caller)."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return method(*args, **kwargs)
        return _in_thread(lambda: method(*args, **kwargs))

    return wrapper


def _enter_netns(path: str) -> None:
    """setns the *calling thread* into the netns at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(_libc.setns(fd, _CLONE_NEWNET), f"setns {path}")
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
        _check(_libc.mount(target, target, b"none", _MS_BIND | _MS_REC, None), "bind /run/netns")
        _check(_libc.mount(b"", target, b"none", _MS_SHARED | _MS_REC, None), "share /run/netns")


def _create_netns(name: str, then: Callable[[], None]) -> None:
    """Create the named netns ``/run/netns/<name>`` and run ``then()`` inside it."""
    _prepare_netns_dir()
    path = NETNS_DIR / name
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0)
    os.close(fd)

    def body() -> None:
        _check(_libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        _check(
            _libc.mount(b"/proc/thread-self/ns/net", str(path).encode(), b"none", _MS_BIND, None),
            f"bind netns {path}",
        )
        then()

    try:
        _in_thread(body)
    except BaseException:
        _remove_netns(name)
        raise


def _remove_netns(name: str) -> None:
    """Unmount and unlink ``/run/netns/<name>``; missing is fine."""
    path = NETNS_DIR / name
    _libc.umount2(str(path).encode(), _MNT_DETACH)
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _is_nsfs(path: Path) -> bool:
    try:
        return os.stat(path).st_dev != os.stat(NETNS_DIR).st_dev
    except OSError:
        return False


def _netns_in_use(path: str) -> bool:
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


def _sysctl(key: str, value: str) -> None:
    """Write a sysctl of the *calling thread's* netns (``key`` like ``net/ipv4/ip_forward``)."""
    with open(f"/proc/sys/{key}", "w") as f:
        f.write(value)


def _disable_ipv6_defaults() -> None:
    for scope in ("all", "default"):
        try:
            _sysctl(f"net/ipv6/conf/{scope}/disable_ipv6", "1")
        except FileNotFoundError:  # IPv6 not compiled in
            return


def _enable_ipv6_loopback() -> None:
    """Give ``lo`` of the calling thread's netns its ``::1`` back (after
    :func:`_disable_ipv6_defaults`, which disables IPv6 on every interface): runsc
    (``--network=sandbox``) builds the sandbox's loopback from the addresses ``lo`` has
    in the netns (runsc/sandbox/network.go ``loopbackLink``), so without it binding
    ``::1`` inside failed with EADDRNOTAVAIL. Loopback traffic never leaves the
    sandbox; other interfaces stay IPv4-only."""
    try:
        _sysctl("net/ipv6/conf/lo/disable_ipv6", "0")
    except FileNotFoundError:  # IPv6 not compiled in
        return


def _iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"iptables {' '.join(args)}: {proc.stderr.strip()}")
    return proc


# --------------------------------------------------------------------------- manager


class NetworkManager:
    """Creates and removes network slots on this host.

    Args:
        settings: forkyard settings (unused today; kept for parity with other managers).
        outer_net: IPv4 range carved into /30 outer subnets, one per slot; a /16 gives
            16384 slots. Must not overlap the host's routes.
        prefix: name prefix of netns and host veths (``fy`` → ``fy<N>``, ``fy<N>s``,
            ``fyv<N>``). A second instance on the same host (tests) uses its own prefix
            *and* outer range, and gets its own iptables chains
            (``FORKYARD-<PREFIX>-*``), so neither reconciles away the other's slots.
    """

    def __init__(
        self, settings: Settings | None = None, outer_net: str = OUTER_NET, prefix: str = PREFIX
    ):
        if not re.fullmatch(r"[a-z]{2,4}", prefix):
            raise ValueError(f"prefix must be 2-4 lower-case letters, not {prefix!r}")
        self.settings = settings
        #: Destinations no sandbox may reach (``FORKYARD_BLOCKED_EGRESS``, default
        #: :data:`BLOCKED_EGRESS`); an egress allow entry does not override them.
        blocked = getattr(settings, "blocked_egress", None)
        self.blocked_egress = list(BLOCKED_EGRESS if blocked is None else blocked)
        self.prefix = prefix
        self.outer_net = ipaddress.IPv4Network(outer_net)
        self.max_slots = min(MAX_SLOTS, self.outer_net.num_addresses // 4)
        self.chain_prefix = CHAIN_PREFIX if prefix == PREFIX else f"{CHAIN_PREFIX}{prefix.upper()}-"
        self._ns_re = re.compile(rf"^{prefix}(\d+)s?$")
        self._if_re = re.compile(rf"^{prefix}v(\d+)$")

    def _host_if(self, index: int | str) -> str:
        return f"{self.prefix}v{index}"

    def _middle_ns(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def _sandbox_ns(self, index: int) -> str:
        return f"{self.prefix}{index}s"

    # ---- addressing -----------------------------------------------------------------
    def addresses(self, index: int) -> tuple[str, str]:
        """``(host_ip, outer_ip)`` of slot ``index``.

        Raises:
            ValueError: index outside ``0 … max_slots-1``.
        """
        if not 0 <= index < self.max_slots:
            raise ValueError(f"slot index {index} out of range 0..{self.max_slots - 1}")
        base = int(self.outer_net.network_address) + 4 * index
        return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))

    def slot(self, index: int) -> Slot:
        """The :class:`Slot` value for ``index`` (does not create anything)."""
        _, outer = self.addresses(index)
        return Slot(index=index, netns_path=str(NETNS_DIR / self._sandbox_ns(index)), outer_ip=outer)

    # ---- host ---------------------------------------------------------------------------
    @_off_loop
    def setup_host(self) -> None:
        """Prepare the root netns: ip_forward, ``FORKYARD-*`` iptables chains and jumps.

        Idempotent: chains are flushed and refilled, jumps inserted once at position 1.

        Raises:
            NetworkError: the outer range overlaps a host route, or iptables failed.
        """
        self._check_no_overlap()
        _sysctl("net/ipv4/ip_forward", "1")
        outer = str(self.outer_net)
        hif = f"{self.prefix}v+"
        rules: dict[tuple[str, str], list[list[str]]] = {
            ("filter", "INPUT"): [
                ["-i", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                ["-i", hif, "-j", "DROP"],
            ],
            ("filter", "FORWARD"): [
                ["-i", hif, "-o", hif, "-j", "DROP"],
                # DNS to the host's resolvers (which may sit in a private range) ...
                *[["-i", hif, "-d", ns, "-p", proto, "--dport", "53", "-j", "ACCEPT"]
                  for ns in host_nameservers() for proto in ("udp", "tcp")],
                # ... but no other private, link-local (metadata), CGNAT or documentation
                # address: the host's network neighbours are not the sandbox's business.
                *[["-i", hif, "-d", net, "-j", "DROP"] for net in self.blocked_egress],
                ["-i", hif, "-s", outer, "-j", "ACCEPT"],
                ["-i", hif, "-j", "DROP"],
                ["-o", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                ["-o", hif, "-j", "DROP"],
            ],
            # Only root on the host (the server) opens connections to sandboxes: other
            # local users must not reach envd or user ports directly at a slot's outer
            # address, around the proxy's tokens (a pooled sandbox has none yet).
            ("filter", "OUTPUT"): [
                ["-o", hif, "-m", "owner", "!", "--uid-owner", "0", "-j", "REJECT",
                 "--reject-with", "icmp-admin-prohibited"],
            ],
            ("nat", "POSTROUTING"): [
                ["-s", outer, "!", "-o", hif, "-j", "MASQUERADE"],
            ],
        }
        for (table, parent), chain_rules in rules.items():
            chain = self.chain_prefix + parent
            if _iptables("-t", table, "-n", "-L", chain, check=False).returncode != 0:
                _iptables("-t", table, "-N", chain)
            _iptables("-t", table, "-F", chain)
            for rule in chain_rules:
                _iptables("-t", table, "-A", chain, *rule)
            if _iptables("-t", table, "-C", parent, "-j", chain, check=False).returncode != 0:
                _iptables("-t", table, "-I", parent, "1", "-j", chain)

    #: Built-in chains forkyard jumps from, with the table.
    HOST_JUMPS = (("filter", "INPUT"), ("filter", "FORWARD"), ("filter", "OUTPUT"), ("nat", "POSTROUTING"))

    @_off_loop
    def ensure_jumps_first(self) -> list[str]:
        """Keep each jump into this server's ``FORKYARD-*`` chains ahead of every rule
        that is not forkyard's (Docker, firewalld and others insert theirs at the top of
        ``FORWARD`` when they start, after forkyard). Other forkyard servers' jumps may
        stay ahead: each only needs to precede foreign rules, so two servers on one
        host do not fight. A missing chain (``setup_host`` not run) is left alone.
        Returns ``"table/parent"`` for each jump moved (an empty list: nothing to do).

        Raises:
            NetworkError: iptables failed.
        """
        moved = []
        for table, parent in self.HOST_JUMPS:
            chain = self.chain_prefix + parent
            listing = _iptables("-t", table, "-S", parent, check=False)
            if listing.returncode != 0:
                continue
            rules = [line.split() for line in listing.stdout.splitlines() if line.startswith("-A ")]
            ours = [i for i, r in enumerate(rules) if r[2:] == ["-j", chain]]
            if not ours:
                if _iptables("-t", table, "-n", "-L", chain, check=False).returncode != 0:
                    continue  # chain gone: not set up
            foreign = [i for i, r in enumerate(rules)
                       if not (len(r) == 4 and r[2] == "-j" and r[3].startswith(CHAIN_PREFIX))]
            if ours and len(ours) == 1 and (not foreign or ours[0] < foreign[0]):
                continue
            while _iptables("-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
            _iptables("-t", table, "-I", parent, "1", "-j", chain)
            moved.append(f"{table}/{parent}")
        if moved:
            log.warning("forkyard's firewall jumps were behind other rules (%s); moved them first",
                        ", ".join(moved))
        return moved

    @_off_loop
    def teardown_host(self) -> None:
        """Remove the ``FORKYARD-*`` chains and their jumps (tests; a server that stops with
        no sandbox running). Leaves ip_forward on.
        Idempotent; never raises for missing chains."""
        for table, parent in self.HOST_JUMPS:
            chain = self.chain_prefix + parent
            while _iptables("-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
            _iptables("-t", table, "-F", chain, check=False)
            _iptables("-t", table, "-X", chain, check=False)

    def _check_no_overlap(self) -> None:
        with IPRoute() as ipr:
            for route in ipr.get_routes(family=2):
                if route.get_attr("RTA_TABLE") != 254:
                    continue  # only main-table routes can steal the outer range
                dst = route.get_attr("RTA_DST")
                if dst is None:
                    continue
                net = ipaddress.IPv4Network(f"{dst}/{route['dst_len']}", strict=False)
                if not net.overlaps(self.outer_net):
                    continue
                oif = route.get_attr("RTA_OIF")
                links = ipr.link("get", index=oif) if oif else []
                name = links[0].get_attr("IFLA_IFNAME") if links else ""
                if not self._if_re.match(name or ""):
                    raise NetworkError(
                        f"outer range {self.outer_net} overlaps host route {net} on {name or '?'}"
                    )

    # ---- slots ----------------------------------------------------------------------------
    @_off_loop
    def is_complete(self, index: int) -> bool:
        """True when slot ``index`` exists with every piece in place (its host veth is up
        with its address, which is the last step of :meth:`allocate`)."""
        host_ip, _ = self.addresses(index)
        if not (_is_nsfs(NETNS_DIR / self._middle_ns(index)) and _is_nsfs(NETNS_DIR / self._sandbox_ns(index))):
            return False
        with IPRoute() as ipr:
            links = ipr.link_lookup(ifname=self._host_if(index))
            if not links:
                return False
            link = ipr.link("get", index=links[0])[0]
            if not link["flags"] & 1:  # IFF_UP
                return False
            addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=links[0], family=2)]
            return host_ip in addrs

    @_off_loop
    def allocate(self, index: int) -> Slot:
        """Create slot ``index`` and return it, ready for a sandbox to start in it.

        Idempotent: a complete slot is returned as it is (a sandbox running in it keeps
        its network — this is how a restarted server re-adopts sandboxes). runsc moves
        the guest address and route off ``eth0`` into the sandbox when it starts, so
        when the slot's sandbox has stopped (nothing runs in the sandbox netns) they are
        put back here — a slot can be reused (e.g. restore after a stopping checkpoint)
        by calling ``allocate`` again. Partial leftovers (an earlier failed or
        interrupted allocation) are removed and the slot rebuilt; on failure everything
        created here is removed before raising. Takes a few tens of milliseconds
        (a few ms when the slot exists).

        Raises:
            ValueError: index out of range.
            NetworkError: a step failed (the message names it).
        """
        if self.is_complete(index):
            if self._guest_ready(index):
                return self.slot(index)
            try:
                self._repair_guest(index)
                return self.slot(index)
            except Exception as exc:  # noqa: BLE001 — fall back to a rebuild
                log.warning("slot %d: repairing eth0 failed (%s); rebuilding", index, exc)
        self.release(index)
        try:
            self._build(index)
        except BaseException as exc:
            try:
                self.release(index)
            except Exception as cleanup_exc:  # noqa: BLE001
                log.error("cleanup of slot %d failed: %s", index, cleanup_exc)
            if isinstance(exc, NetworkError) or not isinstance(exc, Exception):
                raise
            raise NetworkError(f"allocating slot {index} failed: {exc}") from exc
        return self.slot(index)

    def _guest_ready(self, index: int) -> bool:
        """True when the sandbox netns is in use by a process (a sandbox runs there; its
        address lives inside gVisor) or its ``eth0`` carries the guest address."""
        path = str(NETNS_DIR / self._sandbox_ns(index))
        if _netns_in_use(path):
            return True

        def check() -> bool:
            _enter_netns(path)
            with IPRoute() as ipr:
                links = ipr.link_lookup(ifname=GUEST_IF)
                if not links:
                    return False
                addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=links[0], family=2)]
                return GUEST_IP in addrs

        return _in_thread(check)

    def _repair_guest(self, index: int) -> None:
        """Put the guest address and default route back on the sandbox's ``eth0``."""
        path = str(NETNS_DIR / self._sandbox_ns(index))

        def repair() -> None:
            _enter_netns(path)
            _enable_ipv6_loopback()  # slots made before lo kept ::1
            with IPRoute() as ipr:
                eth0 = ipr.link_lookup(ifname=GUEST_IF)[0]
                addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=eth0, family=2)]
                if GUEST_IP not in addrs:
                    ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIXLEN)
                ipr.link("set", index=eth0, state="up")
                if not ipr.get_default_routes(family=2):
                    ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY, oif=eth0)

        _in_thread(repair)

    def _build(self, index: int) -> None:
        host_ip, outer_ip = self.addresses(index)
        host_if = self._host_if(index)
        middle = self._middle_ns(index)
        sandbox = self._sandbox_ns(index)
        sandbox_path = str(NETNS_DIR / sandbox)
        root_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            # 1. sandbox netns: lo up with ::1 (runsc copies lo's addresses into the
            #    sandbox: servers inside may bind ::1), no IPv6 on any other interface.
            def sandbox_init() -> None:
                _disable_ipv6_defaults()
                _enable_ipv6_loopback()
                with IPRoute() as ipr:
                    ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

            _create_netns(sandbox, sandbox_init)

            # 2. middle netns: forwarding, both veth pairs, addresses, NAT.
            nat_rules = (
                "*nat\n"
                ":PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n"
                ":OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
                f"-A PREROUTING -i {MIDDLE_OUTER_IF} -d {outer_ip}/32 -j DNAT --to-destination {GUEST_IP}\n"
                f"-A POSTROUTING -o {MIDDLE_OUTER_IF} -j MASQUERADE\n"
                "COMMIT\n"
            )

            def middle_init() -> None:
                _disable_ipv6_defaults()
                _sysctl("net/ipv4/ip_forward", "1")
                sfd = os.open(sandbox_path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    with IPRoute() as ipr:
                        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
                        ipr.link(
                            "add",
                            ifname=MIDDLE_GUEST_IF,
                            kind="veth",
                            peer={"ifname": GUEST_IF, "net_ns_fd": sfd},
                        )
                        ipr.link(
                            "add",
                            ifname=MIDDLE_OUTER_IF,
                            kind="veth",
                            peer={"ifname": host_if, "net_ns_fd": root_fd},
                        )
                        vg = ipr.link_lookup(ifname=MIDDLE_GUEST_IF)[0]
                        vo = ipr.link_lookup(ifname=MIDDLE_OUTER_IF)[0]
                        ipr.addr("add", index=vg, address=GUEST_GATEWAY, prefixlen=GUEST_PREFIXLEN)
                        ipr.addr("add", index=vo, address=outer_ip, prefixlen=30)
                        ipr.link("set", index=vg, state="up")
                        ipr.link("set", index=vo, state="up")
                        ipr.route("add", dst="0.0.0.0/0", gateway=host_ip, oif=vo)
                finally:
                    os.close(sfd)
                proc = subprocess.run(
                    ["iptables-restore", "-w"], input=nat_rules, capture_output=True, text=True
                )
                if proc.returncode != 0:
                    raise NetworkError(f"iptables-restore in {middle}: {proc.stderr.strip()}")

            try:
                _create_netns(middle, middle_init)
            except NetlinkError as exc:
                raise NetworkError(f"configuring netns {middle}: {exc}") from exc

            # 3. sandbox side of the guest veth: fixed guest address and default route.
            def sandbox_eth0() -> None:
                _enter_netns(sandbox_path)
                with IPRoute() as ipr:
                    eth0 = ipr.link_lookup(ifname=GUEST_IF)[0]
                    ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIXLEN)
                    ipr.link("set", index=eth0, state="up")
                    ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY, oif=eth0)

            try:
                _in_thread(sandbox_eth0)
            except NetlinkError as exc:
                raise NetworkError(f"configuring {GUEST_IF} in {sandbox}: {exc}") from exc

            # 4. root side last: bringing it up with its address marks the slot complete.
            try:
                _sysctl(f"net/ipv6/conf/{host_if}/disable_ipv6", "1")
            except FileNotFoundError:
                pass
            try:
                with IPRoute() as ipr:
                    hidx = ipr.link_lookup(ifname=host_if)[0]
                    ipr.addr("add", index=hidx, address=host_ip, prefixlen=30)
                    ipr.link("set", index=hidx, state="up")
            except NetlinkError as exc:
                raise NetworkError(f"configuring {host_if}: {exc}") from exc
        finally:
            os.close(root_fd)

    @_off_loop
    def set_egress(self, index: int, policy) -> None:
        """Replace slot ``index``'s egress filter with ``policy``
        (:class:`forkyard.network.egress.EgressPolicy`) in one ``iptables-restore`` of the
        middle netns' filter table (atomic: no moment without rules). An empty policy
        clears it.

        Raises:
            NetworkError: the slot does not exist or iptables-restore failed.
        """
        from forkyard.network.egress import filter_table

        self.addresses(index)  # range check
        middle = str(NETNS_DIR / self._middle_ns(index))
        if not _is_nsfs(Path(middle)):
            raise NetworkError(f"slot {index} has no middle netns")
        rules = filter_table(policy, MIDDLE_GUEST_IF, MIDDLE_OUTER_IF)

        def apply() -> None:
            _enter_netns(middle)
            proc = subprocess.run(["iptables-restore", "-w"], input=rules, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NetworkError(f"iptables-restore (egress) in {middle}: {proc.stderr.strip()}")

        _in_thread(apply)

    @_off_loop
    def release(self, index: int) -> None:
        """Remove slot ``index`` (host veth, both netns). Idempotent; missing parts are
        skipped. The sandbox netns itself lives on until the last process in it exits.

        Raises:
            ValueError: index out of range.
            NetworkError: a present piece could not be removed.
        """
        self.addresses(index)  # range check
        host_if = self._host_if(index)
        with IPRoute() as ipr:
            for idx in ipr.link_lookup(ifname=host_if):
                try:
                    ipr.link("del", index=idx)
                except NetlinkError as exc:
                    if exc.code != errno.ENODEV:
                        raise NetworkError(f"deleting {host_if}: {exc}") from exc
        for name in (self._middle_ns(index), self._sandbox_ns(index)):
            try:
                _remove_netns(name)
            except OSError as exc:
                raise NetworkError(f"removing netns {name}: {exc}") from exc

    @_off_loop
    def existing_indexes(self) -> list[int]:
        """Sorted indexes of every slot with any piece present (netns or host veth), for
        reconciliation after a restart."""
        found: set[int] = set()
        if NETNS_DIR.is_dir():
            for entry in NETNS_DIR.iterdir():
                m = self._ns_re.match(entry.name)
                if m:
                    found.add(int(m.group(1)))
        with IPRoute() as ipr:
            for link in ipr.get_links():
                m = self._if_re.match(link.get_attr("IFLA_IFNAME") or "")
                if m:
                    found.add(int(m.group(1)))
        return sorted(i for i in found if i < self.max_slots)
