"""What :func:`forkyard.guest.provision.prepare` (run as root on the host, on the rootfs
of every imported or pulled image) does with an image that lies: links at the files it
edits aimed at host files, FIFOs where it reads, numbers Python's ``int`` refuses. The
host's files stay as they were, the import neither hangs nor ends in a traceback.
Real files on this host; prepare is the code under test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from forkyard import beneath
from forkyard.guest import provision


def _tree(base, victim) -> dict:
    out = {}
    for dirpath, dirs, files in os.walk(victim):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            out[p] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns,
                      open(p, "rb").read() if os.path.isfile(p) and not os.path.islink(p) else None)
    return out


def _victim(tmp):
    v = tmp / "victim"
    (v / "etc").mkdir(parents=True)
    for n in ("group", "passwd", "shadow", "sudoers", "diversions"):
        (v / "etc" / n).write_text(f"host {n}\n")
    (v / "bin").mkdir()
    (v / "bin" / "sudo").write_text("host sudo\n")
    (v / "skel").mkdir()
    return v


@pytest.mark.parametrize("links", [
    # absolute links: resolved in the rootfs, never on the host
    {"etc/group": "{v}/etc/group", "etc/passwd": "{v}/etc/passwd", "etc/shadow": "{v}/etc/shadow",
     "etc/sudoers": "{v}/etc/sudoers", "var/lib/dpkg/diversions": "{v}/etc/diversions"},
    {"etc": "{v}/etc", "usr/bin": "{v}/bin", "usr/local/lib/forkyard": "{v}/bin", "home": "{v}", "etc/skel": "{v}/skel"},
    # relative links with more .. than the rootfs is deep
    {"etc": "../../../../../../../../../../../..{v}/etc", "usr": "../../../../../../../../../../..{v}",
     "home": "../../../../../../../../../..{v}"},
])
def test_links_in_the_image_never_reach_the_host(tmp_path, links):
    v = _victim(tmp_path)
    rootfs = tmp_path / "rootfs"
    for d in ("usr/bin", "var/lib/dpkg", "etc", "usr/local/lib", "bin"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "usr/bin/sudo").write_text("#!/bin/sh\n")  # a real sudo: sudoers and diversions are edited
    (rootfs / "bin/bash").write_text("")
    for rel, target in links.items():
        p = rootfs / rel
        if p.is_dir() and not p.is_symlink():
            os.rmdir(p) if not any(p.iterdir()) else subprocess.run(["rm", "-rf", str(p)], check=True)
        elif p.exists() or p.is_symlink():
            p.unlink()
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target.format(v=v), p)
    before = _tree(tmp_path, v)
    with beneath.Root(rootfs) as root:
        try:
            provision.prepare(root, create_user=True)
        except (OSError, beneath.EscapeError):
            pass  # refusing is fine; writing on the host is not
    assert _tree(tmp_path, v) == before


def _prepare_in_child(rootfs, timeout=20) -> subprocess.CompletedProcess:
    code = textwrap.dedent(f"""
        from forkyard import beneath
        from forkyard.guest import provision
        with beneath.Root({str(rootfs)!r}) as root:
            try:
                print(provision.prepare(root, create_user=True))
            except (OSError, beneath.EscapeError) as e:
                print("refused:", e)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("fifo", ["etc/group", "etc/passwd", "etc/shadow", "etc/sudoers", "var/lib/dpkg/diversions"])
def test_a_fifo_where_prepare_reads_does_not_hang_the_import(tmp_path, fifo):
    rootfs = tmp_path / "rootfs"
    for d in ("usr/bin", "var/lib/dpkg", "etc", "bin"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "usr/bin/sudo").write_text("#!/bin/sh\n")
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc/group").write_text("root:x:0:\n")
    (rootfs / "etc/shadow").write_text("root:*:1::::::\n")
    (rootfs / "etc/sudoers").write_text("root ALL=(ALL) ALL\n")
    (rootfs / "var/lib/dpkg/diversions").write_text("")
    (rootfs / fifo).unlink()
    os.mkfifo(rootfs / fifo)  # layers may hold FIFOs (build_oci keeps them)
    try:
        p = _prepare_in_child(rootfs)
    except subprocess.TimeoutExpired:
        pytest.fail(f"prepare blocked on the FIFO at /{fifo} (the import would hang for good)")
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("line", ["weird:x:\u00b2:\n", "weird:x:" + "9" * 5000 + ":\n", "weird:x:\u0663:\n"])
def test_odd_ids_in_the_image_are_not_a_traceback(tmp_path, line):
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "usr/bin").mkdir(parents=True)
    (rootfs / "etc/group").write_text("root:x:0:\n" + line)
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n" + line.replace(":\n", ":0::/:/bin/sh\n"))
    p = _prepare_in_child(rootfs)
    assert p.returncode == 0, p.stderr
