"""Commands and PTY through the official e2b SDK against real gVisor sandboxes."""

from __future__ import annotations

import time

import pytest
from e2b import CommandExitException, PtySize


def test_run_python(sandbox):
    r = sandbox.commands.run("python3 -c 'print(6*7)'")
    assert r.exit_code == 0
    assert r.stdout.strip() == "42"


def test_exit_code_and_stderr(sandbox):
    with pytest.raises(CommandExitException) as ei:
        sandbox.commands.run("echo oops >&2; exit 3")
    assert ei.value.exit_code == 3
    assert "oops" in ei.value.stderr


def test_env_cwd_user(sandbox):
    r = sandbox.commands.run("echo $FOO; pwd; whoami", envs={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout.split() == ["bar", "/tmp", "user"]
    r = sandbox.commands.run("whoami; echo $HOME", user="root")
    assert r.stdout.split() == ["root", "/root"]
    r = sandbox.commands.run("pwd; echo $HOME")
    assert r.stdout.split() == ["/home/user", "/home/user"]


def test_sandbox_env_vars_from_create(server):
    from e2b import Sandbox

    sbx = Sandbox.create("base", envs={"FROM_CREATE": "yes"}, timeout=60)
    try:
        assert sbx.commands.run("echo $FROM_CREATE").stdout.strip() == "yes"
    finally:
        sbx.kill()


def test_sudo_and_tools(sandbox):
    r = sandbox.commands.run("sudo -n whoami && git --version && curl --version | head -1 && pip --version")
    assert r.stdout.splitlines()[0] == "root"
    assert "git version" in r.stdout and "curl" in r.stdout and "pip" in r.stdout


def test_sudo_right_after_boot_waits_for_its_broker(sandbox):
    """``sudo`` run before the sandbox's sudo broker listens (a command sent right after
    a cold boot: a fresh CI machine once failed test_sudo_and_tools that way) waits for
    the broker instead of failing with the real sudo's "must be owned by uid 0 and have
    the setuid bit set". Here the broker is restarted 1 s late."""
    # (pkill -f matches command lines: its own must not contain the broker's path)
    sandbox.commands.run("pkill -f 'forkyard/[s]udo-broker'; rm -f /run/forkyard/sudo.sock", user="root")
    sandbox.commands.run("setsid sh -c 'sleep 1; exec /usr/local/lib/forkyard/sudo-broker' "
                         ">/dev/null 2>&1 </dev/null &", user="root")
    assert sandbox.commands.run("test -S /run/forkyard/sudo.sock || echo absent").stdout.strip() == "absent"
    assert sandbox.commands.run("sudo -n whoami").stdout.strip() == "root"


def test_background_wait_and_kill(sandbox):
    h = sandbox.commands.run("sleep 0.5; echo done", background=True)
    r = h.wait()
    assert r.stdout.strip() == "done" and r.exit_code == 0
    h = sandbox.commands.run("sleep 600", background=True)
    pids = [p.pid for p in sandbox.commands.list()]
    assert h.pid in pids
    assert h.kill() is True
    deadline = time.time() + 10
    while h.pid in [p.pid for p in sandbox.commands.list()] and time.time() < deadline:
        time.sleep(0.1)
    assert h.pid not in [p.pid for p in sandbox.commands.list()]


def test_streaming_callbacks(sandbox):
    out: list[str] = []
    sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.1; done", on_stdout=out.append)
    assert "".join(out).split() == ["line1", "line2", "line3"]


def test_stdin(sandbox):
    h = sandbox.commands.run("head -n 2", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "hello\n")
    sandbox.commands.send_stdin(h.pid, "world\n")
    r = h.wait()
    assert r.stdout.split() == ["hello", "world"]


def test_pty_create_resize_input(sandbox):
    data = bytearray()
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=30)
    sandbox.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sandbox.pty.send_stdin(h.pid, b"stty size; tty; exit\n")
    r = h.wait(on_pty=lambda b: data.extend(b))
    text = data.decode(errors="replace")
    assert "40 120" in text
    assert "/dev/pts/" in text
    assert r.exit_code == 0


def test_background_command_ends_at_the_sdks_timeout(sandbox):
    """README: ``commands.run(..., background=True)`` ends after the SDK's default command
    ``timeout`` (60 s) — ``timeout=0`` for a long-lived process. The SDK sends the timeout
    as the Connect deadline of the Start stream; through the proxy, envd kills the process
    at that deadline even with no client connected (2 s here instead of waiting 60)."""
    import inspect

    assert inspect.signature(sandbox.commands.run).parameters["timeout"].default == 60  # the SDK's default
    t0 = time.time()
    short = sandbox.commands.run("sleep 300", background=True, timeout=2)
    forever = sandbox.commands.run("sleep 300", background=True, timeout=0)
    default = sandbox.commands.run("sleep 300", background=True)
    short.disconnect()
    forever.disconnect()
    default.disconnect()
    try:
        deadline = t0 + 30
        while short.pid in (pids := [p.pid for p in sandbox.commands.list()]) and time.time() < deadline:
            time.sleep(0.1)
        assert short.pid not in pids, "the command outlived its 2 s timeout"
        assert time.time() - t0 >= 1.9  # ended by its deadline, not at once
        assert forever.pid in pids and default.pid in pids  # timeout=0: unlimited; default: 60 s, not yet
    finally:
        for h in (short, forever, default):
            sandbox.commands.kill(h.pid)
