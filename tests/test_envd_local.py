"""End-to-end tests of envd on the host, driven by the real ``e2b`` SDK.

envd (``envd/bin/envd``, built by ``envd/build.sh`` when Go is available) runs
as a plain subprocess on a free loopback port; the SDK's ``Sandbox`` is pointed
straight at it (``sandbox_url``), with the envd version envd reports (0.6.4),
so every call is real SDK wire traffic: Connect RPC over HTTP/1.1 plus the
``/files`` HTTP API. Commands run as root (``-default-user root``) because the
host need not have a ``user`` account. No environment variables are changed,
so these tests do not disturb the server-based SDK tests.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("e2b")

from e2b import Sandbox  # noqa: E402
from e2b.connection_config import ConnectionConfig  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    FileNotFoundException,
    InvalidArgumentException,
)
from e2b.sandbox.commands.command_handle import CommandExitException, PtySize  # noqa: E402
from e2b.sandbox.filesystem.filesystem import FileType  # noqa: E402
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType  # noqa: E402
from packaging.version import Version  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ENVD_DIR = REPO / "envd"
ENVD_BIN = ENVD_DIR / "bin" / "envd"
ENVD_VERSION = "0.6.4"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def envd_binary() -> Path:
    if shutil.which("go"):
        subprocess.run([str(ENVD_DIR / "build.sh")], check=True, timeout=600)
    if not ENVD_BIN.exists():
        pytest.skip("envd binary not built and no Go toolchain to build it")
    return ENVD_BIN


class Envd:
    """One envd subprocess on a free loopback port."""

    def __init__(self, binary: Path, workdir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"envd-{self.port}.log"
        self._logf = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [str(binary), "-port", str(self.port), "-listen", "127.0.0.1", "-default-user", "root"],
            stdout=self._logf, stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while time.time() < deadline:
            assert self.proc.poll() is None, f"envd exited: {self.log.read_text()}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 204:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("envd did not become healthy")

    def sandbox(self, token: str | None = None) -> Sandbox:
        """An SDK Sandbox talking to this envd directly."""
        headers = {"E2b-Sandbox-Id": "local", "E2b-Sandbox-Port": str(ConnectionConfig.envd_port)}
        if token:
            headers["X-Access-Token"] = token
        config = ConnectionConfig(sandbox_url=self.url, api_key="e2b_local", debug=False,
                                  extra_sandbox_headers=headers)
        return Sandbox(sandbox_id="local", sandbox_domain=None, envd_version=Version(ENVD_VERSION),
                       envd_access_token=token, traffic_access_token=None, connection_config=config)

    def async_sandbox(self):
        """An SDK AsyncSandbox talking to this envd directly."""
        from e2b import AsyncSandbox

        headers = {"E2b-Sandbox-Id": "local", "E2b-Sandbox-Port": str(ConnectionConfig.envd_port)}
        config = ConnectionConfig(sandbox_url=self.url, api_key="e2b_local", debug=False,
                                  extra_sandbox_headers=headers)
        return AsyncSandbox(sandbox_id="local", sandbox_domain=None, envd_version=Version(ENVD_VERSION),
                            envd_access_token=None, traffic_access_token=None, connection_config=config)

    def children(self) -> list[tuple[int, str]]:
        """(pid, state) of processes whose parent is envd."""
        out = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:
                continue
            fields = text[text.rfind(")") + 2:].split()
            if len(fields) > 1 and int(fields[1]) == self.proc.pid:
                out.append((int(stat.parent.name), fields[0]))
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._logf.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="envd-test-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def envd(envd_binary, workdir):
    e = Envd(envd_binary, workdir)
    yield e
    # Every process a test started must be gone; kill stragglers, then stop.
    sbx = e.sandbox()
    leftovers = sbx.commands.list()
    for p in leftovers:
        sbx.commands.kill(p.pid)
    code = e.stop()
    assert leftovers == [], f"tests left processes running: {leftovers}"
    assert code == 0, e.log.read_text()


@pytest.fixture
def sbx(envd):
    return envd.sandbox()


@pytest.fixture
def tmp(workdir, request) -> str:
    d = workdir / request.node.name
    d.mkdir()
    return str(d)


# ---------------------------------------------------------------- commands


def test_run_stdout_stderr_exit_code(sbx):
    r = sbx.commands.run("echo hello; echo oops >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.error) == ("hello\n", "oops\n", 0, None)

    with pytest.raises(CommandExitException) as ei:
        sbx.commands.run("echo partial; exit 42")
    assert ei.value.exit_code == 42
    assert ei.value.stdout == "partial\n"
    assert ei.value.error == "exit status 42"

    seen = []
    sbx.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
    assert "".join(seen) == "1\n2\n3\n"


def test_run_envs_cwd_user(sbx, tmp):
    r = sbx.commands.run('echo "$FOO|$HOME|$USER|$(pwd)"', envs={"FOO": "bar"}, cwd=tmp, user="root")
    assert r.stdout == f"bar|/root|root|{tmp}\n"
    assert sbx.commands.run("pwd").stdout == "/root\n"
    assert sbx.commands.run("echo $E2B_SANDBOX").stdout == "true\n"
    with pytest.raises(InvalidArgumentException):
        sbx.commands.run("true", cwd="/definitely/not/here")
    with pytest.raises(AuthenticationException):
        sbx.commands.run("true", user="no-such-user-xyz")


def test_background_wait_and_kill(sbx):
    h = sbx.commands.run("echo started; sleep 30", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    info = next(p for p in sbx.commands.list() if p.pid == h.pid)
    assert info.cmd == "/bin/bash" and info.args[-1] == "echo started; sleep 30"
    assert h.kill() is True
    with pytest.raises(CommandExitException) as ei:
        h.wait()
    assert ei.value.exit_code == -1
    assert ei.value.error == "signal: killed"
    deadline = time.time() + 5
    while h.pid in [p.pid for p in sbx.commands.list()] and time.time() < deadline:
        time.sleep(0.05)
    assert sbx.commands.kill(h.pid) is False

    quick = sbx.commands.run("sleep 0.3; echo done", background=True)
    assert quick.wait().stdout == "done\n"


def test_connect_to_running_command(sbx):
    h = sbx.commands.run("sleep 0.5; echo late", background=True)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    assert again.wait().stdout == "late\n"


def test_stdin(sbx):
    h = sbx.commands.run("cat; echo END", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "line one\n")
    h.send_stdin(b"line two\n")
    sbx.commands.stream_input(h.pid, [b"three ", "four\n"])
    sbx.commands.close_stdin(h.pid)
    assert h.wait().stdout == "line one\nline two\nthree four\nEND\n"


def test_timeout_kills_command(sbx):
    from e2b.exceptions import TimeoutException

    start = time.time()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    assert time.time() - start < 10
    deadline = time.time() + 5
    while sbx.commands.list() and time.time() < deadline:
        time.sleep(0.05)
    assert sbx.commands.list() == []


def test_pty(sbx, tmp):
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80), cwd=tmp, envs={"MARK": "pty-ok"})
    sbx.pty.resize(term.pid, PtySize(rows=33, cols=111))
    sbx.pty.send_stdin(term.pid, b"stty size; echo $MARK $TERM; pwd; tty; exit 3\n")
    with pytest.raises(CommandExitException) as ei:
        term.wait(on_pty=out.extend)
    assert ei.value.exit_code == 3
    text = out.decode(errors="replace")
    assert "33 111" in text
    assert "pty-ok xterm-256color" in text
    assert tmp in text
    assert "/dev/pts/" in text

    term = sbx.pty.create(PtySize(rows=10, cols=40))
    assert sbx.pty.kill(term.pid) is True
    with pytest.raises(CommandExitException):
        term.wait()


def test_no_zombies_left(envd, sbx):
    # The shells exit at once, orphaning their background children, which
    # envd (subreaper here, PID 1 in a sandbox) must reap.
    for _ in range(3):
        sbx.commands.run("sleep 0.2 & sleep 0.1 & echo x")
    time.sleep(1.0)
    zombies = [pid for pid, state in envd.children() if state == "Z"]
    assert zombies == []


# -------------------------------------------------------------- filesystem


def test_write_read_list_exists_info(sbx, tmp):
    path = f"{tmp}/a/b/hello.txt"
    info = sbx.files.write(path, "hello world")
    assert (info.path, info.name, info.type) == (path, "hello.txt", FileType.FILE)
    assert sbx.files.read(path) == "hello world"
    assert bytes(sbx.files.read(path, format="bytes")) == b"hello world"
    assert b"".join(sbx.files.read(path, format="stream")) == b"hello world"

    assert sbx.files.exists(path)
    assert not sbx.files.exists(f"{tmp}/nope")

    entry = sbx.files.get_info(path)
    assert entry.type == FileType.FILE and entry.size == 11 and entry.owner == "root"
    assert entry.permissions == "-rw-r--r--" and entry.mode == 0o644
    assert sbx.files.get_info(f"{tmp}/a").type == FileType.DIR

    names = sorted(e.path for e in sbx.files.list(tmp))
    assert names == [f"{tmp}/a"]
    deep = sorted(e.path for e in sbx.files.list(tmp, depth=3))
    assert deep == [f"{tmp}/a", f"{tmp}/a/b", path]

    os.symlink(path, f"{tmp}/link")
    link = sbx.files.get_info(f"{tmp}/link")
    assert link.type == FileType.SYMLINK and link.symlink_target == path

    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{tmp}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{tmp}/missing.txt")
    with pytest.raises(FileNotFoundException):
        sbx.files.list(f"{tmp}/missing")


def test_make_dir_rename_remove(sbx, tmp):
    assert sbx.files.make_dir(f"{tmp}/x/y") is True
    assert sbx.files.make_dir(f"{tmp}/x/y") is False
    sbx.files.write(f"{tmp}/x/y/f.txt", b"\x00\x01binary")
    moved = sbx.files.rename(f"{tmp}/x/y/f.txt", f"{tmp}/z/g.bin")
    assert moved.path == f"{tmp}/z/g.bin" and moved.size == 8
    assert not sbx.files.exists(f"{tmp}/x/y/f.txt")
    assert bytes(sbx.files.read(f"{tmp}/z/g.bin", format="bytes")) == b"\x00\x01binary"
    with pytest.raises(FileNotFoundException):
        sbx.files.rename(f"{tmp}/nope", f"{tmp}/nope2")
    sbx.files.remove(f"{tmp}/x")
    assert not sbx.files.exists(f"{tmp}/x")
    sbx.files.remove(f"{tmp}/z/g.bin")
    assert sbx.files.list(f"{tmp}/z") == []


def test_write_files_multipart_and_octet_stream(sbx, tmp):
    infos = sbx.files.write_files([
        {"path": f"{tmp}/m/one.txt", "data": "1"},
        {"path": f"{tmp}/m/sub/two.txt", "data": b"22"},
    ])
    assert sorted(i.path for i in infos) == [f"{tmp}/m/one.txt", f"{tmp}/m/sub/two.txt"]
    assert sbx.files.read(f"{tmp}/m/sub/two.txt") == "22"

    info = sbx.files.write(f"{tmp}/o.txt", "octet", use_octet_stream=True)
    assert info.path == f"{tmp}/o.txt"
    info = sbx.files.write(f"{tmp}/gz.txt", "zipped" * 1000, gzip=True)
    assert sbx.files.read(f"{tmp}/gz.txt", gzip=True) == "zipped" * 1000
    sbx.files.write(f"{tmp}/stream.bin", iter([b"ab", b"cd"]))
    assert sbx.files.read(f"{tmp}/stream.bin") == "abcd"


def test_watch_dir(sbx, tmp):
    handle = sbx.files.watch_dir(tmp, recursive=True)
    try:
        sbx.files.write(f"{tmp}/w1.txt", "x")
        sbx.files.make_dir(f"{tmp}/sub")
        time.sleep(0.2)
        sbx.files.write(f"{tmp}/sub/w2.txt", "y")
        sbx.files.remove(f"{tmp}/w1.txt")
        events = []
        deadline = time.time() + 5
        while time.time() < deadline:
            events += [(e.name, e.type) for e in handle.get_new_events()]
            if ("w1.txt", FilesystemEventType.REMOVE) in events and ("sub/w2.txt", FilesystemEventType.WRITE) in events:
                break
            time.sleep(0.1)
    finally:
        handle.stop()
    assert ("w1.txt", FilesystemEventType.CREATE) in events
    assert ("sub", FilesystemEventType.CREATE) in events
    assert ("sub/w2.txt", FilesystemEventType.CREATE) in events
    assert ("sub/w2.txt", FilesystemEventType.WRITE) in events
    assert ("w1.txt", FilesystemEventType.REMOVE) in events


def test_upload_download_50mb(sbx, tmp):
    data = os.urandom(50 * 1024 * 1024)
    path = f"{tmp}/big.bin"
    start = time.time()
    sbx.files.write(path, data)
    up = time.time() - start
    assert os.path.getsize(path) == len(data)
    start = time.time()
    got = sbx.files.read(path, format="bytes")
    down = time.time() - start
    assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
    with sbx.files.read(path, format="stream") as stream:
        h = hashlib.sha256()
        for chunk in stream:
            h.update(chunk)
    assert h.digest() == hashlib.sha256(data).digest()
    # Generous bounds: this is about streaming, not a benchmark.
    assert up < 30 and down < 30, (up, down)


async def test_async_sdk_commands_and_streamed_watch(envd, tmp):
    """AsyncSandbox: commands, and watch_dir over the WatchDir server stream."""
    import asyncio

    sbx = envd.async_sandbox()
    r = await sbx.commands.run("echo async; exit 0")
    assert r.stdout == "async\n"

    events = []
    handle = await sbx.files.watch_dir(tmp, on_event=events.append, recursive=True, include_entry=True)
    try:
        await sbx.files.write(f"{tmp}/aw.txt", "x")
        await sbx.files.make_dir(f"{tmp}/d")
        await asyncio.sleep(0.2)
        await sbx.files.write(f"{tmp}/d/inner.txt", "y")
        for _ in range(50):
            if any(e.name == "d/inner.txt" and e.type == FilesystemEventType.WRITE for e in events):
                break
            await asyncio.sleep(0.1)
    finally:
        await handle.stop()
    created = [e for e in events if e.type == FilesystemEventType.CREATE]
    assert {"aw.txt", "d", "d/inner.txt"} <= {e.name for e in created}
    assert all(e.entry is not None for e in created)
    assert any(e.name == "d/inner.txt" and e.type == FilesystemEventType.WRITE for e in events)


# ------------------------------------------------- access token, lifecycle


def test_access_token_and_signed_urls(envd_binary, workdir):
    e = Envd(envd_binary, workdir)
    try:
        r = httpx.post(f"{e.url}/init", json={"accessToken": "tok-123", "envVars": {"FROM_INIT": "yes"}})
        assert r.status_code == 204
        assert httpx.get(f"{e.url}/health").status_code == 204
        assert httpx.get(f"{e.url}/envs").status_code == 401

        good = e.sandbox(token="tok-123")
        assert good.commands.run("echo $FROM_INIT").stdout == "yes\n"
        good.files.write(f"{workdir}/signed.txt", "signed content")

        bad = e.sandbox()
        with pytest.raises(AuthenticationException):
            bad.commands.run("true")
        with pytest.raises(AuthenticationException):
            bad.files.read(f"{workdir}/signed.txt")

        # URLs signed by the SDK work without the header.
        url = good.download_url(f"{workdir}/signed.txt", use_signature_expiration=60)
        assert httpx.get(url).text == "signed content"
        up = good.upload_url(f"{workdir}/up-signed.txt")
        r = httpx.post(up, files={"file": ("up-signed.txt", b"via signed url")})
        assert r.status_code == 200, r.text
        assert Path(f"{workdir}/up-signed.txt").read_text() == "via signed url"
        forged = url.replace("signature=v1_", "signature=v1_x")
        assert httpx.get(forged).status_code == 401
        # Expired: E2B envd's exact body (the SDKs' tests match it); a forged signature
        # with a past expiry learns nothing about the expiry.
        expired = good.download_url(f"{workdir}/signed.txt", use_signature_expiration=-10)
        r = httpx.get(expired)
        assert (r.status_code, r.json()) == (401, {"code": 401, "message": "signature is already expired"}), r.text
        r = httpx.get(expired.replace("signature=v1_", "signature=v1_x"))
        assert r.status_code == 401 and "expired" not in r.text, r.text
    finally:
        assert e.stop() == 0


def test_sigterm_stops_processes(envd_binary, workdir):
    e = Envd(envd_binary, workdir)
    sbx = e.sandbox()
    h = sbx.commands.run("sleep 60", background=True)
    pid = h.pid
    start = time.time()
    code = e.stop()
    assert code == 0
    assert time.time() - start < 10
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


def test_metrics_and_envs(envd):
    m = httpx.get(f"{envd.url}/metrics").json()
    assert m["cpu_count"] >= 1 and m["mem_total"] > 0 and m["disk_total"] > 0
    assert httpx.get(f"{envd.url}/envs").json()["E2B_SANDBOX"] == "true"
    creds = base64.b64encode(b"root:").decode()
    # A raw Connect JSON call, as any non-Python client would send it.
    r = httpx.post(f"{envd.url}/process.Process/List", json={},
                   headers={"Authorization": f"Basic {creds}"})
    assert r.status_code == 200 and r.json() == {}


def test_envd_go_unit_tests():
    """envd's Go unit tests (listener rearm, process/filesystem services, state) pass."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    envd_dir = Path(__file__).resolve().parent.parent / "envd"
    p = subprocess.run([go, "test", "-count=1", "./..."], cwd=envd_dir, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
