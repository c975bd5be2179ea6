"""Filesystem-only pause and snapshot (E2B ``memory: false``; SDK ``keep_memory=False`` /
``mode="filesystem"``), through the real e2b SDK: the sandbox's writable layer is saved
(``runsc tar rootfs-upper``) as a repository image, and the next connect cold-boots the
template over it — same id, token, env vars and metadata, a new boot id, files kept
(deletions too), processes gone."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from e2b import InvalidArgumentException, Sandbox

from conftest import CLEAN, SERVER_DIR

BOOT_ID = "cat /proc/sys/kernel/random/boot_id"
MANIFESTS = SERVER_DIR / "snapshots" / "repository" / "manifests"


def _image_id(server, sid: str) -> str | None:
    import sqlite3

    db = sqlite3.connect(str(SERVER_DIR / "state.db"))
    try:
        row = db.execute("SELECT image_id FROM sandboxes WHERE id = ?", (sid,)).fetchone()
    finally:
        db.close()
    return row[0] if row else None


def _wait_paused(server, sid: str, timeout_s: float) -> None:
    """Wait until the node's own record of ``sid`` says ``paused`` (its image exported,
    not only the pause begun: the API shows a pausing sandbox as paused, as E2B does)
    and the image's commit is done; the API says paused too."""
    import sqlite3

    def recorded() -> str | None:
        db = sqlite3.connect(str(SERVER_DIR / "state.db"))
        try:
            row = db.execute("SELECT state FROM sandboxes WHERE id = ?", (sid,)).fetchone()
        finally:
            db.close()
        return row[0] if row else None

    deadline = time.time() + timeout_s
    while recorded() != "paused" and time.time() < deadline:
        time.sleep(0.25)
    assert recorded() == "paused"
    assert _state(server, sid) == "paused"
    server.settle()


def _manifest(image_id: str) -> dict:
    return json.loads((MANIFESTS / f"{image_id}.json").read_text())


def _state(server, sid: str) -> str | None:
    with server.api() as c:
        r = c.get(f"/sandboxes/{sid}")
        return r.json()["state"] if r.status_code == 200 else None


def _pids(sbx: Sandbox) -> list[int]:
    return [p.pid for p in sbx.commands.list()]


def _prepare(sbx: Sandbox) -> tuple[int, str]:
    """Files written, a template file deleted, a template directory replaced, a
    background process started; returns (its pid, boot id)."""
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.commands.run("rm /etc/issue && rm -rf /usr/share/doc/apt && mkdir /usr/share/doc/apt"
                     " && echo m > /usr/share/doc/apt/marker", user="root")
    h = sbx.commands.run("sleep 1000", background=True)
    return h.pid, sbx.commands.run(BOOT_ID).stdout.strip()


def _check_cold_booted(same: Sandbox, pid: int, boot_id: str) -> None:
    assert same.files.read("/home/user/kept.txt") == "kept"
    assert not same.files.exists("/etc/issue")  # deleted stays deleted (whiteout)
    assert same.commands.run("ls /usr/share/doc/apt").stdout.split() == ["marker"]  # opaque dir
    assert pid not in _pids(same)  # processes do not survive
    assert same.commands.run(BOOT_ID).stdout.strip() != boot_id  # a new boot


