"""Issue 11 item 3: /tmp (and /dev/shm) are sized within the sandbox's memory, and the
number of processes a user runs is capped — filling /tmp or a fork bomb fails inside
the sandbox (ENOSPC / EAGAIN) instead of getting the whole sandbox OOM-killed."""

from __future__ import annotations

from e2b import Sandbox


def test_filling_tmp_is_enospc_and_the_sandbox_lives(sandbox: Sandbox):
    size_kb = int(sandbox.commands.run("df -k --output=size /tmp | tail -1").stdout)
    assert size_kb <= 512 * 1024 // 4 + 1024, f"/tmp is {size_kb} KiB in a 512 MiB sandbox"
    r = sandbox.commands.run("dd if=/dev/zero of=/tmp/fill bs=1M count=1024 2>&1; "
                             "dd if=/dev/zero of=/dev/shm/fill bs=1M count=1024 2>&1; echo alive",
                             user="user", timeout=120)
    assert "No space left on device" in r.stdout and r.stdout.strip().endswith("alive")
    assert sandbox.commands.run("rm /tmp/fill /dev/shm/fill; echo ok").stdout.strip() == "ok"


def test_fork_bomb_is_capped_and_the_sandbox_lives(sandbox: Sandbox):
    limit = int(sandbox.commands.run("ulimit -u", user="user").stdout)
    assert 0 < limit <= 1024
    # A bounded fork bomb (well past the cap): without the cap 1,100 sleeping processes
    # got this 512 MiB sandbox OOM-killed (measured).
    r = sandbox.commands.run(f"for i in $(seq 1 {limit + 200}); do sleep 60 & done 2>&1 | tail -1; "
                             "echo alive", user="user", timeout=120)
    assert "Resource temporarily unavailable" in r.stdout + r.stderr
    assert r.stdout.strip().endswith("alive")
    sandbox.commands.run("pkill -u user sleep || true", user="root")
    assert sandbox.commands.run("echo still here").stdout.strip() == "still here"
