"""The host side of the slots' network: forkyard's iptables chains in the root netns,
and the check that the outer range steals no host route.

Chains (``FORKYARD-*``, or ``FORKYARD-<PREFIX>-*`` for a server with its own prefix):
``FORKYARD-INPUT`` (drop everything from ``<prefix>v+`` except replies and the host
services opened to sandboxes (:class:`HostServices`: the package cache's address and
TCP ports, nothing else): sandboxes cannot reach other host services, the API port or a
slot's host address; that address is refused from anywhere but sandboxes and the host
itself), ``FORKYARD-FORWARD`` (no
slot-to-slot traffic, no private/link-local/metadata addresses but the host's resolvers,
no new connections from outside into slots, egress allowed), ``FORKYARD-OUTPUT`` (only
root on the host connects to a slot: other local users are refused) and nat
``FORKYARD-POSTROUTING`` (masquerade the outer range leaving the host).
"""

from __future__ import annotations

import ipaddress
import logging
import re
import subprocess
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from forkyard.guest.files import host_nameservers
from forkyard.network.netns import off_loop, sysctl

log = logging.getLogger(__name__)

CHAIN_PREFIX = "FORKYARD-"
#: Destinations sandboxes may never reach (RFC 1918, CGNAT, link-local incl. cloud
#: metadata, loopback, this-network, TEST-NETs, multicast/reserved).
BLOCKED_EGRESS = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/3",
]


@dataclass(frozen=True)
class HostServices:
    """Services on the host that this node's sandboxes may reach (the package cache,
    :mod:`forkyard.pkgcache`): TCP ``ports`` on ``address``, an IPv4 address the host
    puts on ``lo`` (a /32, labelled ``lo:<prefix>svc``) when it sets up its network. It
    lies outside the outer range and is the same on every node, so a sandbox reaches it
    wherever it was restored; packets to it leave a slot by its default route.

    Attributes:
        address: the services' IPv4 address.
        ports: the TCP ports open to sandboxes there.
        max_conns: the most connections one sandbox (its slot's outer address) may
            have open to them at once; more are refused (a TCP reset), so that one
            sandbox cannot take every connection the services can hold.
    """

    address: str
    ports: tuple[int, ...]
    max_conns: int = 32


class NetworkError(Exception):
    """A network slot or host operation failed; the message says which step and why."""


