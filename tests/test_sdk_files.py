"""Filesystem calls and large transfers through the official e2b SDK."""

from __future__ import annotations

import hashlib
import os
import time

import pytest
from e2b import FileType, NotFoundException


def test_write_read_list_exists_info(sandbox):
    sandbox.files.write("/home/user/a.txt", "hello")
    assert sandbox.files.read("/home/user/a.txt") == "hello"
    assert sandbox.files.exists("/home/user/a.txt")
    assert not sandbox.files.exists("/home/user/nope")
    info = sandbox.files.get_info("/home/user/a.txt")
    assert info.size == 5 and info.type == FileType.FILE and info.name == "a.txt"
    names = {e.name for e in sandbox.files.list("/home/user")}
    assert "a.txt" in names
    # Written as the default user.
    assert sandbox.commands.run("stat -c %U /home/user/a.txt").stdout.strip() == "user"


def test_make_dir_rename_remove(sandbox):
    assert sandbox.files.make_dir("/home/user/d/e") is True
    assert sandbox.files.make_dir("/home/user/d/e") is False
    sandbox.files.write("/home/user/d/e/f", b"\x00\x01")
    sandbox.files.rename("/home/user/d/e/f", "/home/user/d/g")
    assert sandbox.files.read("/home/user/d/g", format="bytes") == b"\x00\x01"
    sandbox.files.remove("/home/user/d")
    assert not sandbox.files.exists("/home/user/d")
    with pytest.raises(NotFoundException):
        sandbox.files.read("/home/user/d/g")


def test_watch_dir(sandbox):
    """The event sequence of E2B's envd, which the SDKs' own tests pin (issue 23 item 2):
    writing a new file gives CREATE, CHMOD (envd sets its owner), WRITE; writing an
    existing one starts with WRITE (the truncate); the recursive case names the path
    below the watched directory."""
    from e2b import FilesystemEventType as T

    def events_until(handle, name, n):
        got, deadline = [], time.time() + 10
        while time.time() < deadline and len([e for e in got if e.name == name]) < n:
            got += handle.get_new_events()
            time.sleep(0.2)
        return [e.type for e in got if e.name == name]

    sandbox.files.make_dir("/home/user/w")
    handle = sandbox.files.watch_dir("/home/user/w")
    try:
        sandbox.files.write("/home/user/w/new.txt", "x")
        assert events_until(handle, "new.txt", 3) == [T.CREATE, T.CHMOD, T.WRITE]
        sandbox.files.write("/home/user/w/new.txt", "again")
        assert events_until(handle, "new.txt", 3)[0] == T.WRITE
    finally:
        handle.stop()
    sandbox.files.make_dir("/home/user/r/sub")
    handle = sandbox.files.watch_dir("/home/user/r", recursive=True)
    try:
        sandbox.files.write("/home/user/r/sub/deep.txt", "x")
        assert events_until(handle, "sub/deep.txt", 3) == [T.CREATE, T.CHMOD, T.WRITE]
    finally:
        handle.stop()


def test_upload_download_50mb(sandbox):
    data = os.urandom(50 * 1024 * 1024)
    sandbox.files.write("/home/user/big.bin", data)
    r = sandbox.commands.run("sha256sum /home/user/big.bin")
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest()
    back = sandbox.files.read("/home/user/big.bin", format="bytes")
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()


def test_file_owner_follows_user(sandbox):
    # As in E2B's envd, file operations run as root; the user decides ownership.
    sandbox.files.write("/tmp/by-root", "r", user="root")
    sandbox.files.write("/tmp/by-user", "u")
    out = sandbox.commands.run("stat -c %U /tmp/by-root /tmp/by-user").stdout.split()
    assert out == ["root", "user"]
