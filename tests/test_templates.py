"""Template builds through the official e2b SDK's ``Template`` API, Dockerfiles, image
import (docker save / OCI layout), and bad input — against the real server."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import secrets
import shutil
import subprocess
import tarfile
import time
from pathlib import Path

import pytest
from e2b import Sandbox, Template, wait_for_url
from e2b.exceptions import BuildException


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


def _delete(server, name: str) -> None:
    with server.api() as c:
        c.delete(f"/templates/{name}")


def _build_sandboxes(server) -> list[dict]:
    with server.api() as c:
        return [s for s in c.get("/v2/sandboxes").json() if "forkyard.templateBuild" in (s.get("metadata") or {})]


def test_sdk_build_then_create(server, tmp_path):
    (tmp_path / "hello.txt").write_text("hello from the build context\n")
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.py").write_text("print('main')\n")
    (tmp_path / "app" / "sub").mkdir()
    (tmp_path / "app" / "sub" / "data.txt").write_text("nested\n")
    name = _name("tpl")
    template = (
        Template(file_context_path=tmp_path)
        .from_template("base")
        .set_envs({"GREETING": "hi there", "STAGE": "build"})
        .run_cmd("echo step-output-$STAGE && mkdir -p /home/user/data && echo built > /home/user/data/marker")
        .run_cmd("mkdir -p /opt/tool && chown user:user /opt/tool && whoami > /opt/tool/who", user="root")
        .copy("hello.txt", "/home/user/")
        .copy("app", "/home/user/app")
        .set_workdir("/home/user/app")
        .run_cmd("pwd > cwd.txt && whoami > who.txt")
        .set_start_cmd("python3 -m http.server 8000 --bind 127.0.0.1", wait_for_url("http://127.0.0.1:8000/main.py"))
    )
    logs = []
    try:
        info = Template.build(template, name, on_build_logs=logs.append)
        messages = [e.message for e in logs]
        assert any("step-output-build" in m for m in messages), messages
        assert info.template_id == name
        assert Template.exists(name)
        with server.api() as c:
            assert name in [t["templateID"] for t in c.get("/templates").json()]
            st = c.get(f"/templates/{name}/builds/{info.build_id}/status").json()
            assert st["status"] == "ready"
            # the template's own snapshot is not a user snapshot: not listed, not deletable
            # as one (deleting it used to delete the template)
            assert name not in [n for s in c.get("/snapshots").json() for n in s.get("names", [])]
            manifests = [json.loads(m.read_text())["meta"]
                         for m in (server.data_dir / "snapshots" / "repository" / "manifests").glob("*.json")]
            own = [m["snapshot_id"] for m in manifests
                   if m.get("metadata", {}).get("forkyard.template") == name and name in m.get("names", [])]
            assert len(own) == 1, own
            r = c.delete(f"/templates/{own[0]}")  # E2B's snapshot delete path, by snapshot id
            assert r.status_code == 409 and "template" in r.json()["message"], r.text
            assert Template.exists(name)
        assert _build_sandboxes(server) == []  # the build sandbox is gone

        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.files.read("/home/user/hello.txt") == "hello from the build context\n"
            assert sbx.files.read("/home/user/app/main.py") == "print('main')\n"
            assert sbx.files.read("/home/user/app/sub/data.txt") == "nested\n"
            assert sbx.files.read("/home/user/data/marker").strip() == "built"
            assert sbx.files.read("/home/user/app/cwd.txt").strip() == "/home/user/app"
            assert sbx.files.read("/home/user/app/who.txt").strip() == "user"
            assert sbx.files.read("/opt/tool/who").strip() == "root"
            r = sbx.commands.run("stat -c %U /home/user/hello.txt /home/user/app/main.py /opt/tool")
            assert r.stdout.split() == ["user", "user", "user"]
            assert sbx.commands.run("echo $GREETING").stdout.strip() == "hi there"  # env applied
            assert sbx.commands.run("pwd").stdout.strip() == "/home/user/app"  # workdir applied
            assert sbx.commands.run("whoami").stdout.strip() == "user"
            # the start command's process runs (restored from the snapshot, not restarted)
            assert "http.server" in sbx.commands.run("ps -eo args").stdout
            out = sbx.commands.run("curl -s http://127.0.0.1:8000/main.py").stdout
            assert out == "print('main')\n"
        finally:
            sbx.kill()
    finally:
        _delete(server, name)
    assert not Template.exists(name)


def test_build_failure_is_reported_and_leaves_nothing(server):
    name = _name("bad")
    template = Template().from_template("base").run_cmd("echo fine").run_cmd("echo about-to-fail >&2; exit 3")
    logs = []
    with pytest.raises(BuildException) as err:
        Template.build(template, name, on_build_logs=logs.append)
    assert "exit code 3" in str(err.value)
    assert any("about-to-fail" in e.message for e in logs)
    assert not Template.exists(name)
    with server.api() as c:
        tpl = c.get(f"/templates/{name}").json()
        build = tpl["builds"][-1]
        st = c.get(f"/templates/{name}/builds/{build['buildID']}/status").json()
        assert st["status"] == "error"
        assert st["reason"]["step"] == "2"
        assert "exit code 3" in st["reason"]["message"]
        assert any("about-to-fail" in e["message"] for e in st["logEntries"])
        assert name not in [t["templateID"] for t in c.get("/templates").json()]
        assert c.post("/sandboxes", json={"templateID": name}).status_code == 404
    assert _build_sandboxes(server) == []
    _delete(server, name)


def test_dockerfile_subset(server, tmp_path):
    (tmp_path / "hello.txt").write_text("from dockerfile\n")
    name = _name("dock")
    dockerfile = """
