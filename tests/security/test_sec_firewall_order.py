"""Issue 11 item 9: forkyard's iptables jumps stay ahead of rules other software
inserts later (Docker puts its DOCKER-USER / DOCKER-FORWARD jumps at the top of FORWARD
when it starts; here a foreign chain is inserted the same way, with a rule that would
drop every sandbox's forwarded traffic)."""

from __future__ import annotations

import subprocess
import time

from conftest import NET_PREFIX

FOREIGN = "FYTEST-DOCKER-FWD"


def _ipt(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["iptables", "-w", *args], capture_output=True, text=True, check=check)


def _forward_order() -> list[str]:
    return [line for line in _ipt("-S", "FORWARD").stdout.splitlines() if line.startswith("-A ")]


def _egress_ok(sandbox) -> bool:
    r = sandbox.commands.run("timeout 4 bash -c '</dev/tcp/1.1.1.1/80' && echo up || echo down", timeout=15)
    return r.stdout.strip() == "up"


def test_foreign_chain_inserted_first_is_overtaken(server, sandbox):
    ours = f"FORKYARD-{NET_PREFIX.upper()}-FORWARD"
    egress_before = _egress_ok(sandbox)
    _ipt("-N", FOREIGN, check=False)
    _ipt("-F", FOREIGN)
    _ipt("-A", FOREIGN, "-i", f"{NET_PREFIX}v+", "-j", "DROP")  # like a DROP policy for foreign traffic
    _ipt("-I", "FORWARD", "1", "-j", FOREIGN)
    try:
        assert _forward_order()[0] == f"-A FORWARD -j {FOREIGN}"
        deadline = time.time() + 30
        while time.time() < deadline:
            order = _forward_order()
            pos = {r: i for i, r in enumerate(order)}
            if pos.get(f"-A FORWARD -j {ours}", 1 << 30) < pos[f"-A FORWARD -j {FOREIGN}"]:
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"forkyard's jump still behind the foreign chain: {_forward_order()}")
        assert sum(r == f"-A FORWARD -j {ours}" for r in _forward_order()) == 1  # moved, not duplicated
        if egress_before:  # this host has an egress path: traffic flows again
            assert _egress_ok(sandbox)
    finally:
        while _ipt("-D", "FORWARD", "-j", FOREIGN, check=False).returncode == 0:
            pass
        _ipt("-F", FOREIGN, check=False)
        _ipt("-X", FOREIGN, check=False)
