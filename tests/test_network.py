"""Network slots on the real host: netns, veths, NAT and isolation (no gVisor here).

Uses this session's test prefix and outer range (``P`` = ``ft<letter>``, see ``_hostutil``); every test releases
what it allocated and the module asserts nothing of the prefix is left.
"""

from __future__ import annotations

import ipaddress

import json
import socket
import subprocess
import threading
import time

import pytest

import _hostutil as hu

P = hu.TEST_PREFIX
from forkyard.config import GUEST_GATEWAY, GUEST_IP
from forkyard.network.slots import NetnsNetwork


def _ip_json(netns: str | None, *args: str) -> list[dict]:
    cmd = (["nsenter", f"--net={netns}"] if netns else []) + ["ip", "-j", *args]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout or "[]")


@pytest.fixture(scope="module")
def nm():
    manager = hu.network_manager()
    manager.setup_host()
    yield manager
    for idx in manager.existing_indexes():
        manager.release(idx)
    assert hu.netns_names() == []
    assert hu.host_links() == []
    manager.teardown_host()


@pytest.fixture
def slots(nm):
    """Allocate slots by index; everything is released (and checked) afterwards."""
    taken: list[int] = []

    def alloc(index: int):
        taken.append(index)
        return nm.allocate(index)

    yield alloc
    for idx in taken:
        nm.release(idx)
        assert f"{P}{idx}" not in hu.netns_names() and f"{P}{idx}s" not in hu.netns_names()
        assert f"{P}v{idx}" not in hu.host_links()


def test_slot_layout(nm, slots):
    slot = slots(3)
    host_ip, outer_ip = nm.addresses(3)
    assert slot.index == 3 and slot.attachment.netns_path == f"/run/netns/{P}3s"
    base = ipaddress.ip_network(hu.TEST_OUTER_NET).network_address
    assert (host_ip, outer_ip) == (str(base + 13), str(base + 14)) and slot.outer_ip == outer_ip

    guest = {l["ifname"]: l for l in _ip_json(slot.attachment.netns_path, "addr")}
    assert sorted(guest) == ["eth0", "lo"]
    addrs = [(a["local"], a["prefixlen"]) for a in guest["eth0"]["addr_info"] if a["family"] == "inet"]
    assert addrs == [(GUEST_IP, 30)]
    routes = _ip_json(slot.attachment.netns_path, "route")
    assert {"dst": "default", "gateway": GUEST_GATEWAY} in [{"dst": r["dst"], "gateway": r.get("gateway")} for r in routes]

    middle = {l["ifname"]: l for l in _ip_json(f"/run/netns/{P}3", "addr")}
    assert sorted(middle) == ["lo", "vg", "vo"]
    nat = subprocess.run(["nsenter", f"--net=/run/netns/{P}3", "iptables", "-t", "nat", "-S"],
                         capture_output=True, text=True, check=True).stdout
    assert f"-d {outer_ip}/32 -i vo -j DNAT --to-destination {GUEST_IP}" in nat
    assert "-A POSTROUTING -o vo -j MASQUERADE" in nat

    host = _ip_json(None, "addr", "show", f"{P}v3")[0]
    assert [(a["local"], a["prefixlen"]) for a in host["addr_info"] if a["family"] == "inet"] == [(host_ip, 30)]
    assert "UP" in host["flags"]


def test_release_is_idempotent(nm):
    nm.allocate(4)
    nm.release(4)
    nm.release(4)
    nm.release(4000)  # never allocated
    assert f"{P}4s" not in hu.netns_names() and f"{P}v4" not in hu.host_links()


def test_allocate_is_idempotent_and_rebuilds_partial_slots(nm, slots):
    first = slots(5)
    t = time.perf_counter()
    again = nm.allocate(5)
    print(f"\nallocate of an existing slot: {1000 * (time.perf_counter() - t):.1f} ms")
    assert again == first

    # Partial state: the middle netns vanished (its veths with it) -> full rebuild.
    subprocess.run(["ip", "netns", "delete", f"{P}5"], check=True)
    deadline = time.time() + 5  # the kernel tears a netns down asynchronously
    while f"{P}v5" in hu.host_links() and time.time() < deadline:
        time.sleep(0.02)
    assert f"{P}v5" not in hu.host_links()
    assert nm.allocate(5) == first
    assert f"{P}v5" in hu.host_links() and f"{P}5" in hu.netns_names()

    # Guest address gone (what runsc does when a sandbox starts) and nothing runs in
    # the netns -> allocate puts it back.
    subprocess.run(["nsenter", f"--net=/run/netns/{P}5s", "ip", "addr", "flush", "dev", "eth0"], check=True)
    subprocess.run(["nsenter", f"--net=/run/netns/{P}5s", "ip", "route", "flush", "all"], check=False)
    nm.allocate(5)
    eth0 = _ip_json(first.attachment.netns_path, "addr", "show", "eth0")[0]
    assert [a["local"] for a in eth0["addr_info"] if a["family"] == "inet"] == [GUEST_IP]
    assert any(r["dst"] == "default" for r in _ip_json(first.attachment.netns_path, "route"))


def test_existing_indexes(nm, slots):
    slots(6)
    slots(7)
    found = nm.existing_indexes()
    assert 6 in found and 7 in found
    nm.release(7)
    assert 7 not in nm.existing_indexes()


