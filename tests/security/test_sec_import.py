"""Issue 25, item 2: an imported image cannot write, chmod or delete host files.

Each image here is an attack on a directory of host files made for the test (the
"victim"); after every import the victim is exactly as it was. The server applies
layers as root, so before the fix each of these landed on the host."""

from __future__ import annotations

import io
import json
import os
import secrets
import shutil
import stat
import subprocess
import tarfile
import time

import pytest

from conftest import TEST_ROOT


def _layer(entries: list[tuple]) -> bytes:
    """A layer tar: (path, kind, payload, mode) with kind file/dir/sym/link."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for path, kind, payload, mode in entries:
            ti = tarfile.TarInfo(path)
            ti.mode, ti.mtime = mode, int(time.time())
            data = None
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
            elif kind == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, payload
            elif kind == "link":
                ti.type, ti.linkname = tarfile.LNKTYPE, payload
            else:
                ti.size, data = len(payload), io.BytesIO(payload)
            tf.addfile(ti, data)
    return buf.getvalue()


def _image(layers: list[bytes]) -> bytes:
    """A ``docker save`` tarball of ``layers``."""
    buf = io.BytesIO()
    members = {"cfg.json": json.dumps({"architecture": "amd64", "os": "linux", "config": {}}).encode()}
    for i, layer in enumerate(layers):
        members[f"l{i}/layer.tar"] = layer
    members["manifest.json"] = json.dumps([{"Config": "cfg.json", "Layers": [f"l{i}/layer.tar"
                                                                            for i in range(len(layers))]}]).encode()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, data in members.items():
            ti = tarfile.TarInfo(path)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _snapshot(root) -> dict:
    """Every entry under ``root`` with its type, mode and content (symlinks not followed)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            content = open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), content)
    return out


@pytest.fixture
def victim():
    d = TEST_ROOT / f"victim-{os.getpid()}-{secrets.token_hex(3)}"
    shutil.rmtree(d, ignore_errors=True)
    (d / "etc").mkdir(parents=True)
    (d / "keep.txt").write_text("host file\n")
    (d / "delete-me").write_text("must survive\n")
    (d / "etc" / "resolv.conf").write_text("nameserver 192.0.2.1\n")
    os.chmod(d / "keep.txt", 0o644)
    before = _snapshot(d)
    yield d, before
    # An import that escaped may have bind-mounted the victim: undo before deleting it.
    while subprocess.run(["umount", "-l", str(d)], capture_output=True).returncode == 0:
        pass
    shutil.rmtree(d, ignore_errors=True)


def _import(server, image: bytes) -> tuple[str, object]:
    name = "sec-" + secrets.token_hex(4)
    with server.api() as c:
        return name, c.post("/templates/import", params={"name": name}, content=image, timeout=120)


def _delete(server, name: str) -> None:
    with server.api() as c:
        c.delete(f"/templates/{name}")


def _rootfs(server, name):
    return server.templates_dir / name / "rootfs"


def test_dotdot_member_cannot_turn_the_rootfs_into_a_host_link(server, victim):
    """A member ``..`` that is a symlink made the rootfs itself a link to a host path;
    later members (a setuid file, a whiteout) then landed on / deleted host files."""
    d, before = victim
    for dotdot in ("..", "./..", "a/../.."):
        image = _image([_layer([(dotdot, "sym", str(d), 0o777), ("planted", "file", b"#!/bin/sh\n", 0o4755),
                                (".wh.delete-me", "file", b"", 0o644)])])
        name, r = _import(server, image)
        try:
            assert _snapshot(d) == before, (dotdot, r.status_code, r.text)
            assert r.status_code == 400 and "outside" in r.text, (dotdot, r.status_code, r.text)
        finally:
            _delete(server, name)


