"""E2B volumes through the official e2b SDK (issue 23 item 5): the ``Volume`` API, mounts
into real sandboxes (shared by several, kept across kill, pause/resume and fork), and the
errors a client gets for bad input."""

from __future__ import annotations

import io
import os

import httpx
import pytest
from e2b import Sandbox, Volume


@pytest.fixture
def volume(server):
    vol = Volume.create("vol-" + __import__("secrets").token_hex(4))
    yield vol
    with server.api() as c:  # whatever the test left mounting it
        for s in c.get("/v2/sandboxes").json():
            c.delete(f"/sandboxes/{s['sandboxID']}")
    Volume.destroy(vol.volume_id)


def test_volume_api(server, volume):
    info = Volume.get_info(volume.volume_id)
    assert (info.volume_id, info.name, info.token) == (volume.volume_id, volume.name, volume.token)
    assert volume.volume_id in {v.volume_id for v in Volume.list()}
    with server.api() as c:
        assert c.post("/volumes", json={"name": volume.name}).status_code == 409
        r = c.post("/volumes", json={"name": "../x"})
        assert r.status_code == 400 and "invalid volume name" in r.json()["message"]
        assert c.get("/volumes/nope").status_code == 404
    assert Volume.destroy("nope") is False
    assert httpx.get(f"{server.url}/volumes").status_code == 401


def test_mount_share_kill_pause_fork(server, volume):
    a = Sandbox.create("base", timeout=120, volume_mounts={"/mnt": volume})
    b = Sandbox.create("base", timeout=120, volume_mounts={"/srv": volume.name})
    # Real work in one, read from the other: build and run a program that writes there.
    a.files.write("/home/user/gen.py", "import sys\nopen(sys.argv[1] + '/out.txt', 'w').write(str(sum(range(10**6))))\n")
    r = a.commands.run("python3 /home/user/gen.py /mnt && mkdir -p /mnt/d && echo hi > /mnt/d/f")
    assert r.exit_code == 0
    assert b.commands.run("cat /srv/out.txt").stdout == str(sum(range(10**6)))
    assert b.commands.run("stat -c %U /srv/out.txt").stdout.strip() == "user"
    # A link inside the sandbox resolves inside the sandbox, never on the host.
    b.commands.run("ln -s / /srv/root && ln -s ../../../../../etc /srv/up")
    listed = b.commands.run("ls /srv/root/").stdout.split()
    assert "home" in listed and "work" not in listed  # the sandbox's /, not the host's (/work)
    assert b.commands.run("cat /srv/up/hostname").stdout == a.commands.run("cat /etc/hostname").stdout
    # Pause/resume keeps the mount and what was written while paused elsewhere shows.
    assert a.pause() is True
    b.commands.run("echo while-paused > /srv/p.txt")
    a = Sandbox.connect(a.sandbox_id)
    assert a.commands.run("cat /mnt/p.txt").stdout.strip() == "while-paused"
    a.commands.run("echo after-resume > /mnt/r.txt")
    # A fork child mounts the same volume (as on E2B): its writes reach the others.
    (child,) = a.fork(count=1, timeout=60)
    assert child.commands.run("cat /mnt/r.txt").stdout.strip() == "after-resume"
    child.commands.run("echo from-child > /mnt/c.txt")
    assert b.commands.run("cat /srv/c.txt").stdout.strip() == "from-child"
    with server.api() as c:  # mounted: not destroyed, not snapshotted
        assert c.delete(f"/volumes/{volume.volume_id}").status_code == 409
        assert c.post(f"/sandboxes/{a.sandbox_id}/snapshots", json={}).status_code == 409
    for s in (a, b, child):
        s.kill()
    # The volume outlives its sandboxes.
    c = Sandbox.create("base", timeout=60, volume_mounts={"/opt": volume})
    try:
        assert sorted(e.name for e in c.files.list("/opt")) == sorted(["out.txt", "d", "root", "up", "p.txt", "r.txt", "c.txt", "lost+found"])
    finally:
        c.kill()


def test_bad_mounts(server, volume):
    with server.api() as c:
        for mounts, word in (([{"name": "nope", "path": "/mnt"}], "not found"),
                            ([{"name": volume.name, "path": "rel"}], "absolute"),
                            ([{"name": volume.name, "path": "/a/../etc"}], "normalized"),
                            ([{"name": volume.name, "path": "/proc/x"}], "/proc"),
                            ([{"name": volume.name, "path": "/mnt/missing"}], "directory of the template"),
                            ([{"name": volume.name, "path": "/mnt"}, {"name": volume.name, "path": "/mnt/"}], "twice")):
            r = c.post("/sandboxes", json={"templateID": "base", "volumeMounts": mounts})
            assert r.status_code == 400 and word in r.json()["message"], (mounts, r.text)


