"""``forkyard top`` against a real server: one frame (``--once``) and ``--json`` list
the node and the sandboxes with their live CPU/memory, sorted as asked."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from e2b import Sandbox

CLI = [sys.executable, "-m", "forkyard.cli.main", "top"]


def top(*args: str) -> subprocess.CompletedProcess:
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, check=False)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture
def two(server):
    """Two sandboxes; the second holds ~300 MiB of memory in a background process."""
    a = Sandbox.create("base", timeout=300)
    b = Sandbox.create("base", timeout=300, metadata={"role": "hog"})
    try:
        b.commands.run("python3 -c 'import time; x = bytearray(300 << 20); x[::4096] = b\"1\" * len(x[::4096]); "
                       "time.sleep(600)'", background=True, timeout=0)
        yield a, b
    finally:
        a.kill()
        b.kill()


def test_top_once_and_json_sorted_by_memory(two):
    a, b = two
    deadline = time.time() + 60
    while True:  # the hog's allocation shows up in its memory once it has run
        data = json.loads(top("--json").stdout)
        usage = {s["sandboxID"]: s["usage"] for s in data["sandboxes"]}
        if usage.get(b.sandbox_id, {}).get("memUsed", 0) > usage.get(a.sandbox_id, {}).get("memUsed", 0) + (200 << 20):
            break
        assert time.time() < deadline, usage
        time.sleep(1)
    assert data["nodes"]["sandboxes"]["running"] >= 2
    p = top("--once", "--sort", "mem")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    rows = [l for l in lines if a.sandbox_id in l or b.sandbox_id in l]
    assert len(rows) == 2 and b.sandbox_id in rows[0], p.stdout  # the hog first
    assert "running" in rows[0] and "MiB" in rows[0]
    assert any("spare slots" in l for l in lines)
    by_age = [l for l in top("--once", "--sort", "age").stdout.splitlines() if a.sandbox_id in l or b.sandbox_id in l]
    assert a.sandbox_id in by_age[0]  # oldest first


def test_top_refuses_bad_options(server):
    for args, word in ((["--sort", "disk"], "unknown sort"), (["--interval", "0.1"], "too short"),
                       (["--limit", "0"], "out of range")):
        p = top("--once", *args)
        assert p.returncode == 1 and word in p.stderr, p.stderr


def test_top_live_in_a_terminal(server, sandbox):
    """In a real PTY: the live view draws the sandbox, ``m`` re-sorts by memory, ``q``
    quits with status 0 and the terminal is restored."""
    import os
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # child: the CLI on the PTY
        os.execvp(sys.executable, [*CLI, "--interval", "0.5"])

    def read_until(text: str, timeout_s: float = 60) -> str:
        buf = b""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            r, _, _ = select.select([fd], [], [], 0.5)
            if r:
                try:
                    buf += os.read(fd, 65536)
                except OSError:
                    break
                if text.encode() in buf:
                    return buf.decode(errors="replace")
        raise AssertionError(f"{text!r} not shown; got {buf[-2000:]!r}")

    try:
        read_until(sandbox.sandbox_id)
        os.write(fd, b"m")
        read_until("sorted by mem")
        os.write(fd, b"q")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        pid = 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.close(fd)
