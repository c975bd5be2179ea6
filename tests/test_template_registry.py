"""Templates from OCI registries through the real e2b SDK: Debian's ``docker-registry``
(distribution 2.8) on loopback — one open, one with htpasswd auth — holding images the
test pushes with ``skopeo`` (multi-layer, whiteouts, a hard link, owners), then
``Template().from_image(..., username=, password=)`` and a Dockerfile ``FROM`` built and
run; the layer cache; and the errors a user meets (bad credentials, wrong digest,
unreachable registry, a corrupt blob)."""

from __future__ import annotations

import io
import json
import secrets
import shutil
import socket
import subprocess
import tarfile
import time
from pathlib import Path

import bcrypt
import pytest
from conftest import free_port
from e2b import Sandbox, Template
from e2b.exceptions import BuildException
from e2b.sandbox.commands.command_handle import CommandExitException
from test_templates import _build_sandboxes, _delete, _layer, _libs, _name, _oci_layout, _tiny_layers

pytestmark = pytest.mark.skipif(not shutil.which("skopeo") or not shutil.which("docker-registry"),
                                reason="needs skopeo and docker-registry (deploy/test.sh installs them)")

PRIMES = r"""#!/bin/bash
# primes below $1 by trial division: real work for the sandbox
n=${1:-20}; out=()
for ((i = 2; i < n; i++)); do
  p=1; for ((j = 2; j * j <= i; j++)); do (( i % j == 0 )) && { p=0; break; }; done
  (( p )) && out+=("$i")
done
echo "${out[*]}"
"""


class Registry:
    """A ``docker-registry serve`` on a free loopback port (auth: htpasswd ``user``)."""

    def __init__(self, root: Path, password: str | None = None, ip: str = "127.0.0.1"):
        self.root, self.password = root, password
        self.port = free_port()
        self.host = f"{ip}:{self.port}"
        root.mkdir(parents=True)
        auth = ""
        if password:
            (root / "htpasswd").write_text(f"user:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(5)).decode()}\n")
            auth = f"auth: {{htpasswd: {{realm: forkyard-test, path: {root / 'htpasswd'}}}}}\n"
        (root / "config.yml").write_text(
            f"version: 0.1\nlog: {{level: warn, accesslog: {{disabled: false}}}}\n"
            f"storage: {{filesystem: {{rootdirectory: {root / 'store'}}}}}\nhttp: {{addr: {self.host}}}\n{auth}")
        self.log = root / "registry.log"
        self.proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection((ip, self.port), timeout=1).close()
                break
            except OSError:
                assert time.time() < deadline, f"docker-registry did not listen: {self.log.read_text()}"
                time.sleep(0.05)

    def push(self, layout_tar: Path, repo: str) -> None:
        creds = ["--dest-creds", f"user:{self.password}"] if self.password else []
        subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds, f"oci-archive:{layout_tar}",
                        f"docker://{self.host}/{repo}"], check=True, capture_output=True, timeout=60)

    def manifest(self, ref: str) -> dict:
        out = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", "--no-creds",
                              f"docker://{self.host}/{ref}"], check=True, capture_output=True, timeout=30).stdout
        return json.loads(out)

    def blob_gets(self) -> list[str]:
        return [ln.split("/blobs/")[1].split()[0] for ln in self.log.read_text().splitlines()
                if '"GET /v2/' in ln and "/blobs/" in ln]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def _member(tf: tarfile.TarFile, path: str, data: bytes | None = None, mode: int = 0o644, uid: int = 0,
            link: str | None = None) -> None:
    ti = tarfile.TarInfo(path)
    ti.mode, ti.uid, ti.gid, ti.mtime = mode, uid, uid, int(time.time())
    if link is not None:
        ti.type, ti.linkname = tarfile.LNKTYPE, link
        tf.addfile(ti)
    elif data is None:
        ti.type = tarfile.DIRTYPE
        tf.addfile(ti)
    else:
        ti.size = len(data)
        tf.addfile(ti, io.BytesIO(data))