FROM e2bdev/base:latest
ENV FOO=bar BAZ="two words"
WORKDIR /srv/app
COPY hello.txt ./
RUN echo "$FOO" > foo.txt && whoami > who.txt
USER user
RUN echo "$BAZ" > /tmp/baz.txt
"""
    try:
        Template.build(Template(file_context_path=tmp_path).from_dockerfile(dockerfile), name)
        sbx = Sandbox.create(name, timeout=120)
        try:
            assert sbx.files.read("/srv/app/hello.txt") == "from dockerfile\n"
            assert sbx.files.read("/srv/app/foo.txt").strip() == "bar"
            assert sbx.files.read("/srv/app/who.txt").strip() == "root"  # Dockerfile default user
            assert sbx.files.read("/tmp/baz.txt").strip() == "two words"
            assert sbx.commands.run("echo $FOO").stdout.strip() == "bar"
            assert sbx.commands.run("pwd").stdout.strip() == "/srv/app"
            assert sbx.commands.run("whoami").stdout.strip() == "user"
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


def test_final_user_is_the_default(server):
    name = _name("root")
    try:
        Template.build(Template().from_template("base").run_cmd("true").set_user("root").set_workdir("/root"), name)
        sbx = Sandbox.create(name, timeout=60)
        try:
            assert sbx.commands.run("whoami; pwd").stdout.split() == ["root", "/root"]
            assert sbx.commands.run("whoami", user="user", cwd="/home/user").stdout.strip() == "user"
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


# ---------------------------------------------------------------- image import
def _libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = []
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            libs.append(path)
    return libs


def _layer(entries: list[tuple[str, bytes | str | None, int]]) -> bytes:
    """A layer tarball: (path, bytes → file | str → symlink target | None → dir, mode)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, content, mode in entries:
            ti = tarfile.TarInfo(path)
            ti.mode = mode
            ti.mtime = int(time.time())
            if content is None:
                ti.type = tarfile.DIRTYPE
                tf.addfile(ti)
            elif isinstance(content, str):
                ti.type = tarfile.SYMTYPE
                ti.linkname = content
                tf.addfile(ti)
            else:
                ti.size = len(content)
                tf.addfile(ti, io.BytesIO(content))
    return buf.getvalue()


