"""Per-sandbox egress policy (E2B's ``network.allowOut`` / ``denyOut`` and
``allow_internet_access``; field semantics from the e2b 2.63 SDK's
``SandboxNetworkConfig``).

* entries are IPv4 addresses or CIDR blocks; ``0.0.0.0/0`` is all traffic;
* an allowed entry always wins over a denied one;
* ``allow_internet_access=False`` is the same as ``denyOut: ["0.0.0.0/0"]``;
* domain entries need an HTTP/TLS-SNI egress proxy, which forkyard does not have: they are
  refused (:class:`PolicyError`) rather than accepted and ignored.

The policy is enforced in the slot's middle netns (:meth:`NetnsNetwork.set_egress`) on
packets the sandbox sends out (``vg`` → ``vo``); replies of connections made *to* the
sandbox (the API proxy, user ports) always pass. Host-wide blocks (private ranges,
metadata addresses: ``FORKYARD_BLOCKED_EGRESS``) still apply to allowed entries.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

ALL_TRAFFIC = "0.0.0.0/0"
#: Bound on entries per list (each becomes one iptables rule).
MAX_ENTRIES = 256


class PolicyError(ValueError):
    """An entry is not an IPv4 address or CIDR (the message names the field and entry)."""


@dataclass(frozen=True)
class EgressPolicy:
    """Normalised policy: ``allow``/``deny`` are CIDR strings (``a.b.c.d/n``)."""

    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """True when nothing is filtered (no deny entry)."""
        return not self.deny

    def to_json(self) -> dict:
        """``{"allowOut": [...], "denyOut": [...]}`` as stored and reported."""
        return {"allowOut": list(self.allow), "denyOut": list(self.deny)}

    @classmethod
    def from_json(cls, d: dict | None) -> EgressPolicy:
        """Inverse of :meth:`to_json` (stored values are already normalised)."""
        d = d or {}
        return cls(tuple(d.get("allowOut") or ()), tuple(d.get("denyOut") or ()))


def _cidrs(name: str, entries: list[str] | None) -> tuple[str, ...]:
    out: list[str] = []
    for raw in entries or ():
        if not isinstance(raw, str) or not raw.strip():
            raise PolicyError(f"network.{name}: empty entry")
        try:
            net = ipaddress.IPv4Network(raw.strip(), strict=False)
        except ValueError:
            if any(c.isalpha() for c in raw):
                raise PolicyError(f"network.{name}: domain entries ({raw!r}) are not supported by forkyard "
                                  "(they need an egress HTTP/TLS proxy); use IP addresses or CIDR blocks") from None
            raise PolicyError(f"network.{name}: {raw!r} is not an IPv4 address or CIDR block") from None
        if str(net) not in out:
            out.append(str(net))
    if len(out) > MAX_ENTRIES:
        raise PolicyError(f"network.{name}: at most {MAX_ENTRIES} entries")
    return tuple(out)


def parse_policy(allow_out: list[str] | None, deny_out: list[str] | None,
                 allow_internet_access: bool | None = None) -> EgressPolicy:
    """Validate and normalise E2B's fields into an :class:`EgressPolicy`.

    Raises:
        PolicyError: an entry is a domain, or not an IPv4 address/CIDR, or a list is too long.
    """
    allow = _cidrs("allowOut", allow_out)
    deny = _cidrs("denyOut", deny_out)
    if allow_internet_access is False and ALL_TRAFFIC not in deny:
        deny = (*deny, ALL_TRAFFIC)
    return EgressPolicy(allow, deny)


def filter_table(policy: EgressPolicy, guest_if: str, outer_if: str) -> str:
    """``iptables-restore`` input for the middle netns' whole ``filter`` table: replies of
    connections made to the sandbox pass, then ``allow`` entries (ACCEPT), then ``deny``
    entries (DROP), for packets from ``guest_if`` out of ``outer_if``. An empty policy
    gives an empty table (everything passes)."""
    lines = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    if not policy.empty:
        out = f"-A FORWARD -i {guest_if} -o {outer_if}"
        lines.append(f"{out} -m conntrack --ctstate ESTABLISHED,RELATED --ctdir REPLY -j ACCEPT")
        lines += [f"{out} -d {net} -j ACCEPT" for net in policy.allow]
        lines += [f"{out} -d {net} -j DROP" for net in policy.deny]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"
