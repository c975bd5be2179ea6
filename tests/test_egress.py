"""Egress policy (issue 9 item 7) through the real e2b SDK: ``network.allow_out`` /
``deny_out`` (addresses, CIDRs, the all-traffic range; allow wins over deny),
``allow_internet_access=False``, ``update_network`` replacing the rules, pause/resume and
fork keeping them.

There is no internet here: a "public" HTTP server listens on two TEST-NET-2 addresses
(198.51.100.0/24) in its own network namespace, routed from the host, and a second
forkyard server is started with ``FORKYARD_BLOCKED_EGRESS`` not blocking that range (the
default list blocks documentation ranges).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import conftest

_N = conftest.SLOT
#: This session's /29 of TEST-NET-2: host side .1, public servers .2 and .3.
BASE = 8 * _N
SUBNET = f"198.51.100.{BASE}/29"
HOST_SIDE, SRV_A, SRV_B = (f"198.51.100.{BASE + i}" for i in (1, 2, 3))
PUB_NS, PUB_IF = f"fidpub{_N}", f"fidpub{_N}h"
PREFIX, OUTER = conftest.NET_PREFIX + "e", f"10.{160 + _N}.0.0/16"


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def public_server(tmp_path_factory):
    """HTTP servers on SRV_A and SRV_B:80 in netns PUB_NS, routed from the host."""
    _sh("ip", "netns", "del", PUB_NS, check=False)
    _sh("ip", "link", "del", PUB_IF, check=False)
    www = tmp_path_factory.mktemp("www")
    (www / "index.html").write_text("public\n")
    _sh("ip", "netns", "add", PUB_NS)
    proc = None
    try:
        _sh("ip", "link", "add", PUB_IF, "type", "veth", "peer", "name", "eth0", "netns", PUB_NS)
        _sh("ip", "addr", "add", f"{HOST_SIDE}/29", "dev", PUB_IF)
        _sh("ip", "link", "set", PUB_IF, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{SRV_A}/29", "dev", "eth0"],
                    ["ip", "addr", "add", f"{SRV_B}/29", "dev", "eth0"], ["ip", "link", "set", "eth0", "up"],
                    ["ip", "route", "add", "default", "via", HOST_SIDE]):
            _sh("ip", "netns", "exec", PUB_NS, *cmd)
        proc = subprocess.Popen(["ip", "netns", "exec", PUB_NS, sys.executable, "-m", "http.server", "80",
                                 "--bind", "0.0.0.0", "--directory", str(www)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while _sh("curl", "-s", "-m", "2", f"http://{SRV_A}/", check=False).stdout != "public\n":
            assert time.time() < deadline, "public server did not come up"
            time.sleep(0.2)
        yield
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        _sh("ip", "link", "del", PUB_IF, check=False)
        _sh("ip", "netns", "del", PUB_NS, check=False)


@pytest.fixture(scope="module")
def egress_server(server, public_server, tmp_path_factory):
    """A forkyard server whose sandboxes may reach this session's TEST-NET-2 /29; the
    e2b SDK is pointed at it for the module."""
    from forkyard.network.firewall import BLOCKED_EGRESS
    from forkyard.network.slots import NetnsNetwork

    blocked = [n for n in BLOCKED_EGRESS if n != "198.51.100.0/24"]

    class EgressServer(conftest.ServerProc):
        def env(self):
            return {**super().env(), "FORKYARD_NET_PREFIX": PREFIX, "FORKYARD_OUTER_NET": OUTER,
                    "FORKYARD_BLOCKED_EGRESS": ",".join(blocked)}

    srv = EgressServer(tmp_path_factory.mktemp("egress") / "data", server.templates_dir)
    srv.data_dir.mkdir()
    srv.start()
    saved = {k: os.environ[k] for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
    try:
        yield srv
    finally:
        os.environ.update(saved)
        try:
            srv.kill_all()
        finally:
            srv.stop()
            NetnsNetwork(None, outer_net=OUTER, prefix=PREFIX).teardown_host()


def _reach(sbx, ip: str) -> bool:
    r = sbx.commands.run(f"curl -s -m 3 -o /dev/null -w '%{{http_code}}' http://{ip}/ || true", timeout=30)
    return r.stdout.strip() == "200"


def test_allow_deny_and_internet_access(egress_server):
    from e2b import ALL_TRAFFIC, Sandbox

    open_ = Sandbox.create("base", timeout=120)
    try:
        assert _reach(open_, SRV_A) and _reach(open_, SRV_B)
    finally:
        open_.kill()
    deny_b = Sandbox.create("base", timeout=120, network={"deny_out": [SRV_B]})
    try:
        assert _reach(deny_b, SRV_A) and not _reach(deny_b, SRV_B)
    finally:
        deny_b.kill()
    offline = Sandbox.create("base", timeout=120, allow_internet_access=False)
    try:
        # envd still answers through the proxy: replies to inbound connections pass
        assert offline.commands.run("echo up").stdout == "up\n"
        assert not _reach(offline, SRV_A) and not _reach(offline, SRV_B)
    finally:
        offline.kill()
    # allow wins over deny (CIDR and the all-traffic range)
    only_a = Sandbox.create("base", timeout=120, network={"allow_out": [f"{SRV_A}/32"], "deny_out": [ALL_TRAFFIC]})
    try:
        assert _reach(only_a, SRV_A) and not _reach(only_a, SRV_B)
    finally:
        only_a.kill()
    subnet_denied = Sandbox.create("base", timeout=120, network={"deny_out": [SUBNET], "allow_out": [SRV_B]})
    try:
        assert not _reach(subnet_denied, SRV_A) and _reach(subnet_denied, SRV_B)
    finally:
        subnet_denied.kill()


def test_update_network_replaces_rules_and_survives_pause_and_fork(egress_server):
    from e2b import ALL_TRAFFIC, Sandbox

    sbx = Sandbox.create("base", timeout=120)
    try:
        assert _reach(sbx, SRV_A)
        sbx.update_network({"deny_out": [ALL_TRAFFIC], "allow_out": [SRV_B]})
        assert not _reach(sbx, SRV_A) and _reach(sbx, SRV_B)
        sbx.update_network({"deny_out": [SRV_B]})  # replaces: A open again, B closed
        assert _reach(sbx, SRV_A) and not _reach(sbx, SRV_B)
        sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert _reach(sbx, SRV_A) and not _reach(sbx, SRV_B)
        kids = sbx.fork(count=1, timeout=60) if hasattr(sbx, "fork") else []
        for kid in kids:
            kid = kid if isinstance(kid, Sandbox) else Sandbox.connect(kid.sandbox_id)
            try:
                assert _reach(kid, SRV_A) and not _reach(kid, SRV_B)
            finally:
                kid.kill()
        sbx.update_network({})  # nothing: everything open
        assert _reach(sbx, SRV_A) and _reach(sbx, SRV_B)
        with egress_server.api() as c:
            r = c.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"allowOut": ["example.com"]})
            assert r.status_code == 400 and "domain" in r.json()["message"]
            r = c.put(f"/sandboxes/{sbx.sandbox_id}/network", json={"dnsServers": ["8.8.8.8"]})
            assert r.status_code == 400 and "dnsServers" in r.json()["message"]
            assert c.put("/sandboxes/nope/network", json={}).status_code == 404
        assert _reach(sbx, SRV_A)  # a refused update changed nothing
    finally:
        Sandbox.kill(sbx.sandbox_id)