def test_fs_pause_then_connect_cold_boots_over_the_files(server):
    sbx = Sandbox.create("base", timeout=300, envs={"FY_VAR": "v1"}, metadata={"who": "fs"})
    sid = sbx.sandbox_id
    try:
        pid, boot_id = _prepare(sbx)
        assert sbx.pause(keep_memory=False) is True
        assert _state(server, sid) == "paused"
        server.settle()
        meta = _manifest(_image_id(server, sid))["meta"]
        assert meta["kind"] == "pause" and meta["memory"] is False
        with server.api() as c:
            hot = c.get("/metrics/node").json()["hotPaused"]
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 300, "memory": False})
            assert r.status_code == 201, r.text
            timing = r.headers.get("server-timing", "")
            assert "boot;" in timing and "restore;" not in timing and "thaw;" not in timing, timing
            assert r.json()["envdAccessToken"] == sbx._envd_access_token  # same token
            assert c.get("/metrics/node").json()["hotPaused"] == hot  # nothing was kept frozen
        with server.api() as c:
            prom = c.get("/metrics").text
        assert re.search(r"^forkyard_fs_image_bytes_count [1-9]", prom, re.M), "fs image size not observed"
        same = Sandbox.connect(sid)
        _check_cold_booted(same, pid, boot_id)
        assert same.commands.run("echo $FY_VAR").stdout.strip() == "v1"
        assert same.get_info().metadata == {"who": "fs"}
        bad = httpx.get(f"{server.url}/envs", headers={"E2b-Sandbox-Id": sid, "X-Access-Token": "wrong"})
        assert bad.status_code == 401  # still secured by the same token
        # Written after the cold boot: a second fs-only pause keeps both generations.
        same.files.write("/home/user/second.txt", "2")
        same.pause(mode="filesystem")
        again = Sandbox.connect(sid)
        assert again.files.read("/home/user/kept.txt") == "kept"
        assert again.files.read("/home/user/second.txt") == "2"
        assert not again.files.exists("/etc/issue")
    finally:
        sbx.kill()


def test_keep_memory_none_is_a_full_memory_pause(server):
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        h = sbx.commands.run("sleep 1000", background=True)
        sbx.pause(keep_memory=None)
        server.settle()
        assert _manifest(_image_id(server, sid))["meta"].get("memory", True) is True
        with server.api() as c:  # SDK on_resume="reboot" of a memory pause: refused, stays paused
            r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 300, "memory": False})
            assert r.status_code == 400 and "memory" in r.json()["message"], r.text
        assert _state(server, sid) == "paused"
        same = Sandbox.connect(sid)
        assert h.pid in _pids(same)  # the process survived
    finally:
        sbx.kill()