def test_index_range(nm):
    with pytest.raises(ValueError):
        nm.allocate(-1)
    last = ipaddress.ip_network(hu.TEST_OUTER_NET).num_addresses // 4 - 1  # one /30 per slot
    with pytest.raises(ValueError):
        nm.allocate(last + 1)
    top = ipaddress.ip_network(hu.TEST_OUTER_NET).broadcast_address
    assert nm.addresses(last) == (str(top - 2), str(top - 1))


def test_allocate_release_timing(nm):
    alloc, rel = [], []
    for _ in range(10):
        t = time.perf_counter()
        nm.allocate(9)
        t1 = time.perf_counter()
        nm.release(9)
        t2 = time.perf_counter()
        alloc.append(t1 - t)
        rel.append(t2 - t1)
    print(f"\nallocate: {hu.stats_ms(alloc)}; release: {hu.stats_ms(rel)}")
    assert sorted(alloc)[5] < 0.5 and sorted(rel)[5] < 0.5


def test_setup_host_is_idempotent(nm):
    nm.setup_host()
    nm.setup_host()
    assert open("/proc/sys/net/ipv4/ip_forward").read().strip() == "1"
    for table, parent in (("filter", "INPUT"), ("filter", "FORWARD"), ("nat", "POSTROUTING")):
        rules = subprocess.run(["iptables", "-t", table, "-S", parent], capture_output=True, text=True, check=True).stdout
        assert rules.count(f"-j FORKYARD-{P.upper()}-{parent}") == 1, rules


def test_teardown_host():
    other = NetnsNetwork(None, outer_net=f"10.211.{hu.SLOT * 16}.0/20", prefix="fw" + hu.LETTER)
    other.setup_host()
    assert f"FORKYARD-FW{hu.LETTER.upper()}-INPUT" in subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
    other.teardown_host()
    other.teardown_host()
    assert f"FORKYARD-FW{hu.LETTER.upper()}-" not in subprocess.run(["iptables", "-S"], capture_output=True, text=True).stdout
    assert f"FORKYARD-FW{hu.LETTER.upper()}-" not in subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True).stdout


def test_overlapping_outer_range_is_refused():
    # The host's own LAN route must never be handed out as an outer range.
    lan = _ip_json(None, "route", "show", "default")[0]["dev"]
    prefix = [r for r in _ip_json(None, "route", "show", "dev", lan) if r["dst"] != "default"][0]["dst"]
    with pytest.raises(Exception, match="overlaps"):
        NetnsNetwork(None, outer_net=prefix if "/" in prefix else prefix + "/32", prefix="fw").setup_host()


class _Listener:
    """A TCP listener that answers ``ok`` — on the host or (via nsenter) in a netns."""

    def __init__(self, host: str = "0.0.0.0"):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.sendall(b"ok")
            conn.close()

    def close(self):
        self.sock.close()


GUEST_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(({ip!r}, {port})); s.listen(8); print("ready", flush=True)
while True:
    c, _ = s.accept(); c.sendall(b"ok"); c.close()
"""


def _connect(host: str, port: int, timeout: float = 3.0) -> bytes:
    with socket.create_connection((host, port), timeout=timeout) as c:
        return c.recv(16)


def test_native_traffic_rules(nm, slots):
    """The NAT/isolation rules with native processes in the slot netns."""
    a, b = slots(10), slots(11)
    port = 49983
    servers = []
    try:
        for slot in (a, b):
            p = subprocess.Popen(["nsenter", f"--net={slot.attachment.netns_path}", "python3", "-c",
                                  GUEST_SERVER.format(ip=GUEST_IP, port=port)], stdout=subprocess.PIPE, text=True)
            servers.append(p)
            assert p.stdout.readline().strip() == "ready"
        # host -> outer_ip:port reaches the guest (DNAT) for both slots
        assert _connect(a.outer_ip, port) == b"ok"
        assert _connect(b.outer_ip, port) == b"ok"

        # guest -> DNS nameserver and TCP egress through the NAT
        ns = hu.nameserver()
        r = hu.in_netns(a.attachment.netns_path, f"import socket; print(socket.gethostbyname({hu.mirror_host()!r}))")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
        r = hu.in_netns(a.attachment.netns_path, hu.CONNECT_SNIPPET.format(host=ns, port=53, timeout=3))
        assert r.stdout.strip() == "OK"

        # guest -> host services, its slot's host address, another slot: blocked
        listener = _Listener()
        try:
            host_ip, _ = nm.addresses(10)
            targets = [(hu.host_source_ip(ns), listener.port), (host_ip, listener.port),
                       (nm.addresses(11)[0], listener.port), (b.outer_ip, port)]
            for host, p in targets:
                r = hu.in_netns(a.attachment.netns_path, hu.CONNECT_SNIPPET.format(host=host, port=p, timeout=1.5))
                assert r.stdout.strip().startswith("FAIL"), f"{host}:{p} reachable from a sandbox"
            assert _connect("127.0.0.1", listener.port) == b"ok"  # control: listener works
        finally:
            listener.close()
    finally:
        for p in servers:
            p.kill()
            p.wait()
