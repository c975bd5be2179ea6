"""forkyard CLI conventions (issue 9 item 12): --version, flags without values in --help,
exec exit codes for signals and timeouts, stdin forwarding, tables only on a TTY,
idempotent pause/resume, newest first."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

from test_cli import CLI, cli, cli_json


def cli_tty(*args: str, timeout: float = 120) -> str:
    """Run the CLI with stdout on a pseudo-terminal; its output (ANSI codes removed)."""
    master, slave = pty.openpty()
    p = subprocess.Popen([*CLI, *args], stdout=slave, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                         env={**os.environ, "COLUMNS": "200"})
    os.close(slave)
    buf, deadline = b"", time.time() + timeout
    while time.time() < deadline:
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
        elif p.poll() is not None:
            break
    p.wait(timeout=10)
    os.close(master)
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", buf.decode(errors="replace"))


@pytest.fixture(scope="module")
def sid(server):
    p = cli("start", "base", "--detach", "--timeout", "600", "--metadata", "suite=fidcli")
    assert p.returncode == 0, p.stderr
    yield p.stdout.strip()
    cli("rm", p.stdout.strip())


def test_version_and_flag_help():
    p = cli("--version")
    assert p.returncode == 0 and re.fullmatch(r"forkyard \d+\.\d+\.\d+\n", p.stdout)
    for cmd in (["exec"], ["ls"], ["serve"], ["pause"]):
        h = cli(*cmd, "--help")
        assert h.returncode == 0 and "<bool>" not in h.stdout, h.stdout
    assert "--json" in cli("ls", "--help").stdout


def test_exec_signal_timeout_and_stdin(sid):
    p = cli("exec", sid, "--", "kill -9 $$")
    assert p.returncode == 128 + 9, (p.returncode, p.stderr)
    p = cli("exec", sid, "--", "kill -TERM $$")
    assert p.returncode == 128 + 15, (p.returncode, p.stderr)
    p = cli("exec", sid, "--json", "--", "kill -SEGV $$")
    assert p.returncode == 128 + 11 and json.loads(p.stdout)["exitCode"] == 139
    t0 = time.time()
    p = cli("exec", sid, "--timeout", "2", "--", "sleep 30")
    assert p.returncode == 124 and p.stderr.strip() == "timed out after 2 s", (p.returncode, p.stderr)
    assert time.time() - t0 < 25
    # the timed-out command was killed
    assert "sleep 30" not in cli("exec", sid, "--", "ps -eo args").stdout
    p = subprocess.run([*CLI, "exec", "-i", sid, "--", "tr a-z A-Z; echo done"], input="hello\nworld\n",
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == "HELLO\nWORLD\ndone\n", (p.stdout, p.stderr)
    p = cli("exec", sid, "--", "exit 3")
    assert p.returncode == 3


def test_tables_only_on_a_tty_and_newest_first(sid, server):
    second = cli("start", "base", "--detach", "--timeout", "120", "--metadata", "suite=fidcli").stdout.strip()
    try:
        piped = cli("ls", "--metadata", "suite=fidcli")
        assert piped.stdout.split() == [second, sid], piped.stdout  # ids only, newest first
        table = cli_tty("ls", "--metadata", "suite=fidcli")
        assert "TEMPLATE" in table and "running" in table and sid in table
        assert table.index(second) < table.index(sid)
        snap1 = cli("snapshot", "create", sid).stdout.strip()
        snap2 = cli("snapshot", "create", sid).stdout.strip()
        listed = cli("snapshot", "list", "--sandbox", sid).stdout.split()
        assert listed[:2] == [snap2, snap1], listed
        for s in (snap1, snap2):
            cli("snapshot", "rm", s)
    finally:
        cli("rm", second)


def test_pause_paused_and_resume_running_are_not_errors(sid):
    p = cli("resume", sid)
    assert p.returncode == 0 and "already running" in p.stdout, (p.stdout, p.stderr)
    assert cli("pause", sid).returncode == 0
    p = cli("pause", sid, "--json")
    assert p.returncode == 0 and json.loads(p.stdout)[0]["ok"] is True
    assert cli("resume", sid).returncode == 0
    assert cli_json("info", sid)["state"] == "running"
    p = cli("pause", "nosuchsandbox")
    assert p.returncode == 1 and "not found" in p.stderr