def test_directory_then_symlink_of_the_same_name_cannot_chmod_a_host_file(server, victim):
    """A directory with mode 06777 followed by a symlink of the same name: the final
    mode pass followed the link and made a host file ``-rwsrwsrwx``."""
    d, before = victim
    image = _image([_layer([("d", "dir", None, 0o6777), ("d", "sym", str(d / "keep.txt"), 0o777),
                            ("e", "dir", None, 0o6777), ("e", "sym", "../../../../../.." + str(d), 0o777)])])
    name, r = _import(server, image)
    try:
        assert _snapshot(d) == before, r.text
        assert r.status_code == 201, r.text
        root = _rootfs(server, name)
        assert os.readlink(root / "d") == str(d / "keep.txt")  # the image's link, kept as a link
    finally:
        _delete(server, name)


def test_post_import_fixups_stay_inside_the_rootfs(server, victim):
    """Dangling absolute symlinks ``etc/passwd``/``etc/group``/``etc/hosts`` made the
    fix-ups write host files; ``etc`` as a link out would have had resolv.conf
    rewritten on the host."""
    d, before = victim
    layers = [_layer([("etc", "dir", None, 0o755), ("etc/passwd", "sym", str(d / "passwd"), 0o777),
                      ("etc/group", "sym", str(d / "group"), 0o777),
                      ("etc/hostname", "sym", str(d / "hostname"), 0o777)])]
    name, r = _import(server, _image(layers))
    try:
        assert _snapshot(d) == before, r.text
        assert r.status_code == 201, r.text
        root = _rootfs(server, name)
        # The image's own /etc/passwd is usable inside it: root is there.
        assert (root / "etc" / "passwd").read_text().startswith("root:")
    finally:
        _delete(server, name)
    # /etc itself a link to a host directory (absolute and relative spellings).
    for target in (str(d / "etc"), "../../../../../../../.." + str(d / "etc")):
        name, r = _import(server, _image([_layer([("etc", "sym", target, 0o777), ("bin", "dir", None, 0o755)])]))
        try:
            assert _snapshot(d) == before, (target, r.status_code, r.text)
            # inside the image that link leads nowhere: a clear 400, not a host path
            assert r.status_code == 400 and "does not resolve" in r.text, (target, r.status_code, r.text)
        finally:
            _delete(server, name)


def test_hardlinks_and_whiteouts_cannot_reach_host_files(server, victim):
    d, before = victim
    layers = [
        _layer([("out", "sym", str(d), 0o777), ("up", "sym", "../../../../../../../.." + str(d), 0o777)]),
        _layer([("h1", "link", str(d / "keep.txt"), 0o644), ("h2", "link", "out/keep.txt", 0o644),
                ("h3", "link", "up/keep.txt", 0o644), ("out/.wh.delete-me", "file", b"", 0o644),
                ("up/.wh.delete-me", "file", b"", 0o644), ("out/.wh..wh..opq", "file", b"", 0o644),
                ("up/planted", "file", b"x", 0o644)]),
    ]
    name, r = _import(server, _image(layers))
    try:
        assert _snapshot(d) == before, (r.status_code, r.text)
        # no inode of the victim is linked into the rootfs
        inode = os.lstat(d / "keep.txt").st_ino
        root = _rootfs(server, name)
        if root.is_dir():
            for dirpath, dirnames, filenames in os.walk(root):
                for f in filenames:
                    assert os.lstat(os.path.join(dirpath, f)).st_ino != inode
    finally:
        _delete(server, name)


def test_setuid_files_in_a_template_are_inert_on_the_host(server):
    """The template's read-only bind mount is nosuid,nodev: a setuid-root program in an
    image is no privilege escalation for a local user who can reach the directory."""
    image = _image([_layer([("bin", "dir", None, 0o755), ("bin/suid", "file", b"\x7fELF", 0o4755)])])
    name, r = _import(server, image)
    try:
        assert r.status_code == 201, r.text
        root = os.path.realpath(_rootfs(server, name))
        opts = None
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if fields[4] == root:
                    opts = fields[5].split(",")
        assert opts is not None, "the template rootfs is not a mount point"
        assert {"ro", "nosuid", "nodev"} <= set(opts), opts
    finally:
        _delete(server, name)
