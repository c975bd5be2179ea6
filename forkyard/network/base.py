"""The network's interface: what the orchestrator asks of it (:class:`Network`) and what a
runtime gets from it to plug a sandbox in (a slot's attachment).

A *slot* is a numbered, per-sandbox network arrangement. Every sandbox sees the same
guest address (``config.GUEST_IP``/30, default route via ``config.GUEST_GATEWAY``), so a
checkpoint restores into any slot; the host reaches each at the slot's own *outer
address* (``outer_ip:port`` → guest, by NAT inside the slot), which is what the proxy
connects to.

How a runtime attaches to its slot depends on the runtime, so a :class:`Slot` carries an
*attachment* of the kind its network makes:

* :class:`NetnsAttachment` (:class:`forkyard.network.slots.NetnsNetwork`): the sandbox
  runs in a network namespace whose only interface is ``eth0`` with the guest address;
  gVisor's netstack takes that interface over (``runsc --network=sandbox``). The layout
  (sandbox netns ``<prefix><N>s``, middle netns with the NAT, host veth) is in
  :mod:`forkyard.network.slots`.

A microVM runtime would take a tap device instead (docs/architecture.md, "Adding a
runtime"): a network variant that builds the same slot with a tap in the sandbox netns
and hands out an attachment naming it and the guest's MAC; the guest sets the guest
address itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class NetnsAttachment:
    """A slot a runtime joins by running the sandbox in a network namespace.

    Attributes:
        netns_path: the sandbox netns (``/run/netns/<prefix><N>s``): its ``eth0`` carries
            the guest address and default route.
    """

    netns_path: str


@dataclass(frozen=True)
class Slot:
    """One allocated slot.

    Attributes:
        index: slot number N (0 ≤ N < 16384).
        outer_ip: address the host uses to reach the sandbox (``outer_ip:port`` → guest).
        attachment: what the runtime plugs the sandbox into (its kind is the network's
            :attr:`Network.attachment`).
    """

    index: int
    outer_ip: str
    attachment: NetnsAttachment


class Network(Protocol):
    """What the orchestrator uses of a network. All methods block (netlink, iptables):
    call them from a thread in async code.

    Attributes:
        attachment: the attachment type its slots carry; the composition root
            (:mod:`forkyard.node`) pairs it with a runtime driver that takes that type.
    """

    attachment: type

    def setup_host(self) -> None:
        """Prepare the host (forwarding, firewall chains). Idempotent."""

    def teardown_host(self) -> None:
        """Undo :meth:`setup_host` (a node stopping with nothing running)."""

    def ensure_jumps_first(self) -> list[str]:
        """Put the host firewall's rules back ahead of rules other software added since;
        returns what was moved."""

    def allocate(self, index: int) -> Slot:
        """Build slot ``index`` (idempotent: an existing complete slot is reused, which
        is how a restarted node re-adopts running sandboxes)."""

    def release(self, index: int) -> None:
        """Remove slot ``index``. Idempotent."""

    def existing_indexes(self) -> list[int]:
        """Indexes of every slot with any piece on the host (reconciliation)."""

    def set_egress(self, index: int, policy) -> None:
        """Replace slot ``index``'s egress filter with ``policy``
        (:class:`forkyard.network.egress.EgressPolicy`)."""
