"""Network slot build: forkyard's thread-``setns`` code vs the same slot built with
pyroute2's own namespace support, in one run (issue 20: is the hand-written netns code
in forkyard/network/netns.py worth having?).

* ``forkyard`` — :meth:`forkyard.network.slots.NetnsNetwork.allocate` of a fresh index:
  short-lived threads ``setns``/``unshare`` themselves, pyroute2 ``IPRoute`` inside them,
  one ``iptables-restore`` process;
* ``pyroute2`` — the same slot (two netns, two veth pairs, addresses, routes, sysctls,
  the NAT rules) with ``pyroute2.netns.create`` and ``IPRoute(netns=...)`` (each forks a
  helper process: ``pyroute2.process.ChildProcess``), sysctls and ``iptables-restore``
  inside a netns through ``ip netns exec`` (pyroute2 cannot write a sysctl or run a
  program in another netns).

Both are checked to give the same slot (guest address on ``eth0``, default routes, host
veth up with its address). Alternated per iteration; every slot is removed right after
it was timed. Prints p50/p95 of one build (ms) and the ratio pyroute2 / forkyard.

Usage (root): ``python bench/bench_netns.py [-n 30]``. Uses name prefix ``fbq`` and the
outer range 10.123.0.0/16 (nothing else on the host may use them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from pyroute2 import IPRoute
from pyroute2 import netns as pnetns

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import pct  # noqa: E402

from forkyard.config import GUEST_GATEWAY, GUEST_IP, GUEST_PREFIXLEN  # noqa: E402
from forkyard.network.slots import NetnsNetwork  # noqa: E402

PREFIX = "fbq"
OUTER = "10.123.0.0/16"


def _sysctls(ns: str, *settings: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", *settings], check=True)


def build_pyroute2(net: NetnsNetwork, index: int) -> None:
    """Slot ``index`` as NetnsNetwork._build makes it, with pyroute2's netns API."""
    host_ip, outer_ip = net.addresses(index)
    sandbox, middle, host_if = f"{PREFIX}{index}s", f"{PREFIX}{index}", f"{PREFIX}v{index}"
    pnetns.create(sandbox)
    _sysctls(sandbox, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
             "net.ipv6.conf.lo.disable_ipv6=0")
    with IPRoute(netns=sandbox) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
    pnetns.create(middle)
    _sysctls(middle, "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1",
             "net.ipv4.ip_forward=1")
    sfd = os.open(f"/run/netns/{sandbox}", os.O_RDONLY)
    rfd = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        with IPRoute(netns=middle) as ipr:
            ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
            ipr.link("add", ifname="vg", kind="veth", peer={"ifname": "eth0", "net_ns_fd": sfd})
            ipr.link("add", ifname="vo", kind="veth", peer={"ifname": host_if, "net_ns_fd": rfd})
            vg, vo = ipr.link_lookup(ifname="vg")[0], ipr.link_lookup(ifname="vo")[0]
            ipr.addr("add", index=vg, address=GUEST_GATEWAY, prefixlen=GUEST_PREFIXLEN)
            ipr.addr("add", index=vo, address=outer_ip, prefixlen=30)
            ipr.link("set", index=vg, state="up")
            ipr.link("set", index=vo, state="up")
            ipr.route("add", dst="0.0.0.0/0", gateway=host_ip, oif=vo)
    finally:
        os.close(sfd)
        os.close(rfd)
    nat = ("*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:POSTROUTING ACCEPT [0:0]\n"
           f"-A PREROUTING -i vo -d {outer_ip}/32 -j DNAT --to-destination {GUEST_IP}\n"
           "-A POSTROUTING -o vo -j MASQUERADE\nCOMMIT\n")
    subprocess.run(["ip", "netns", "exec", middle, "iptables-restore", "-w"], input=nat, text=True, check=True)
    with IPRoute(netns=sandbox) as ipr:
        eth0 = ipr.link_lookup(ifname="eth0")[0]
        ipr.addr("add", index=eth0, address=GUEST_IP, prefixlen=GUEST_PREFIXLEN)
        ipr.link("set", index=eth0, state="up")
        ipr.route("add", dst="0.0.0.0/0", gateway=GUEST_GATEWAY, oif=eth0)
    with open(f"/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6", "w") as f:
        f.write("1")
    with IPRoute() as ipr:
        hidx = ipr.link_lookup(ifname=host_if)[0]
        ipr.addr("add", index=hidx, address=host_ip, prefixlen=30)
        ipr.link("set", index=hidx, state="up")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=30, help="builds per variant")
    args = ap.parse_args()
    net = NetnsNetwork(None, outer_net=OUTER, prefix=PREFIX)
    for idx in net.existing_indexes():
        net.release(idx)
    ours, theirs = [], []
    try:
        for i in range(args.n):
            order = [("forkyard", 2 * i), ("pyroute2", 2 * i + 1)]
            if i % 2:
                order.reverse()
            for kind, idx in order:
                t0 = time.perf_counter()
                if kind == "forkyard":
                    net.allocate(idx)
                else:
                    build_pyroute2(net, idx)
                ms = (time.perf_counter() - t0) * 1000
                assert net.is_complete(idx) and net._guest_ready(idx), f"{kind} slot {idx} is incomplete"
                (ours if kind == "forkyard" else theirs).append(ms)
                net.release(idx)
    finally:
        for idx in net.existing_indexes():
            net.release(idx)
    print(f"slot build, {args.n} each, alternated (load {os.getloadavg()[0]:.1f})")
    for name, xs in (("forkyard (thread setns)", ours), ("pyroute2 netns API", theirs)):
        print(f"{name:<26} p50 {pct(xs, 50):7.1f} ms   p95 {pct(xs, 95):7.1f} ms")
    print(f"ratio pyroute2 / forkyard   p50 {pct(theirs, 50) / pct(ours, 50):5.2f}x"
          f"   p95 {pct(theirs, 95) / pct(ours, 95):5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
