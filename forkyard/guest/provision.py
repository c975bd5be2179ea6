"""What forkyard adds to an imported or pulled image so that ``sudo`` works in it and
(for E2B template builds) it has E2B's default user.

gVisor ignores set-user-ID bits (:mod:`.sudo`), so the image's own ``/usr/bin/sudo``
cannot raise privileges. For images other than ``base`` (which ships the Python broker
of :mod:`.sudo`) the same protocol is served by envd, a static binary the runtime
bind-mounts into every sandbox at ``/usr/local/bin/envd``, as a multi-call program
(``envd/internal/sudo``):

* ``/usr/bin/sudo`` becomes a link to ``/usr/local/bin/envd`` (the client). An image's
  real sudo is moved to ``/usr/bin/sudo.distrib`` first (and, in a dpkg image, recorded
  as a local ``dpkg-divert`` so a package upgrade does not put it back); the broker runs
  it as root, so the image's sudoers policy applies. Without a real sudo the broker runs
  the command itself (``-u``, ``-E``, ``-H``, ``-i``, ``-s``, ``-n``, ``VAR=value``).
* ``/usr/local/lib/forkyard/sudo-broker`` is a link to envd too: the runtime starts it as
  root next to envd when it is there (:data:`forkyard.runtime.gvisor.spec.BROKER_LAUNCH`).
* group ``sudo`` exists (its members, and root, may use the broker).
* ``user`` (E2B's default user), when the image has it or ``create_user`` asks for it:
  uid 1000 (or the next free one) with group ``user``, home ``/home/user``, shell bash
  when the image has it, no password (as E2B's template build: ``passwd -d``), the
  files of ``/etc/skel`` in its home (as ``useradd -m``), member of
  ``sudo``, and ``user ALL=(ALL:ALL) NOPASSWD: ALL`` appended to ``/etc/sudoers`` when
  the image has sudo (E2B appends the same line).

Everything is written inside the rootfs through :class:`forkyard.beneath.Root` (links in
the image never lead out of it).
"""

from __future__ import annotations

import os
import stat
import time

from forkyard import beneath
from forkyard.guest import sudo

ENVD = "/usr/local/bin/envd"
USER_NAME = "user"
USER_UID = 1000
SUDO_GROUP = "sudo"
SUDO_GID = 27
SUDOERS_LINE = f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL"


def _read(root: beneath.Root, rel: str) -> tuple[str, os.stat_result] | None:
    """Text and stat of regular file ``rel`` (links followed inside the root); None when absent."""
    try:
        # O_NONBLOCK: a FIFO in the image (layers keep them) must not block the import.
        fd = root.open(rel, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(16 << 20).decode("utf-8", "replace"), st
    finally:
        os.close(fd)


def _write(root: beneath.Root, rel: str, text: str, like: os.stat_result | None, mode: int = 0o644) -> None:
    """Replace ``rel`` with ``text``, keeping the owner and mode of ``like``."""
    dfd, name = root.parent(rel, create=True)
    try:
        beneath.Root.write_file(dfd, name, text.encode(), stat.S_IMODE(like.st_mode) if like else mode)
        if like is not None and (like.st_uid, like.st_gid) != (0, 0):
            os.chown(name, like.st_uid, like.st_gid, dir_fd=dfd, follow_symlinks=False)
    finally:
        os.close(dfd)


def _entries(text: str) -> list[list[str]]:
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]


def _id(field: str) -> bool:
    """True when a passwd/group id field is a number ``int`` takes (``"²".isdigit()`` is
    True, and Python refuses ints of over 4300 digits): ASCII digits, at most 10."""
    return field.isascii() and field.isdigit() and len(field) <= 10


def _free_id(used: set[int], start: int) -> int:
    n = start
    while n in used:
        n += 1
    return n


def _link(root: beneath.Root, rel: str, target: str) -> bool:
    """Make ``rel`` a link to ``target`` when nothing is there; True when made."""
    dfd, name = root.parent(rel, create=True)
    try:
        if beneath.Root.lstat(dfd, name) is not None:
            return False
        os.symlink(target, name, dir_fd=dfd)
        return True
    finally:
        os.close(dfd)


def _sudo_binary(root: beneath.Root) -> tuple[bool, list[str]]:
    """Move a real ``/usr/bin/sudo`` aside and link envd in its place. Returns
    ``(the image has a real sudo, what was done)``."""
    done = []
    shim, real = sudo.SHIM_PATH.lstrip("/"), sudo.REAL_SUDO.lstrip("/")
    dfd, name = root.parent(shim, create=True)
    try:
        st = beneath.Root.lstat(dfd, name)
        have_real = beneath.Root.lstat(dfd, os.path.basename(real)) is not None
        if st is not None and stat.S_ISREG(st.st_mode) and not have_real:
            os.rename(name, os.path.basename(real), src_dir_fd=dfd, dst_dir_fd=dfd)
            have_real = True
            done.append(f"moved the image's sudo to {sudo.REAL_SUDO} (the sudo broker runs it as root)")
            diversions = _read(root, "var/lib/dpkg/diversions")
            if diversions is not None and f"{sudo.SHIM_PATH}\n" not in diversions[0]:
                _write(root, "var/lib/dpkg/diversions",
                       diversions[0] + f"{sudo.SHIM_PATH}\n{sudo.REAL_SUDO}\n:\n", diversions[1])
    finally:
        os.close(dfd)
    if _link(root, shim, ENVD):
        done.append(f"{sudo.SHIM_PATH} -> {ENVD} (gVisor ignores setuid: sudo goes through a root broker)")
    _link(root, sudo.BROKER_PATH.lstrip("/"), ENVD)
    return have_real, done