def test_timeout_auto_pause_honours_keep_memory_false(server):
    with pytest.raises(InvalidArgumentException):  # the SDK's own check
        Sandbox.create("base", timeout=5, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"},
                                                    "auto_resume": True})
    with server.api() as c:  # and ours, for clients that skip it
        r = c.post("/sandboxes", json={"templateID": "base", "autoPause": True, "autoPauseMemory": False,
                                       "autoResume": {"enabled": True}})
        assert r.status_code == 400 and "autoPauseMemory" in r.json()["message"], r.text
    sbx = Sandbox.create("base", timeout=4, envs={"FY_VAR": "auto"},
                         lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    sid = sbx.sandbox_id
    try:
        pid, boot_id = _prepare(sbx)
        _wait_paused(server, sid, 60)
        assert _manifest(_image_id(server, sid))["meta"]["memory"] is False
        same = Sandbox.connect(sid, timeout=300)
        _check_cold_booted(same, pid, boot_id)
        assert same.commands.run("echo $FY_VAR").stdout.strip() == "auto"
    finally:
        sbx.kill()


def test_snapshot_with_memory_false_then_create_from_it(server):
    src = Sandbox.create("base", timeout=300, envs={"FY_VAR": "snap"})
    snap_id = None
    try:
        pid, boot_id = _prepare(src)
        with server.api() as c:
            r = c.post(f"/sandboxes/{src.sandbox_id}/snapshots", json={"memory": False})
            assert r.status_code == 201, r.text
            assert "export;" in r.headers.get("server-timing", "")
            snap_id = r.json()["snapshotID"]
        assert _manifest(snap_id)["meta"]["memory"] is False
        assert pid in _pids(src)  # the source keeps running, its process too
        sdk_snap = src.create_snapshot(mode="filesystem")  # the SDK's body is accepted too
        kid = Sandbox.create(snap_id, timeout=120)
        try:
            _check_cold_booted(kid, pid, boot_id)
            assert kid.commands.run("echo $FY_VAR").stdout.strip() == "snap"
        finally:
            kid.kill()
        with server.api() as c:
            assert c.delete(f"/templates/{sdk_snap.snapshot_id}").status_code == 204
    finally:
        src.kill()
        if snap_id:
            with server.api() as c:
                c.delete(f"/templates/{snap_id}")


def test_template_user_and_workdir_survive_a_cold_boot(server):
    """A template's final USER and WORKDIR (kept in the restored envd's memory on a memory
    resume) are sent to the cold-booted envd of a filesystem-only resume too."""
    import secrets

    from e2b import Template

    name = f"fsroot-{secrets.token_hex(3)}"
    Template.build(Template().from_template("base").run_cmd("true").set_user("root").set_workdir("/opt"), name)
    try:
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.commands.run("whoami; pwd").stdout.split() == ["root", "/opt"]
            sbx.pause(mode="filesystem")
            same = Sandbox.connect(sbx.sandbox_id)
            assert same.commands.run("whoami; pwd").stdout.split() == ["root", "/opt"]
        finally:
            sbx.kill()
    finally:
        with server.api() as c:
            c.delete(f"/templates/{name}")


def test_kill_of_an_fs_paused_sandbox_frees_its_repository_bytes(server):
    from forkyard.repository.config import RepoConfig
    from forkyard.repository.repo import Repository

    sbx = Sandbox.create("base", timeout=300)
    sbx.commands.run("head -c 3000000 /dev/urandom > /home/user/random.bin")
    sbx.pause(mode="filesystem")
    server.settle()
    image_id = _image_id(server, sbx.sandbox_id)
    chunks = {h for f in _manifest(image_id)["files"] for h, _ in f["chunks"]}
    assert chunks
    sbx.kill()
    server.settle()
    assert not (MANIFESTS / f"{image_id}.json").exists()
    repo = Repository(RepoConfig.from_env(SERVER_DIR / "snapshots" / "repository").open_backend())
    try:
        repo.gc(0)
    finally:
        repo.close()
    root = SERVER_DIR / "snapshots" / "repository" / "chunks"
    left = [h for h in chunks if (root / h[:2] / h).exists()]
    # Random data is in no other image: every chunk of it is gone (an all-zero or
    # tar-header chunk may be shared with another live image).
    assert len(left) <= 2, left
    assert server.leftovers() == CLEAN


def test_restart_keeps_an_fs_paused_sandbox_resumable(server):
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        pid, boot_id = _prepare(sbx)
        sbx.pause(keep_memory=False)
        server.settle()
        server.stop()
        server.start()
        assert _state(server, sid) == "paused"
        same = Sandbox.connect(sid)
        _check_cold_booted(same, pid, boot_id)
    finally:
        sbx.kill()


#: (hold point where the server is SIGKILLed during an fs-only pause, state after restart)
CRASHES = [
    ("pause.before-checkpoint", "running"),  # "pausing" persisted, nothing exported yet
    ("pause.checkpointed", "running"),  # exported, sandbox frozen, no reply: it runs on (thawed)
    ("pause.before-commit", "paused"),  # replied, not committed: the restart commits it
]


@pytest.mark.parametrize("phase, after", CRASHES, ids=[c[0] for c in CRASHES])
def test_kill9_mid_fs_pause(server, phase, after):
    import threading

    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    hold = server.hold(phase, sid)
    try:
        pid, boot_id = _prepare(sbx)

        def fire():
            try:
                with server.api() as c:
                    c.post(f"/sandboxes/{sid}/pause", json={"memory": False}, timeout=120)
            except httpx.HTTPError:
                pass  # the server dies under it

        t = threading.Thread(target=fire)
        t.start()
        assert hold.wait() == sid
        server.stop(sig_kill=True)
        t.join(60)
        server.start()
        assert _state(server, sid) == after
        same = Sandbox.connect(sid)
        assert same.files.read("/home/user/kept.txt") == "kept"
        assert not same.files.exists("/etc/issue")
        if after == "running":  # never paused: the same boot, its process alive
            assert pid in _pids(same)
            assert same.commands.run(BOOT_ID).stdout.strip() == boot_id
        else:
            _check_cold_booted(same, pid, boot_id)
        assert not [p for p in (SERVER_DIR / "snapshots").iterdir() if p.name.startswith(".staging")]
    finally:
        hold.disarm()
        server.kill_all()
    server.wait_clean(20)


def _cold_booted_sandbox(server) -> Sandbox:
    """A sandbox that ran, was paused filesystem-only and resumed (cold-booted over its
    files), with ``/home/user/kept.txt`` written before the pause."""
    sbx = Sandbox.create("base", timeout=300)
    sbx.files.write("/home/user/kept.txt", "kept")
    sbx.pause(keep_memory=False)
    return Sandbox.connect(sbx.sandbox_id, timeout=300)


def test_a_cold_booted_sandbox_forks_and_snapshots_with_memory(server):
    """runsc records the boot spec's rootfs-tar annotation in every checkpoint and
    refuses a restore whose annotations differ: a sandbox once cold-booted over an
    fs-only image must still fork and snapshot with memory (its annotation is a
    constant placeholder path, the real tar bind-mounted over it only for the boot)."""
    from forkyard.runtime.gvisor.spec import EMPTY_TAR, ROOTFS_TAR_PLACEHOLDER

    sbx = _cold_booted_sandbox(server)
    children, snap = [], None
    try:
        assert ROOTFS_TAR_PLACEHOLDER.read_bytes() == EMPTY_TAR  # the bind mount stayed private
        h = sbx.commands.run("sleep 1000", background=True)
        results = sbx.fork(count=2, timeout=120)
        children = [r for r in results if not isinstance(r, Exception)]
        assert len(children) == 2, results
        for child in children:
            assert child.files.read("/home/user/kept.txt") == "kept"
            assert h.pid in _pids(child)  # a memory restore: the process is there
        snap = sbx.create_snapshot()
        kid = Sandbox.create(snap.snapshot_id, timeout=120)
        try:
            assert kid.files.read("/home/user/kept.txt") == "kept"
            assert h.pid in _pids(kid)
        finally:
            kid.kill()
    finally:
        for c in children:
            c.kill()
        sbx.kill()
        if snap is not None:
            with server.api() as c:
                c.delete(f"/templates/{snap.snapshot_id}")


def test_a_cold_booted_sandbox_memory_pauses_without_hot_pause_and_across_restart(server):
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="0"):
        sbx = _cold_booted_sandbox(server)
        sid = sbx.sandbox_id
        try:
            h = sbx.commands.run("sleep 1000", background=True)
            sbx.pause()  # with memory, nothing kept frozen: connect restores the checkpoint
            same = Sandbox.connect(sid, timeout=300)
            assert h.pid in _pids(same)
            assert same.files.read("/home/user/kept.txt") == "kept"
            same.pause()
            server.settle()
            server.stop()
            server.start()
            again = Sandbox.connect(sid, timeout=300)
            assert h.pid in _pids(again)
            assert again.files.read("/home/user/kept.txt") == "kept"
        finally:
            sbx.kill()


