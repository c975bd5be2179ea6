"""Issue 11 item 3, issue 18 item 2: ``/tmp`` is a directory of the sandbox's disk, as on
E2B (moves and hard links to ``~`` work; bounded by the disk, never by memory),
``/dev/shm`` a tmpfs sized within the sandbox's memory, and the number of processes a
user runs is capped — filling ``/dev/shm`` or a fork bomb fails inside the sandbox
(ENOSPC / EAGAIN) instead of getting the whole sandbox OOM-killed."""

from __future__ import annotations

from e2b import Sandbox


def test_tmp_is_on_the_disk_and_shm_is_bounded(sandbox: Sandbox):
    # One filesystem with /: the disk's size, and no EXDEV between /tmp and ~ (before:
    # a 128 MiB tmpfs, where mv/ln/git clone --local to ~ failed with EXDEV).
    r = sandbox.commands.run("df -B1 --output=target,size /tmp | tail -1; df -B1 --output=size / | tail -1; "
                             "echo x > /tmp/a && mv /tmp/a ~/a && ln ~/a /tmp/b && stat -c %h ~/a", user="user")
    target, tmp_size, root_size, links = r.stdout.split()
    assert target == "/" and tmp_size == root_size and int(root_size) == 4096 << 20 and links == "2", r.stdout
    size_kb = int(sandbox.commands.run("df -k --output=size /dev/shm | tail -1").stdout)
    assert size_kb <= 512 * 1024 // 4 + 1024, f"/dev/shm is {size_kb} KiB in a 512 MiB sandbox"
    r = sandbox.commands.run("dd if=/dev/zero of=/dev/shm/fill bs=1M count=1024 2>&1; echo alive",
                             user="user", timeout=120)
    assert "No space left on device" in r.stdout and r.stdout.strip().endswith("alive")
    assert sandbox.commands.run("rm /dev/shm/fill /tmp/b ~/a; echo ok").stdout.strip() == "ok"


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
