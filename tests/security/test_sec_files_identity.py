"""Issue 11 item 8: the files API acts with exactly the permissions of the user it
names (E2B's envd semantics), through the real SDK: HTTP /files and the Connect
filesystem service alike. Root stays possible by asking for root."""

from __future__ import annotations

import pytest
from e2b import Sandbox
from e2b.exceptions import SandboxException


def test_files_api_as_user_has_only_user_permissions(sandbox: Sandbox):
    # A root-only file in a sticky world-writable dir, and root's 0700 home.
    sandbox.commands.run("echo secret > /tmp/rootfile && chmod 600 /tmp/rootfile && chmod 700 /root",
                         user="root")
    for attempt in (
        lambda: sandbox.files.read("/etc/shadow", user="user"),
        lambda: sandbox.files.read("/tmp/rootfile", user="user"),
        lambda: sandbox.files.write("/root/planted.txt", "x", user="user"),
        lambda: sandbox.files.write("/etc/cron.d/evil", "x", user="user"),
        lambda: sandbox.files.list("/root", user="user"),
        lambda: sandbox.files.make_dir("/root/newdir", user="user"),
        lambda: sandbox.files.remove("/tmp/rootfile", user="user"),
        lambda: sandbox.files.rename("/tmp/rootfile", "/home/user/stolen", user="user"),
        lambda: sandbox.files.get_info("/root/.bashrc", user="user"),
    ):
        with pytest.raises(SandboxException):
            attempt()
    check = sandbox.commands.run("ls /root; cat /tmp/rootfile; ls /etc/cron.d", user="root").stdout
    assert "planted" not in check and "newdir" not in check and "secret" in check and "evil" not in check
    # What the user may do still works, and its files are its own.
    sandbox.files.write("/home/user/sub/dir/mine.txt", "mine", user="user")
    assert sandbox.files.read("/home/user/sub/dir/mine.txt", user="user") == "mine"
    owner = sandbox.commands.run("stat -c %U:%G /home/user/sub/dir/mine.txt /home/user/sub", user="root").stdout
    assert owner.split() == ["user:user", "user:user"]
    sandbox.files.rename("/home/user/sub/dir/mine.txt", "/home/user/moved.txt", user="user")
    sandbox.files.remove("/home/user/sub", user="user")
    assert [e.name for e in sandbox.files.list("/home/user", user="user") if e.name == "moved.txt"] == ["moved.txt"]
    # Root, when asked for, keeps root's permissions.
    assert "root:" in sandbox.files.read("/etc/shadow", user="root")
    sandbox.files.write("/root/ok.txt", "r", user="root")
    assert sandbox.files.read("/root/ok.txt", user="root") == "r"