def test_image_rootfs_tar_reads_the_marker_or_the_checkpoint_header(tmp_path):
    """Images written before the marker: the annotation is read from the JSON metadata
    runsc writes at the head of ``checkpoint.img``; a marker wins, an empty one is none."""
    from forkyard.runtime.gvisor.image import image_rootfs_tar
    from forkyard.runtime.gvisor.spec import ROOTFS_TAR_ANNOTATION, ROOTFS_TAR_MARKER

    assert image_rootfs_tar(tmp_path) is None
    spec = {"__no_name_0": {"ociVersion": "1.0.2", "annotations": {ROOTFS_TAR_ANNOTATION: "/old/x.tar"}}}
    meta = json.dumps({"compression": "none", "container_specs": json.dumps(spec)}).encode()
    (tmp_path / "checkpoint.img").write_bytes(b"gVisorSF" + len(meta).to_bytes(8, "big") + meta + b"\0" * 64)
    assert image_rootfs_tar(tmp_path) == "/old/x.tar"
    (tmp_path / ROOTFS_TAR_MARKER).write_text("/run/forkyard/rootfs-upper.tar\n")
    assert image_rootfs_tar(tmp_path) == "/run/forkyard/rootfs-upper.tar"
    # An empty marker (checkpoints of sandboxes booted without one): none, and the
    # header is not read.
    (tmp_path / ROOTFS_TAR_MARKER).write_text("\n")
    assert image_rootfs_tar(tmp_path) is None


