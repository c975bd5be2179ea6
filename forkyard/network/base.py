"""Network slot contract (implemented in :mod:`forkyard.network.slots`).

A *slot* is a numbered, per-sandbox network arrangement:

* sandbox netns ``fy<N>s`` — given to the runtime; holds only ``eth0`` with the fixed
  guest address (``config.GUEST_IP``/30, default route via ``config.GUEST_GATEWAY``),
  so every sandbox sees identical addressing (needed for checkpoint/restore/fork).
* middle netns ``fy<N>`` — peer of ``eth0`` (gateway address) plus a veth to the root
  netns carrying the slot's *outer address*; NAT here maps outer address → guest IP
  (DNAT, so the host reaches any sandbox port at ``outer_ip:port``) and masquerades
  egress.
* root netns — host end ``fyv<N>``; forwarding + masquerade to the internet; sandboxes
  cannot reach host services (INPUT dropped), the API port, or each other.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One allocated slot.

    Attributes:
        index: slot number N (0 ≤ N < 16384).
        netns_path: path of the sandbox netns to put in the OCI spec.
        outer_ip: address the host uses to reach the sandbox (``outer_ip:port`` → guest).
    """

    index: int
    netns_path: str
    outer_ip: str
