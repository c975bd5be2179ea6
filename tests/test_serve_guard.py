"""A second ``forkyard serve`` on a running server's data dir or port is refused before
it changes anything: a fresh-user trial ran README command 1 twice and, following the
network-prefix hint, started a second server on the same data dir, which adopted the
first one's sandboxes, removed its warm pool and spare disks as orphans, left 14 network
namespaces and only then failed to bind port 3000."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import free_port, host_leftovers

OTHER_PREFIX = "fyzg"  # a prefix no test session uses: the network lock is not what stops it


def _serve(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base"],
                          env=env, capture_output=True, text=True, timeout=120)


def _netns_of(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def test_a_second_server_on_the_same_data_dir_is_refused_and_changes_nothing(server, sandbox):
    def held() -> dict[str, list[str]]:  # the first server's netns, veths and runsc processes
        found = host_leftovers()
        return {k: sorted(found[k]) for k in ("netns", "veth", "runsc")}

    before = held()
    assert sandbox.commands.run("echo alive > /tmp/mark").exit_code == 0
    env = dict(server.env(), FORKYARD_PORT=str(free_port()), FORKYARD_NET_PREFIX=OTHER_PREFIX,
               FORKYARD_OUTER_NET="10.250.0.0/16")
    t0 = time.monotonic()
    r = _serve(env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert time.monotonic() - t0 < 30
    assert "already uses data dir" in r.stderr and str(server.data_dir) in r.stderr, r.stderr
    assert f"pid {server.proc.pid}" in r.stderr, r.stderr  # names the server that holds it
    assert "Traceback" not in r.stderr
    assert _netns_of(OTHER_PREFIX) == []
    after = held()  # the first server's sandboxes and network slots are all still there (it may add spare slots)
    assert after["runsc"] == before["runsc"]
    assert set(before["netns"]) <= set(after["netns"]) and set(before["veth"]) <= set(after["veth"])
    assert sandbox.commands.run("cat /tmp/mark").stdout.strip() == "alive"


def test_a_second_server_on_a_taken_port_is_refused_before_it_starts(server, tmp_path):
    data = tmp_path / "data"
    env = dict(server.env(), FORKYARD_DATA_DIR=str(data), FORKYARD_NET_PREFIX=OTHER_PREFIX,
               FORKYARD_OUTER_NET="10.250.0.0/16")  # server.env() has the first server's port
    r = _serve(env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"port {server.port} on 127.0.0.1 is already in use" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert _netns_of(OTHER_PREFIX) == []
    assert sorted(p.name for p in data.iterdir()) == ["server.lock"]  # nothing else was made


def test_the_data_dir_lock_ends_with_its_server(tmp_path):
    """A server killed with SIGKILL leaves its lock file, not its lock: the next start on
    that data dir is not refused."""
    data = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; from pathlib import Path; from forkyard.cli.serve import lock_data_dir; "
                               f"lock_data_dir(Path({str(data)!r})); print('locked', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        again = [sys.executable, "-c", f"from pathlib import Path; from forkyard.cli.serve import lock_data_dir; "
                                       f"lock_data_dir(Path({str(data)!r}))"]
        r = subprocess.run(again, capture_output=True, text=True, timeout=30)
        assert r.returncode == 1 and f"pid {holder.pid}" in r.stderr, r.stderr
    finally:
        holder.kill()
        holder.wait()
    r = subprocess.run(again, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_a_server_whose_outer_range_overlaps_another_nodes_is_refused_in_one_line(server, sandbox, tmp_path):
    """A second node with its own prefix but the first one's ``FORKYARD_OUTER_NET`` (a
    fresh-user trial of the README's one-host cluster): refused before it serves, with
    one line naming the setting and the route, not a traceback in the startup log."""
    outer = server.env()["FORKYARD_OUTER_NET"]
    env = dict(server.env(), FORKYARD_PORT=str(free_port()), FORKYARD_DATA_DIR=str(tmp_path / "data"),
               FORKYARD_NET_PREFIX=OTHER_PREFIX)
    r = _serve(env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "FORKYARD_OUTER_NET" in r.stderr and f"outer range {outer} overlaps host route" in r.stderr, r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert _netns_of(OTHER_PREFIX) == []
    assert sandbox.commands.run("echo still").stdout.strip() == "still"
