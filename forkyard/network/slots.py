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
* root netns: ``ip_forward=1`` and forkyard's ``FORKYARD-*`` chains (:mod:`.firewall`).
* IPv6 is disabled on every slot interface but the sandbox netns's ``lo`` (``::1``, which
  runsc copies into the sandbox's loopback).

All netns work runs in short-lived threads that ``setns``/``unshare`` themselves
(:mod:`.netns`, which says why and what it saves); no helper processes except one
``iptables-restore`` per slot. Operations are blocking; call them from a thread in async
code (``asyncio.to_thread``).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
import subprocess
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from forkyard.config import GUEST_GATEWAY, GUEST_IP, GUEST_PREFIXLEN, Settings
from forkyard.network.base import NetnsAttachment, Slot
from forkyard.network.firewall import BLOCKED_EGRESS, CHAIN_PREFIX, HostFirewall, HostServices, NetworkError
from forkyard.network.netns import (NETNS_DIR, create_netns, disable_ipv6_defaults, enable_ipv6_loopback,
                                    enter_netns, in_thread, is_nsfs, netns_in_use, off_loop, remove_netns,
                                    sysctl)

log = logging.getLogger(__name__)

#: Default outer range: one /30 per slot, 16384 slots.
OUTER_NET = "10.209.0.0/16"
MAX_SLOTS = 16384
#: Default name prefix: netns ``fy<N>``/``fy<N>s``, host veth ``fyv<N>``.
PREFIX = "fy"
MIDDLE_OUTER_IF = "vo"
MIDDLE_GUEST_IF = "vg"
GUEST_IF = "eth0"

# --------------------------------------------------------------------------- manager


class NetnsNetwork:
    """Creates and removes network slots on this host: the :class:`~forkyard.network.base.Network`
    whose slots attach a runtime by network namespace (:class:`NetnsAttachment`: gVisor's
    netstack takes over the sandbox netns's ``eth0``).

    Args:
        settings: forkyard settings (unused today; kept for parity with other managers).
        outer_net: IPv4 range carved into /30 outer subnets, one per slot; a /16 gives
            16384 slots. Must not overlap the host's routes.
        prefix: name prefix of netns and host veths (``fy`` → ``fy<N>``, ``fy<N>s``,
            ``fyv<N>``). A second instance on the same host (tests) uses its own prefix
            *and* outer range, and gets its own iptables chains
            (``FORKYARD-<PREFIX>-*``), so neither reconciles away the other's slots.
        services: host services this node's sandboxes may reach (the package cache),
            or None.
    """

    #: Its slots attach a runtime by network namespace.
    attachment = NetnsAttachment

    def __init__(
        self, settings: Settings | None = None, outer_net: str = OUTER_NET, prefix: str = PREFIX,
        services: HostServices | None = None,
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
        if services is not None and ipaddress.IPv4Address(services.address) in self.outer_net:
            raise ValueError(f"the host services' address {services.address} lies in the outer range {self.outer_net}")
        self.firewall = HostFirewall(prefix, self.chain_prefix, self.outer_net, self.blocked_egress, services)

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
        return Slot(index=index, outer_ip=outer, attachment=NetnsAttachment(str(NETNS_DIR / self._sandbox_ns(index))))

    # ---- host ---------------------------------------------------------------------------
    def setup_host(self) -> None:
        """Prepare the root netns (:meth:`HostFirewall.setup_host`).

        Raises:
            NetworkError: the outer range overlaps a host route, or iptables failed.
        """
        self.firewall.setup_host()

    def check_host(self) -> None:
        """Check, changing nothing, that no host route outside this network's own links
        overlaps the outer range (:meth:`HostFirewall.check_no_overlap`).

        Raises:
            NetworkError: one does (the message names it and its link).
        """
        self.firewall.check_no_overlap()

    def ensure_jumps_first(self) -> list[str]:
        """Keep forkyard's firewall jumps ahead of other software's rules
        (:meth:`HostFirewall.ensure_jumps_first`)."""
        return self.firewall.ensure_jumps_first()

    def teardown_host(self) -> None:
        """Remove this server's chains (:meth:`HostFirewall.teardown_host`)."""
        self.firewall.teardown_host()

    # ---- slots ----------------------------------------------------------------------------
    @off_loop
    def is_complete(self, index: int) -> bool:
        """True when slot ``index`` exists with every piece in place (its host veth is up
        with its address, which is the last step of :meth:`allocate`)."""
        host_ip, _ = self.addresses(index)
        if not (is_nsfs(NETNS_DIR / self._middle_ns(index)) and is_nsfs(NETNS_DIR / self._sandbox_ns(index))):
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

    @off_loop
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
        if netns_in_use(path):
            return True

        def check() -> bool:
            enter_netns(path)
            with IPRoute() as ipr:
                links = ipr.link_lookup(ifname=GUEST_IF)
                if not links:
                    return False
                addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=links[0], family=2)]
                return GUEST_IP in addrs

        return in_thread(check)

    def _repair_guest(self, index: int) -> None:
        """Put the guest address and default route back on the sandbox's ``eth0``."""
        path = str(NETNS_DIR / self._sandbox_ns(index))

        def repair() -> None:
            enter_netns(path)
            enable_ipv6_loopback()  # slots made before lo kept ::1
            with IPRoute() as ipr:
                eth0 = ipr.link_lookup(ifname=GUEST_IF)[0]
                addrs = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=eth0, family=2)]
                if GUEST_IP not in addrs:
                    ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIXLEN)
                ipr.link("set", index=eth0, state="up")
                if not ipr.get_default_routes(family=2):
                    ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY, oif=eth0)

        in_thread(repair)

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
                disable_ipv6_defaults()
                enable_ipv6_loopback()
                with IPRoute() as ipr:
                    ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")

            create_netns(sandbox, sandbox_init)

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
                disable_ipv6_defaults()
                sysctl("net/ipv4/ip_forward", "1")
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
                create_netns(middle, middle_init)
            except NetlinkError as exc:
                raise NetworkError(f"configuring netns {middle}: {exc}") from exc

            # 3. sandbox side of the guest veth: fixed guest address and default route.
            def sandbox_eth0() -> None:
                enter_netns(sandbox_path)
                with IPRoute() as ipr:
                    eth0 = ipr.link_lookup(ifname=GUEST_IF)[0]
                    ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIXLEN)
                    ipr.link("set", index=eth0, state="up")
                    ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY, oif=eth0)

            try:
                in_thread(sandbox_eth0)
            except NetlinkError as exc:
                raise NetworkError(f"configuring {GUEST_IF} in {sandbox}: {exc}") from exc

            # 4. root side last: bringing it up with its address marks the slot complete.
            try:
                sysctl(f"net/ipv6/conf/{host_if}/disable_ipv6", "1")
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

    @off_loop
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
        if not is_nsfs(Path(middle)):
            raise NetworkError(f"slot {index} has no middle netns")
        rules = filter_table(policy, MIDDLE_GUEST_IF, MIDDLE_OUTER_IF)

        def apply() -> None:
            enter_netns(middle)
            proc = subprocess.run(["iptables-restore", "-w"], input=rules, capture_output=True, text=True)
            if proc.returncode != 0:
                raise NetworkError(f"iptables-restore (egress) in {middle}: {proc.stderr.strip()}")

        in_thread(apply)

    @off_loop
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
                remove_netns(name)
            except OSError as exc:
                raise NetworkError(f"removing netns {name}: {exc}") from exc

    @off_loop
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