def _tool_layer(tag: str) -> bytes:
    """A layer with a script owned by 1234:1234 and a hard link to it."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        _member(tf, "opt/tool", None, 0o755, uid=1234)
        _member(tf, "opt/tool/primes.sh", PRIMES.encode(), 0o755, uid=1234)
        _member(tf, "opt/tool/primes-link", link="opt/tool/primes.sh")
        _member(tf, "opt/tool/tag", f"{tag}\n".encode())
        # E2B's Dockerfile conversion ends with USER user / WORKDIR /home/user
        _member(tf, "etc/passwd", b"root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n")
        _member(tf, "home", None, 0o755)
        _member(tf, "home/user", None, 0o755, uid=1000)
    return buf.getvalue()


@pytest.fixture(scope="module")
def registries(tmp_path_factory):
    root = tmp_path_factory.mktemp("registries")
    password = secrets.token_hex(12)
    regs = []
    try:
        regs = [Registry(root / "open"), Registry(root / "private", password)]
        yield regs[0], regs[1], root
    finally:
        for r in regs:
            r.stop()
        shutil.rmtree(root, ignore_errors=True)


def _host_ip() -> str | None:
    """This host's own non-loopback address (the source of its default route)."""
    out = subprocess.run(["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True).stdout.split()
    return out[out.index("src") + 1] if "src" in out else None


def _image(root: Path, layers: list[bytes], name: str) -> Path:
    path = root / f"{name}.tar"
    path.write_bytes(_oci_layout(layers))
    return path


def _pulled_dirs(server) -> set[str]:
    return {p.name for p in server.templates_dir.glob("oci-*")}


def test_pull_private_then_dockerfile_from_reuses_layers(server, registries):
    open_reg, private, root = registries
    base_layers = _tiny_layers() + [_tool_layer("v1")]
    v1 = _image(root, base_layers, "v1")
    private.push(v1, "team/tiny:v1")
    # v2 = v1's layers + one: a second image sharing layers with the first
    extra = io.BytesIO()
    with tarfile.open(fileobj=extra, mode="w") as tf:
        _member(tf, "opt/tool/tag", b"v2\n")
    v2 = _image(root, base_layers + [extra.getvalue()], "v2")
    open_reg.push(v2, "tiny:v2")
    before = _pulled_dirs(server)
    first, second = _name("pull"), _name("from")
    try:
        logs = []
        Template.build(Template().from_image(f"{private.host}/team/tiny:v1", username="user",
                                             password=private.password)
                       .run_cmd("bash /opt/tool/primes.sh 30 > /data/primes.txt", user="root"), first, on_build_logs=logs.append)
        assert any("Pulling" in e.message for e in logs), [e.message for e in logs]
        sbx = Sandbox.create(first, timeout=60)
        try:
            assert sbx.files.read("/data/primes.txt").split() == "2 3 5 7 11 13 17 19 23 29".split()
            assert sbx.commands.run("/opt/tool/primes-link 12").stdout.split() == ["2", "3", "5", "7", "11"]
            # layers applied as OCI defines: owners, a hard link, whiteouts, an opaque directory
            info = sbx.files.get_info("/opt/tool/primes.sh")
            assert (info.owner, info.group, info.permissions) == ("1234", "1234", "-rwxr-xr-x"), info
            assert sbx.commands.run("[[ /opt/tool/primes.sh -ef /opt/tool/primes-link ]]").exit_code == 0  # same inode
            assert not sbx.files.exists("/bin/cat") and not sbx.files.exists("/opt/old/a")
            assert sbx.files.read("/opt/old/b") == "upper\n"
        finally:
            sbx.kill()
        # the credentials are in no build record and no server log line
        records = "".join(p.read_text() for p in (server.data_dir / "template-builds").glob("*.json"))
        assert private.password not in records and private.password not in server.log.read_text()

        # Dockerfile FROM another registry's image that shares 3 of its 4 layers: only
        # the new layer (and the small config) is fetched, the shared ones come from the cache
        layers = [d["digest"] for d in open_reg.manifest("tiny:v2")["layers"]]
        Template.build(Template().from_dockerfile(f"FROM {open_reg.host}/tiny:v2\nRUN read -r t < /opt/tool/tag && echo $t > /data/t\n"),
                       second)
        fetched = set(open_reg.blob_gets())
        assert layers[3] in fetched and not fetched & set(layers[:3]), (fetched, layers)
        sbx = Sandbox.create(second, timeout=60)
        try:
            assert sbx.files.read("/data/t") == "v2\n"
        finally:
            sbx.kill()
        assert len(_pulled_dirs(server) - before) == 2
    finally:
        _delete(server, first)
        _delete(server, second)
    # the pulled images went with the last templates built on them
    assert _pulled_dirs(server) - before == set()


def test_pull_errors_are_clear(server, registries):
    open_reg, private, root = registries
    private.push(_image(root, _tiny_layers(), "err"), "team/err:v1")
    bad = _image(root, [_tool_layer(secrets.token_hex(4))], "bad")
    open_reg.push(bad, "bad:v1")
    # corrupt the layer in the registry's storage: same size, one byte changed
    digest = open_reg.manifest("bad:v1")["layers"][0]["digest"].split(":")[1]
    blob = open_reg.root / "store/docker/registry/v2/blobs/sha256" / digest[:2] / digest / "data"
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    before = _pulled_dirs(server)
    ip = _host_ip()
    plain = Registry(root / "plain", ip=ip) if ip else None  # plain HTTP, not on loopback: refused
    cases = [
        (Template().from_image(f"{private.host}/team/err:v1", username="user", password="wrong"),
         "refused the credentials"),
        (Template().from_image(f"{private.host}/team/err:v1"), "requires authentication"),
        (Template().from_image(f"{open_reg.host}/bad@sha256:{'0' * 64}"), "not found"),
        (Template().from_image(f"127.0.0.1:{free_port()}/x:v1"), "cannot reach registry"),
        (Template().from_image(f"{open_reg.host}/bad:v1"), "does not match its digest"),
    ] + ([(Template().from_image(f"{plain.host}/x:v1"), "speaks plain HTTP")] if plain else [])
    try:
        for template, message in cases:
            with pytest.raises(BuildException, match=message) as err:
                Template.build(template.run_cmd("true"), _name("err"))
            assert "Traceback" not in str(err.value)
    finally:
        if plain:
            plain.stop()
    assert _pulled_dirs(server) == before  # nothing half-unpacked
    with server.api() as c:
        r = c.post("/v3/templates", json={"name": _name("aws")})
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        for body, message in (({"fromImage": "Not A Ref", "steps": []}, "invalid image reference"),
                              ({"fromImage": "x/y", "fromImageRegistry": {"type": "aws"}, "steps": []},
                               "not supported here"),
                              ({"fromTemplate": "base", "fromImageRegistry": {"type": "registry", "username": "u",
                                                                              "password": "p"}, "steps": []},
                               "needs fromImage")):
            r = c.post(f"/v2/templates/{tid}/builds/{bid}", json=body)
            assert r.status_code == 400 and message in r.json()["message"], r.text
        _delete(server, tid)
    assert _build_sandboxes(server) == []


def _tools_layer() -> bytes:
    """``id`` and ``sleep`` with their libraries (from the host) — no sudo, no python,
    no ``user`` account: the image a user pulls is not ``base``."""
    entries: list = []
    for binary in ("/usr/bin/id", "/usr/bin/sleep"):
        entries.append((f"bin/{Path(binary).name}", Path(binary).read_bytes(), 0o755))
        entries += [(lib.lstrip("/"), Path(lib).resolve().read_bytes(), 0o755) for lib in _libs(binary)]
    return _layer(entries)


def _run(sbx, cmd: str, **kw):
    """``(exit code, stdout + stderr)`` of ``cmd`` in ``sbx`` (no exception on a failure)."""
    try:
        r = sbx.commands.run(cmd, **kw)
    except CommandExitException as e:
        return e.exit_code, e.stdout + e.stderr
    return r.exit_code, r.stdout + r.stderr


def test_sudo_and_start_command_in_a_pulled_image(server, registries):
    """An image with no sudo and no ``user``: the build gives it E2B's ``user`` and a
    working ``sudo`` (gVisor ignores setuid), the start command runs as ``user`` and uses
    sudo, and its output is in the build log."""
    open_reg, _, root = registries
    open_reg.push(_image(root, _tiny_layers() + [_tools_layer()], "nosudo"), "nosudo:v1")
    name = _name("sudo")
    try:
        logs = []
        Template.build(Template().from_image(f"{open_reg.host}/nosudo:v1")
                       .set_start_cmd("echo start-as-$(id -u); sudo bash -c 'id -u > /tmp/started; exec sleep 600'",
                                      "read -r u < /tmp/started && [ $u = 0 ]"),
                       name, on_build_logs=logs.append)
        messages = [e.message for e in logs]
        assert any("created user user (uid 1000" in m for m in messages), messages
        assert "[start] [stdout]: start-as-1000" in messages, messages
        sbx = Sandbox.create(name, timeout=60)
        try:
            assert _run(sbx, "id -u") == (0, "1000\n")
            assert _run(sbx, "sudo id -u") == (0, "0\n")
            assert _run(sbx, "sudo -u user id -un") == (0, "user\n")
            # root's work: a file in /etc that user cannot write
            rc, out = _run(sbx, "echo no > /etc/by-user")
            assert rc != 0 and "Permission denied" in out, out
            assert _run(sbx, "sudo bash -c 'echo yes > /etc/by-sudo'") == (0, "")
            assert sbx.files.read("/etc/by-sudo") == "yes\n"
            assert sbx.files.get_info("/etc/by-sudo").owner == "root"
            # the environment is reset as sudo's env_reset does, SUDO_USER says who asked
            assert _run(sbx, "sudo bash -c 'echo $HOME $USER $SUDO_USER'", envs={"SECRET": "x"}) == (0, "/root root user\n")
            assert _run(sbx, "sudo -E bash -c 'echo $SECRET'", envs={"SECRET": "x"}) == (0, "x\n")
            rc, out = _run(sbx, "sudo --chroot=/ id")
            assert rc == 1 and "not supported" in out, out
            assert _run(sbx, "sudo id -u", user="root") == (0, "0\n")  # root: envd's sudo runs it directly
            # only members of group sudo: another account is refused
            assert _run(sbx, "sudo bash -c 'echo bob:x:1001:1001::/tmp:/bin/bash >> /etc/passwd'")[0] == 0
            rc, out = _run(sbx, "sudo id -u", user="bob")
            assert rc == 1 and "not allowed to use sudo" in out, out
            # the start command's process (sleep, started through sudo) is in the snapshot
            assert sbx.files.read("/tmp/started") == "0\n"
            rc, out = _run(sbx, "for f in /proc/[0-9]*/cmdline; do read -r -d '' a < $f; [ \"$a\" = sleep ] && echo found; done; true")
            assert "found" in out, out
            # a cold boot (filesystem-only pause): the broker starts again, over the socket the
            # saved files still hold, and sudo right after the resume waits for it
            sbx.pause(mode="filesystem")
            same = Sandbox.connect(sbx.sandbox_id)
            assert _run(same, "sudo id -u") == (0, "0\n")
        finally:
            sbx.kill()
    finally:
        _delete(server, name)


def test_failing_start_command_fails_fast_with_its_output(server, registries):
    open_reg, _, root = registries
    open_reg.push(_image(root, _tiny_layers() + [_tools_layer()], "nosudo2"), "nosudo:v2")
    name = _name("startfail")
    logs = []
    started = time.monotonic()
    try:
        with pytest.raises(BuildException, match="exited with code 3 before the template was ready: about to fail"):
            Template.build(Template().from_image(f"{open_reg.host}/nosudo:v2")
                           .set_start_cmd("echo hello from start; echo about to fail >&2; exit 3", "[ -f /never ]"),
                           name, on_build_logs=logs.append)
        took = time.monotonic() - started
        messages = [e.message for e in logs]
        assert "[start] [stdout]: hello from start" in messages, messages
        assert "[start] [stderr]: about to fail" in messages, messages
        assert took < 60, took  # not the ready command's 300 s
        assert _build_sandboxes(server) == []
        # the same through the build-status API
        with server.api() as c:
            builds = [json.loads(p.read_text()) for p in (server.data_dir / "template-builds").glob("*.json")]
            rec = next(b for b in builds if b["template_id"] == name)
            st = c.get(f"/templates/{name}/builds/{rec['build_id']}/status", params={"limit": 100}).json()
        assert st["status"] == "error" and "exited with code 3" in st["reason"]["message"], st
        assert any(e["message"] == "[start] [stdout]: hello from start" for e in st["logEntries"]), st
    finally:
        _delete(server, name)