def _skel(root: beneath.Root, uid: int, gid: int) -> None:
    """Copy the regular files at the top of ``/etc/skel`` (``.bashrc``, ``.profile``…)
    into the new user's home, as ``useradd -m`` does; what is there already stays."""
    try:
        skel = root.dir_fd("etc/skel")
    except (FileNotFoundError, NotADirectoryError):
        return
    home = root.dir_fd(f"home/{USER_NAME}")
    try:
        for name in beneath.Root.children(skel, "."):
            st = beneath.Root.lstat(skel, name)
            if st is None or not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
                continue
            if beneath.Root.lstat(home, name) is not None:
                continue
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=skel)
            with os.fdopen(fd, "rb") as f:
                data = f.read(1 << 20)
            beneath.Root.write_file(home, name, data, stat.S_IMODE(st.st_mode) & 0o777)
            os.chown(name, uid, gid, dir_fd=home, follow_symlinks=False)
    finally:
        os.close(skel)
        os.close(home)


def prepare(root: beneath.Root, create_user: bool) -> list[str]:
    """Give the image at ``root`` working ``sudo`` and, with ``create_user`` (E2B template
    builds from an image), E2B's default user ``user`` (see the module docstring). An
    image's existing ``user`` is made a sudoer either way. Idempotent.

    Returns:
        One line per change made (for the build log).

    Raises:
        OSError / beneath.EscapeError: a path the image makes unusable (a link in it
            that resolves to nothing inside it).
    """
    have_real, done = _sudo_binary(root)
    group = _read(root, "etc/group") or ("", None)
    passwd = _read(root, "etc/passwd") or ("", None)
    groups, users = _entries(group[0]), _entries(passwd[0])
    gids = {int(g[2]) for g in groups if len(g) > 2 and _id(g[2])}
    uids = {int(u[2]) for u in users if len(u) > 2 and _id(u[2])}
    group_text = group[0] if not group[0] or group[0].endswith("\n") else group[0] + "\n"
    if not any(g[0] == SUDO_GROUP for g in groups):
        gid = _free_id(gids, SUDO_GID)
        gids.add(gid)
        group_text += f"{SUDO_GROUP}:x:{gid}:\n"
        done.append(f"added group {SUDO_GROUP} (gid {gid})")
    user = next((u for u in users if u[0] == USER_NAME and len(u) >= 7), None)
    if user is None and create_user:
        uid = _free_id(uids, USER_UID)
        ugroup = next((g for g in groups if g[0] == USER_NAME and len(g) > 2 and _id(g[2])), None)
        if ugroup is not None:
            gid = int(ugroup[2])
        else:
            gid = uid if uid not in gids else _free_id(gids, USER_UID)
            group_text += f"{USER_NAME}:x:{gid}:\n"
        try:
            os.close(root.open("bin/bash", beneath._O_PATH))
            shell = "/bin/bash"
        except OSError:
            shell = "/bin/sh"
        text = passwd[0] if not passwd[0] or passwd[0].endswith("\n") else passwd[0] + "\n"
        _write(root, "etc/passwd", text + f"{USER_NAME}:x:{uid}:{gid}::/home/{USER_NAME}:{shell}\n", passwd[1])
        shadow = _read(root, "etc/shadow")
        if shadow is not None and not any(s[0] == USER_NAME for s in _entries(shadow[0])):
            sh = shadow[0] if not shadow[0] or shadow[0].endswith("\n") else shadow[0] + "\n"
            _write(root, "etc/shadow", sh + f"{USER_NAME}::{int(time.time() // 86400)}:0:99999:7:::\n", shadow[1])
        root.makedirs("home", 0o755)
        root.makedirs(f"home/{USER_NAME}", 0o755)
        fd = root.open(f"home/{USER_NAME}", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, uid, gid)
        finally:
            os.close(fd)
        _skel(root, uid, gid)
        user = [USER_NAME, "x", str(uid), str(gid)]
        done.append(f"created user {USER_NAME} (uid {uid}, gid {gid}, home /home/{USER_NAME}, {shell})")
    if user is not None:
        lines = []
        for line in group_text.splitlines():
            f = line.split(":")
            if f[0] == SUDO_GROUP and len(f) == 3:
                f.append("")
            if f[0] == SUDO_GROUP and len(f) >= 4 and USER_NAME not in f[3].split(","):
                f[3] = ",".join([m for m in f[3].split(",") if m] + [USER_NAME])
                line = ":".join(f)
                done.append(f"{USER_NAME} may use sudo (group {SUDO_GROUP})")
            lines.append(line)
        group_text = "\n".join(lines) + "\n"
        sudoers = _read(root, "etc/sudoers") if have_real else None
        if sudoers is not None and SUDOERS_LINE not in sudoers[0].splitlines():
            text = sudoers[0] if not sudoers[0] or sudoers[0].endswith("\n") else sudoers[0] + "\n"
            _write(root, "etc/sudoers", text + SUDOERS_LINE + "\n", sudoers[1], 0o440)
            done.append(f"/etc/sudoers: {SUDOERS_LINE}")
    if group_text != group[0]:
        _write(root, "etc/group", group_text, group[1])
    return done