def _tiny_layers() -> list[bytes]:
    """bash + cat with their libraries (from the host, Debian like ``base``), a
    passwd without ``user``; the second layer deletes cat and empties /opt/old."""
    files: dict[str, bytes] = {}
    for binary in ("/bin/bash", "/bin/cat"):
        files[binary] = Path(binary).read_bytes()
        for lib in _libs(binary):
            files[lib] = Path(lib).resolve().read_bytes()
    entries: list = [(d, None, 0o755) for d in ("bin", "etc", "lib", "lib64", "lib/x86_64-linux-gnu", "opt", "opt/old")]
    entries += [(p.lstrip("/"), data, 0o755) for p, data in sorted(files.items())]
    entries += [("bin/sh", "bash", 0o777), ("etc/passwd", b"root:x:0:0:root:/root:/bin/bash\n", 0o644),
                ("opt/old/a", b"lower\n", 0o644)]
    layer1 = _layer(entries)
    layer2 = _layer([("data", None, 0o755), ("data/hello.txt", b"hello from the image\n", 0o644),
                     ("bin/.wh.cat", b"", 0o644), ("opt/old/.wh..wh..opq", b"", 0o644),
                     ("opt/old/b", b"upper\n", 0o644)])
    return [layer1, layer2]


def _docker_save(layers: list[bytes]) -> bytes:
    buf = io.BytesIO()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                         "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    members = {"cfg.json": config}
    paths = []
    for i, layer in enumerate(layers):
        paths.append(f"l{i}/layer.tar")
        members[paths[-1]] = layer
    members["manifest.json"] = json.dumps([{"Config": "cfg.json", "RepoTags": ["tiny:latest"], "Layers": paths}]).encode()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, data in members.items():
            ti = tarfile.TarInfo(path)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def _oci_layout(layers: list[bytes]) -> bytes:
    blobs: dict[str, bytes] = {}

    def blob(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}}).encode()
    gz = [gzip.compress(layer, mtime=0) for layer in layers]  # the same layer, the same blob
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": blob(g), "size": len(g)}
                   for g in gz],
    }).encode()
    index = json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": blob(manifest), "size": len(manifest),
        "platform": {"architecture": "amd64", "os": "linux"}}]}).encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for path, data in [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)] + [
                (f"blobs/sha256/{d.split(':')[1]}", b) for d, b in blobs.items()]:
            ti = tarfile.TarInfo(path)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()


def test_import_docker_save_and_oci(server):
    layers = _tiny_layers()
    saved, oci = _name("img"), _name("oci")
    built = _name("onimg")
    try:
        with server.api() as c:
            r = c.post("/templates/import", params={"name": saved}, content=_docker_save(layers))
            assert r.status_code == 201, r.text
            assert r.json()["templateID"] == saved
            r = c.post("/templates/import", params={"name": oci}, content=_oci_layout(layers))
            assert r.status_code == 201, r.text
            assert c.post("/templates/import", params={"name": saved}, content=_docker_save(layers)).status_code == 409
            listed = [t["templateID"] for t in c.get("/templates").json()]
            assert saved in listed and oci in listed
        for name in (saved, oci):
            sbx = Sandbox.create(name, timeout=60)
            try:
                assert sbx.commands.run("echo $((6*7))").stdout.strip() == "42"
                assert sbx.files.read("/data/hello.txt") == "hello from the image\n"
                assert not sbx.files.exists("/bin/cat")  # whiteout
                assert not sbx.files.exists("/opt/old/a")  # opaque whiteout
                assert sbx.files.read("/opt/old/b") == "upper\n"
                assert sbx.commands.run("echo $HOME; echo $USER").stdout.split() == ["/root", "root"]
            finally:
                sbx.kill()
        # a template built on top of the imported image (no `user` account: runs as root)
        Template.build(Template().from_template(saved).run_cmd("echo layered > /data/built"), built)
        sbx = Sandbox.create(built, timeout=60)
        try:
            assert sbx.files.read("/data/built") == "layered\n"
        finally:
            sbx.kill()
    finally:
        for name in (built, saved, oci):
            _delete(server, name)
    with server.api() as c:
        listed = [t["templateID"] for t in c.get("/templates").json()]
    assert saved not in listed and oci not in listed and built not in listed