def test_content_api_round_trip_and_confinement(server, volume, monkeypatch):
    from e2b import VolumePathNotFoundException
    from e2b.exceptions import AuthenticationException, VolumeException

    monkeypatch.setenv("E2B_VOLUME_API_URL", server.url)  # the content API is on the node
    assert volume.make_dir("/a/b", force=True).type.value == "directory"
    entry = volume.write_file("/a/b/c.txt", "hello", mode=0o640)
    assert (entry.name, entry.size, entry.mode, entry.uid, entry.path) == ("c.txt", 5, 0o640, 1000, "/a/b/c.txt")
    assert volume.read_file("/a/b/c.txt") == "hello"
    big = os.urandom(3 << 20)
    volume.write_file("/big.bin", io.BytesIO(big))
    assert volume.read_file("/big.bin", format="bytes") == big
    assert [e.path for e in volume.list("/", depth=3)] == ["/a", "/a/b", "/a/b/c.txt", "/big.bin", "/lost+found"]
    assert volume.update_metadata("/a/b/c.txt", mode=0o600).mode == 0o600
    assert volume.get_info("/a").type.value == "directory" and volume.exists("/a/b/c.txt")
    volume.remove("/a")
    assert not volume.exists("/a/b/c.txt")
    with pytest.raises(VolumePathNotFoundException):
        volume.read_file("/nope")
    # Confinement: '..' stops at the volume's root; a link made in a sandbox resolves inside it.
    volume.write_file("/../../../../etc/fy-escape", "x", force=True)
    assert not os.path.exists("/etc/fy-escape") and volume.read_file("/etc/fy-escape") == "x"
    sbx = Sandbox.create("base", timeout=60, volume_mounts={"/mnt": volume})
    try:
        sbx.commands.run("ln -s / /mnt/root && ln -s /etc/passwd /mnt/pw", user="root")
        assert sbx.files.read("/mnt/big.bin", format="bytes") == big
    finally:
        sbx.kill()
    with pytest.raises(VolumePathNotFoundException):  # /etc/passwd of the volume: none
        volume.read_file("/pw")
    assert [e.name for e in volume.list("/root")] == [e.name for e in volume.list("/")]
    with pytest.raises(VolumePathNotFoundException):
        volume.read_file("/root/etc/shadow")
    volume.write_file("/root/etc/hostname", "in-volume", force=True)  # lands in the volume
    assert volume.read_file("/etc/hostname") == "in-volume"
    # Bad input: clear 4xx.
    with pytest.raises(AuthenticationException):
        Volume(volume.volume_id, volume.name, token="wrong").read_file("/big.bin")
    with pytest.raises(VolumeException, match="depth"):
        volume.list("/", depth=99)
    r = httpx.get(f"{server.url}/volumecontent/{volume.volume_id}/file", params={"path": "/big.bin"},
                  headers={"X-API-Key": server.api_key})
    assert r.status_code == 401  # the API key is not the volume's token


def test_volume_size_is_enforced(server, volume, monkeypatch):
    monkeypatch.setenv("E2B_VOLUME_API_URL", server.url)
    sbx = Sandbox.create("base", timeout=60, volume_mounts={"/mnt": volume})
    try:
        r = sbx.commands.run("dd if=/dev/zero of=/mnt/fill bs=1M count=2000 2>&1; df -m /mnt | tail -1",
                             timeout=60)
    except Exception as e:  # dd exits 1 at ENOSPC: the SDK raises with its output
        r = e
    finally:
        sbx.kill()
    assert "No space left" in str(getattr(r, "stdout", r))
    assert volume.get_info("/fill").size < 1100 << 20


def test_volume_survives_restart_and_cold_restore(server, volume, monkeypatch):
    """A restart keeps the volume; a paused sandbox resumed after it is a real runsc
    restore (the restart drops the hot-paused runtime), which gets its bind mount back."""
    from _hostutil import mounts_mentioning

    monkeypatch.setenv("E2B_VOLUME_API_URL", server.url)
    volume.write_file("/kept.txt", "kept")
    sbx = Sandbox.create("base", timeout=120, volume_mounts={"/mnt": volume})
    try:
        sbx.commands.run("echo before-pause > /mnt/p.txt")
        assert sbx.pause() is True
        with server.restarted_with():
            assert Volume.get_info(volume.volume_id).token == volume.token
            assert volume.read_file("/kept.txt") == "kept"
            sbx = Sandbox.connect(sbx.sandbox_id)
            assert sbx.commands.run("cat /mnt/p.txt /mnt/kept.txt").stdout.split() == ["before-pause", "kept"]
            sbx.commands.run("echo after-restore > /mnt/r.txt")
            assert volume.read_file("/r.txt").strip() == "after-restore"
    finally:
        sbx.kill()
    server.stop()  # no sandbox uses it: a stopped node leaves it unmounted
    try:
        assert mounts_mentioning(f"volumes/{volume.volume_id}") == []
    finally:
        server.start()