def iptables(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``iptables -w ARGS`` in the calling thread's netns.

    Raises:
        NetworkError: it failed and ``check`` (the message carries its stderr).
    """
    proc = subprocess.run(["iptables", "-w", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetworkError(f"iptables {' '.join(args)}: {proc.stderr.strip()}")
    return proc


class HostFirewall:
    """forkyard's chains in the root netns for one server's slots.

    Args:
        prefix: the server's name prefix (host veths ``<prefix>v<N>``).
        chain_prefix: its chains' name prefix (``FORKYARD-`` or ``FORKYARD-<PREFIX>-``).
        outer_net: its outer range (one /30 per slot).
        blocked_egress: destinations no sandbox may reach.
        services: host services opened to sandboxes (None: none).
    """

    def __init__(self, prefix: str, chain_prefix: str, outer_net: ipaddress.IPv4Network, blocked_egress: list[str],
                 services: HostServices | None = None):
        self.prefix = prefix
        self.chain_prefix = chain_prefix
        self.outer_net = outer_net
        self.blocked_egress = blocked_egress
        self.services = services
        self._if_re = re.compile(rf"^{prefix}v(\d+)$")

    @off_loop
    def setup_host(self) -> None:
        """Prepare the root netns: ip_forward, ``FORKYARD-*`` iptables chains and jumps.

        Idempotent: chains are flushed and refilled, jumps inserted once at position 1.

        Raises:
            NetworkError: the outer range overlaps a host route, or iptables failed.
        """
        self.check_no_overlap()
        sysctl("net/ipv4/ip_forward", "1")
        outer = str(self.outer_net)
        hif = f"{self.prefix}v+"
        svc = self.services
        opened: list[list[str]] = []
        if svc is not None:
            self._service_address(add=True)
            to_svc = ["-i", hif, "-d", svc.address, "-p", "tcp", "-m", "multiport",
                      "--dports", ",".join(str(p) for p in svc.ports)]
            opened = [
                # at most max_conns at once from one sandbox (by its outer address) ...
                [*to_svc, "--syn", "-m", "connlimit", "--connlimit-above", str(svc.max_conns),
                 "--connlimit-mask", "32", "-j", "REJECT", "--reject-with", "tcp-reset"],
                # exactly these TCP ports at that address, from this node's sandboxes ...
                [*to_svc, "-j", "ACCEPT"],
            ]
        rules: dict[tuple[str, str], list[list[str]]] = {
            ("filter", "INPUT"): [
                ["-i", hif, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                *opened,
                ["-i", hif, "-j", "DROP"],
                # ... and from the host itself; nobody else (other interfaces) reaches it.
                *([["-d", svc.address, "!", "-i", "lo", "-j", "DROP"]] if svc is not None else []),
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
                # (the host services' answers on connections sandboxes opened to them:
                # they run as an unprivileged account)
                *([["-o", hif, "-s", svc.address, "-p", "tcp", "-m", "multiport",
                    "--sports", ",".join(str(p) for p in svc.ports), "-m", "conntrack", "--ctstate",
                    "ESTABLISHED", "-j", "ACCEPT"],
                   # (and the resets that refuse a sandbox's connections beyond max_conns)
                   ["-o", hif, "-s", svc.address, "-p", "tcp", "-m", "multiport",
                    "--sports", ",".join(str(p) for p in svc.ports), "--tcp-flags", "RST", "RST", "-j", "ACCEPT"]]
                  if svc is not None else []),
                ["-o", hif, "-m", "owner", "!", "--uid-owner", "0", "-j", "REJECT",
                 "--reject-with", "icmp-admin-prohibited"],
            ],
            ("nat", "POSTROUTING"): [
                ["-s", outer, "!", "-o", hif, "-j", "MASQUERADE"],
            ],
        }
        for (table, parent), chain_rules in rules.items():
            chain = self.chain_prefix + parent
            if iptables("-t", table, "-n", "-L", chain, check=False).returncode != 0:
                iptables("-t", table, "-N", chain)
            iptables("-t", table, "-F", chain)
            for rule in chain_rules:
                iptables("-t", table, "-A", chain, *rule)
            if iptables("-t", table, "-C", parent, "-j", chain, check=False).returncode != 0:
                iptables("-t", table, "-I", parent, "1", "-j", chain)

    #: Built-in chains forkyard jumps from, with the table.
    HOST_JUMPS = (("filter", "INPUT"), ("filter", "FORWARD"), ("filter", "OUTPUT"), ("nat", "POSTROUTING"))

    @off_loop
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
            listing = iptables("-t", table, "-S", parent, check=False)
            if listing.returncode != 0:
                continue
            rules = [line.split() for line in listing.stdout.splitlines() if line.startswith("-A ")]
            ours = [i for i, r in enumerate(rules) if r[2:] == ["-j", chain]]
            if not ours:
                if iptables("-t", table, "-n", "-L", chain, check=False).returncode != 0:
                    continue  # chain gone: not set up
            foreign = [i for i, r in enumerate(rules)
                       if not (len(r) == 4 and r[2] == "-j" and r[3].startswith(CHAIN_PREFIX))]
            if ours and len(ours) == 1 and (not foreign or ours[0] < foreign[0]):
                continue
            while iptables("-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
            iptables("-t", table, "-I", parent, "1", "-j", chain)
            moved.append(f"{table}/{parent}")
        if moved:
            log.warning("forkyard's firewall jumps were behind other rules (%s); moved them first",
                        ", ".join(moved))
        return moved

    @off_loop
    def teardown_host(self) -> None:
        """Remove the ``FORKYARD-*`` chains and their jumps (tests; a server that stops with
        no sandbox running). Leaves ip_forward on.
        Idempotent; never raises for missing chains."""
        for table, parent in self.HOST_JUMPS:
            chain = self.chain_prefix + parent
            while iptables("-t", table, "-D", parent, "-j", chain, check=False).returncode == 0:
                pass
            iptables("-t", table, "-F", chain, check=False)
            iptables("-t", table, "-X", chain, check=False)
        if self.services is not None:
            self._service_address(add=False)

    def _service_address(self, add: bool) -> None:
        """Put :attr:`services`' address on ``lo`` (``add``, idempotent) or take it off
        (missing: nothing to do).

        Raises:
            NetworkError: netlink refused (adding only).
        """
        address = self.services.address
        with IPRoute() as ipr:
            lo = ipr.link_lookup(ifname="lo")[0]
            present = address in [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(index=lo, family=2)]
            try:
                if add and not present:
                    ipr.addr("add", index=lo, address=address, prefixlen=32, label=f"lo:{self.prefix}svc")
                elif not add and present:
                    ipr.addr("del", index=lo, address=address, prefixlen=32)
            except NetlinkError as exc:
                if add:
                    raise NetworkError(f"adding the host services' address {address} to lo: {exc}") from exc
                log.warning("removing the host services' address %s from lo: %s", address, exc)

    @off_loop
    def check_no_overlap(self) -> None:
        """No main-table host route overlaps the outer range, except those on this
        prefix's own links (``<prefix>v<N>``: a slot of this node, e.g. left by a crash).

        Raises:
            NetworkError: one does.
        """
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
