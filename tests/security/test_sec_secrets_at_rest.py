"""Issue 11 item 1: secrets at rest. The data dir (state database with envd tokens and
users' env vars, checkpoint images, staging, cache, logs) is private: 0700 directories,
no file readable by anyone but its owner — for files created later too, and after an
upgrade of an older, world-readable data dir."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from e2b import Sandbox


def _public_entries(root: Path) -> list[str]:
    """Entries below ``root`` (rootfs trees and mounts skipped) that group/others can use."""
    bad = []
    if stat.S_IMODE(root.stat().st_mode) != 0o700:
        bad.append(f"{root} {oct(root.stat().st_mode)}")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != "rootfs" and not os.path.ismount(os.path.join(dirpath, d))
                       and not (d == "etc" and dirpath.endswith("/bundle"))]  # bind-mounted /etc/hosts: 0644 by design
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            try:
                st = p.lstat()
            except FileNotFoundError:  # removed while walking (the server refills its spare disks)
                continue
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                bad.append(f"{p} {oct(stat.S_IMODE(st.st_mode))}")
    return bad


def _nobody_can_read(path: Path) -> bool:
    r = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "cat", str(path)],
                       capture_output=True)
    return r.returncode == 0


def test_data_dir_is_private_also_after_upgrade(server):
    data = server.data_dir
    # The check runs as a real other user, so the dirs above the data dir must let it
    # through (the test root may be 0700, e.g. made private by the base template build).
    parent_mode = stat.S_IMODE(data.parent.stat().st_mode)
    os.chmod(data.parent, parent_mode | 0o011)
    sbx = Sandbox.create("base", timeout=120, envs={"USER_API_KEY": "sk-secret-value"})
    sid = sbx.sandbox_id
    try:
        sbx.pause()  # checkpoint image, staging, repository chunks: all written now
        server.settle()
        assert (data / "state.db").exists()
        assert _public_entries(data) == []
        assert not _nobody_can_read(data / "state.db")

        # An older data dir: world-readable files and directories, a log from before.
        server.stop()
        os.chmod(data, 0o755)
        for p in [data / "state.db", *data.glob("state.db-*")]:
            os.chmod(p, 0o644)
        old = data / "old-notes.log"
        old.write_text("token=abc\n")
        os.chmod(old, 0o644)
        sub = data / "sandboxes"
        if sub.exists():
            os.chmod(sub, 0o755)
        assert _public_entries(data)  # the attack works on the old layout
        assert _nobody_can_read(old)
        server.start()
        assert _public_entries(data) == [], "start must make an existing data dir private"
        assert not _nobody_can_read(data / "state.db") and not _nobody_can_read(old)

        # The sandbox resumes with its secret intact; files made after the restart are private too.
        sbx = Sandbox.connect(sid)
        assert sbx.commands.run("echo $USER_API_KEY").stdout.strip() == "sk-secret-value"
        # Inside, files keep their own modes (the template rootfs is not touched).
        assert sbx.commands.run("cat /etc/hosts /etc/passwd >/dev/null && echo ok", user="user").stdout.strip() == "ok"
        assert _public_entries(data) == []
    finally:
        os.chmod(data.parent, parent_mode)
        if server.proc is None:  # failed while stopped: the rest of the session needs it
            server.start()
        try:
            Sandbox.connect(sid).kill()
        except Exception:
            pass
