"""Files forkyard writes into a sandbox's filesystem: ``/etc/hosts`` for its hostname,
and the host's resolvers a sandbox can reach (its ``/etc/resolv.conf``, and the DNS the
network layer lets through).

Used by template builds (the rootfs), the gVisor spec (per-sandbox ``/etc`` files) and
the network slots (DNS allowed past an egress policy).
"""

from __future__ import annotations

from pathlib import Path


def host_nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> list[str]:
    """Nameservers from the host's resolv.conf that a sandbox can reach through NAT
    (IPv4 addresses, in the file's order).

    Loopback resolvers (``127.*``, ``::1``, e.g. systemd-resolved's stub) are not reachable
    from a sandbox; in that case the upstream list of systemd-resolved is used instead.
    Returns an empty list if nothing usable is found.
    """
    candidates = [resolv_conf, Path("/run/systemd/resolve/resolv.conf")]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        servers = []
        for line in text.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "nameserver":
                ns = parts[1]
                if ns.startswith("127.") or ns == "::1" or ":" in ns:
                    continue  # loopback unreachable; IPv6 not routed to sandboxes
                servers.append(ns)
        if servers:
            return servers
    return []


def hosts_file(hostname: str) -> str:
    """``/etc/hosts`` content mapping ``hostname`` to loopback (so ``sudo`` resolves it)."""
    return (
        "127.0.0.1\tlocalhost\n"
        f"127.0.1.1\t{hostname}\n"
        "::1\tlocalhost ip6-localhost ip6-loopback\n"
        "ff02::1\tip6-allnodes\nff02::2\tip6-allrouters\n"
    )