FAKE_SUDO = b"""#!/bin/bash
echo "real sudo as $EUID: $*"
"""


def test_imported_image_sudo_runs_the_images_own_sudo(server):
    """An imported image with its own (setuid) sudo and a ``user``: sudo from ``user``
    reaches the image's sudo as root through envd's broker, sudoers gets E2B's line and
    dpkg a diversion, so a package upgrade keeps the link."""
    own = _layer([("etc/passwd", b"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n", 0o644),
                  ("etc/sudoers", b"Defaults env_reset\n", 0o440), ("home", None, 0o755), ("home/user", None, 0o755),
                  ("usr", None, 0o755), ("usr/bin", None, 0o755), ("usr/bin/sudo", FAKE_SUDO, 0o4755),
                  ("var", None, 0o755), ("var/lib", None, 0o755), ("var/lib/dpkg", None, 0o755),
                  ("var/lib/dpkg/diversions", b"", 0o644)])
    name = _name("ownsudo")
    try:
        with server.api() as c:
            r = c.post("/templates/import", params={"name": name}, content=_oci_layout(_tiny_layers() + [own]))
            assert r.status_code == 201, r.text
        root = server.templates_dir / name / "rootfs"
        assert (root / "etc/sudoers").read_text().splitlines()[-1] == "user ALL=(ALL:ALL) NOPASSWD: ALL"
        assert (root / "var/lib/dpkg/diversions").read_text() == "/usr/bin/sudo\n/usr/bin/sudo.distrib\n:\n"
        assert "sudo:x:27:user" in (root / "etc/group").read_text().splitlines()
        sbx = Sandbox.create(name, timeout=60)
        try:
            assert sbx.commands.run("echo $EUID").stdout == "1000\n"  # the image's user is the default one
            assert sbx.commands.run("sudo -n apt-get install x").stdout == "real sudo as 0: -n apt-get install x\n"
            assert sbx.commands.run("sudo true", user="root").stdout == "real sudo as 0: true\n"
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