def _refused(server, sid: str, what: str) -> None:
    """A filesystem-only pause and snapshot of ``sid`` are refused (409) and it runs on."""
    with server.api() as c:
        for url, body in ((f"/sandboxes/{sid}/pause", {"memory": False}),
                          (f"/sandboxes/{sid}/snapshots", {"memory": False})):
            r = c.post(url, json=body, timeout=120)
            assert r.status_code == 409, (what, r.text)
            msg = r.json()["message"]
            assert "pause with memory instead" in msg and "MiB" in msg and len(msg) < 400, msg
    assert _state(server, sid) == "running"


@pytest.mark.parametrize("what, cmd", [
    ("a 150 MiB file", "head -c 150M /dev/urandom > /root/big"),  # resumed OOM-killed before the bound
    ("a 1 GiB sparse file", "truncate -s 1G /root/sparse"),  # the export itself was OOM-killed
    ("3 × 50 MiB files", "for i in 1 2 3; do head -c 50M /dev/urandom > /root/part$i; done"),  # the stream bound
], ids=["file", "sparse", "many"])
def test_fs_pause_of_too_many_changed_files_is_refused_and_a_memory_pause_works(server, what, cmd):
    """runsc lays a filesystem-only image back inside the sandbox's memory limit (and a
    sparse file at its full size): one that would not fit is refused before anything is
    lost; the sandbox runs on and a memory pause keeps everything."""
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        h = sbx.commands.run("sleep 1000", background=True)
        sbx.commands.run(cmd, user="root", timeout=120)
        _refused(server, sid, what)
        assert h.pid in _pids(sbx)
        sbx.pause()
        same = Sandbox.connect(sid, timeout=300)
        assert h.pid in _pids(same)
        assert same.commands.run("ls /root", user="root").stdout.split() in (
            ["big"], ["sparse"], ["part1", "part2", "part3"])
    finally:
        sbx.kill()


def test_fs_pause_within_the_bound_resumes(server):
    sbx = Sandbox.create("base", timeout=300)
    try:
        sbx.commands.run("head -c 60M /dev/urandom > /root/f && md5sum /root/f > /root/f.md5", user="root")
        sbx.pause(keep_memory=False)
        same = Sandbox.connect(sbx.sandbox_id, timeout=300)
        assert same.commands.run("md5sum -c /root/f.md5", user="root").exit_code == 0
    finally:
        sbx.kill()


def test_too_large_fs_auto_pause_falls_back_to_a_memory_pause(server):
    sbx = Sandbox.create("base", timeout=6, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}})
    sid = sbx.sandbox_id
    try:
        h = sbx.commands.run("sleep 1000", background=True)
        sbx.commands.run("head -c 150M /dev/urandom > /root/big", user="root", timeout=60)
        _wait_paused(server, sid, 90)
        assert _manifest(_image_id(server, sid))["meta"].get("memory", True) is True
        same = Sandbox.connect(sid, timeout=300)
        assert h.pid in _pids(same)
    finally:
        sbx.kill()
