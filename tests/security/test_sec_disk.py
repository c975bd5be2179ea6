"""Issue 11 item 2: each sandbox has a disk of its own size (``diskSizeMB`` in its info):
writes beyond it fail with ENOSPC inside the sandbox, the host loses at most that much,
``diskUsed`` in metrics is real, and pause/resume and fork keep the files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from e2b import Sandbox

DISK_MB = 96


@pytest.fixture
def small_disks(server):
    server.kill_all()
    server.stop()
    os.environ["FORKYARD_DISK_MB"] = str(DISK_MB)
    try:
        server.start()
        yield server
    finally:
        os.environ.pop("FORKYARD_DISK_MB", None)
        server.kill_all()
        server.stop()
        server.start()


def _image_bytes(server, sid: str) -> int:
    img = Path(server.data_dir, "sandboxes", sid, "disk.img")
    return img.stat().st_blocks * 512


def test_writes_beyond_the_disk_are_enospc_and_the_host_is_unharmed(small_disks):
    srv = small_disks
    sbx = Sandbox.create("base", timeout=120)
    sid = sbx.sandbox_id
    with srv.api() as c:
        assert c.get(f"/sandboxes/{sid}").json()["diskSizeMB"] == DISK_MB
    r = sbx.commands.run("dd if=/dev/urandom of=/home/user/big bs=1M count=400 2>&1; echo alive",
                         user="user", timeout=120)
    assert "No space left on device" in r.stdout, r.stdout
    assert r.stdout.strip().endswith("alive")
    assert _image_bytes(srv, sid) <= (DISK_MB + 8) << 20  # the host lost at most the disk
    with srv.api() as c:
        m = c.get(f"/sandboxes/{sid}/metrics").json()[0]
    assert m["diskTotal"] <= DISK_MB << 20 and m["diskUsed"] >= 50 << 20, m
    # Room again once the file is gone; files survive pause/resume and fork.
    sbx.commands.run("rm /home/user/big && head -c 5M /dev/urandom > /home/user/keep && md5sum /home/user/keep "
                     "> /home/user/keep.md5", user="user")
    sbx.pause()
    sbx = Sandbox.connect(sid)
    assert sbx.commands.run("md5sum -c /home/user/keep.md5", user="user").exit_code == 0
    kid = sbx.fork(count=1, timeout=60)[0] if hasattr(sbx, "fork") else None
    if kid is not None:
        assert kid.commands.run("md5sum -c /home/user/keep.md5", user="user").exit_code == 0
        kid.kill()
    sbx.kill()
    assert not Path(srv.data_dir, "sandboxes", sid).exists()