# ---------------------------------------------------------------- bad input
def test_bad_input(server, tmp_path):
    with server.api() as c:
        for body in ({}, {"name": "Bad Name!"}, {"name": "base"}, {"name": "ok-name:Bad Tag!"},
                     {"name": "ok-name", "cpuCount": 0}, {"name": "ok-name", "memoryMB": 1}):
            r = c.post("/v3/templates", json=body)
            assert r.status_code == 400, (body, r.text)
        assert c.post("/v3/templates", content=b"not json", headers={"Content-Type": "application/json"}).status_code == 400
        assert c.post("/v3/templates", json={"name": "x"}, headers={"X-API-Key": "wrong"}).status_code == 401

        name = _name("inp")
        r = c.post("/v3/templates", json={"name": name})
        assert r.status_code == 202
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        for body in ({"steps": [{"type": "FOO", "args": []}]},
                     {"steps": [{"type": "RUN", "args": []}]},
                     {"steps": [{"type": "ENV", "args": ["1BAD", "x"]}]},
                     {"steps": [{"type": "COPY", "args": ["a", "/b"], "filesHash": "0" * 64}]},
                     {"steps": [{"type": "COPY", "args": ["../etc", "/b"], "filesHash": "0" * 64}]},
                     {"steps": "nope"},
                     {"fromImage": "Not An Image", "steps": []},
                     {"fromTemplate": "no-such-template", "steps": []}):
            r = c.post(f"/v2/templates/{tid}/builds/{bid}", json=body)
            assert r.status_code == 400, (body, r.text)
        assert c.post(f"/v2/templates/{tid}/builds/nope", json={"steps": []}).status_code == 404
        assert c.get(f"/templates/{tid}/builds/nope/status").status_code == 404
        assert c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": -1}).status_code == 400
        assert c.get(f"/templates/{tid}/files/nothex").status_code == 400
        link = c.get(f"/templates/{tid}/files/{'a' * 64}")
        assert link.status_code == 201 and link.json()["present"] is False
        url = link.json()["url"]
        assert c.put(url.split("?")[0] + "?token=bad", content=b"x").status_code == 403
        assert c.put(url, content=b"this is not a tar").status_code == 400
        assert c.get("/templates/aliases/never-built").status_code == 404

        for params, content in (({"name": "Bad Name"}, b"x"), ({"name": _name("imp")}, b""),
                                ({"name": _name("imp")}, b"garbage"), ({"name": _name("imp")}, _layer([]))):
            r = c.post("/templates/import", params=params, content=content)
            assert r.status_code == 400, (params, r.text)
        assert c.post("/templates/import", params={"name": "base"}, content=b"x").status_code == 409
        assert c.delete("/templates/base").status_code == 400
        _delete(server, name)

    # registry pulls and their errors: tests/test_template_registry.py
    # a COPY of a file missing from the context fails client-side, before any build
    with pytest.raises(ValueError, match="No files found"):
        Template.build(Template(file_context_path=tmp_path).from_template("base").copy("missing.txt", "/tmp/"),
                       _name("nofile"))
    assert _build_sandboxes(server) == []
    shutil.rmtree(tmp_path, ignore_errors=True)


def _tar_of(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_upload_of_a_stored_hash_is_accepted_and_keeps_the_first(server, tmp_path):
    """The SDK's ``copy(..., force_upload=True)`` uploads files the node has already (E2B's
    own suite builds with it; forkyard answered 409): a repeated upload is a 201 and what
    was stored first stays, also when the repeat's bytes differ."""
    with server.api() as c:
        name = _name("fup")
        tid = c.post("/v3/templates", json={"name": name}).json()["templateID"]
        files_hash = secrets.token_hex(32)
        url = c.get(f"/templates/{tid}/files/{files_hash}").json()["url"]
        first, other = _tar_of("a.txt", b"first\n"), _tar_of("a.txt", b"other bytes\n")
        assert c.put(url, content=first).status_code == 201
        for body in (first, other):
            r = c.put(url, content=body)
            assert r.status_code == 201 and r.json()["size"] == len(first), r.text
        assert c.get(f"/templates/{tid}/files/{files_hash}").json()["present"] is True
        _delete(server, name)

    (tmp_path / "hello.txt").write_text("from the context\n")
    name = _name("fup")
    template = Template(file_context_path=tmp_path).from_template("base").copy(
        "hello.txt", "/home/user/", force_upload=True)
    try:
        Template.build(template, name)
        Template.build(template, name)  # uploads the same files hash again
        sbx = Sandbox.create(name, timeout=60)
        try:
            assert sbx.files.read("/home/user/hello.txt") == "from the context\n"
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


def test_build_interrupted_by_server_crash(server):
    name = _name("crash")
    info = Template.build_in_background(Template().from_template("base").run_cmd("sleep 600"), name)
    deadline = time.time() + 60
    while time.time() < deadline and not _build_sandboxes(server):
        time.sleep(0.2)
    assert _build_sandboxes(server), "the build sandbox should be running"
    server.stop(sig_kill=True)
    server.start()
    st = Template.get_build_status(info)
    assert st.status.value == "error"
    assert "interrupted" in st.reason.message
    assert _build_sandboxes(server) == []  # killed at startup
    assert not Template.exists(name)
    _delete(server, name)
