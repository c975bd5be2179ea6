"""The `forkyard` CLI through subprocesses against a real server with real sandboxes;
`start`/`connect` through a real PTY."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import signal
import stat
import struct
import subprocess
import sys
import termios
import time

import pytest

CLI = [sys.executable, "-m", "forkyard.cli.main"]


def cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """Run the CLI; never a traceback, whatever the outcome."""
    p = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def cli_json(*args: str, **kw):
    p = cli(*args, "--json", **kw)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def sbx(server):
    """One sandbox started with `forkyard start --detach`, killed at the end."""
    p = cli("start", "base", "--detach", "--timeout", "600", "--metadata", "suite=cli", "--env", "GREETING=hey")
    assert p.returncode == 0, p.stderr
    sid = p.stdout.strip()
    assert re.fullmatch(r"[a-z0-9]+", sid), p.stdout
    yield sid
    cli("rm", sid)


def _gone(server, sid: str) -> bool:
    with server.api() as c:
        return c.get(f"/sandboxes/{sid}").status_code == 404


# -- config and errors ---------------------------------------------------------------------


def test_help_wraps_at_the_terminal_not_at_the_docstring():
    """`--help` joins a docstring's hard wraps: at 200 columns a two-line docstring is one
    line (forkyard.cli.main.reflow); list items keep their own lines."""
    from forkyard.cli.main import reflow

    p = cli("pause", "--help", env={**os.environ, "COLUMNS": "200"}, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "resume continues them (a paused one is left as it is)." in p.stdout, p.stdout
    assert reflow("""One
    two.

    - a
    - b
      c""") == "One two.\n\n- a\n- b\n  c"

def test_auth_writes_0600_config_and_env_overrides(server, tmp_path):
    cfg = tmp_path / "cfg" / "config.toml"
    env = {k: v for k, v in os.environ.items() if k not in ("E2B_API_URL", "E2B_API_KEY", "E2B_SANDBOX_URL",
                                                            "FORKYARD_URL", "FORKYARD_API_KEY")}
    env.update(FORKYARD_CONFIG=str(cfg), FORKYARD_DATA_DIR=str(tmp_path / "nodata"))
    bad = cli("auth", "--url", server.url, "--api-key", "e2b_wrong", env=env)
    assert bad.returncode == 1 and "rejected the API key" in bad.stderr and not cfg.exists()
    p = cli("auth", "--url", server.url, "--api-key", server.api_key, env=env)
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE(cfg.stat().st_mode) == 0o600
    assert server.api_key in cfg.read_text() and server.url in cfg.read_text()
    # The file alone is enough …
    assert isinstance(cli_json("ls", env=env), list)
    show = cli("auth", "--show", env=env)
    assert server.url in show.stdout and str(cfg) in show.stdout and server.api_key not in show.stdout
    # … and the environment wins over it.
    down = cli("ls", env={**env, "FORKYARD_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1
    assert "cannot reach server at http://127.0.0.1:9" in down.stderr and "./deploy/up.sh" in down.stderr
    nokey = cli("ls", env={**env, "E2B_API_KEY": "e2b_wrong"})
    assert nokey.returncode == 1 and "rejected the API key" in nokey.stderr


def test_unknown_ids_are_messages_not_tracebacks(server):
    for args in (["info", "nosuchid"], ["rm", "nosuchid"], ["pause", "nosuchid"], ["exec", "nosuchid", "--", "true"],
                 ["connect", "nosuchid"], ["fork", "nosuchid"], ["logs", "nosuchid"], ["snapshot", "rm", "nosuchsnap"]):
        p = cli(*args)
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        assert "not found" in p.stderr, (args, p.stderr)
    p = cli("start", "no-such-template", "--detach")
    assert p.returncode == 1 and "no-such-template" in p.stderr
    p = cli("ls", "--state", "sleeping")
    assert p.returncode == 1 and "unknown state" in p.stderr


def test_doctor_reports_checks(server):
    p = cli("doctor", "--json")
    data = json.loads(p.stdout)
    checks = {c["check"]: c for c in data["checks"]}
    assert {"runsc", "netns", "overlay", "data dir", "envd", "server", "api key"} <= set(checks)
    assert checks["server"]["status"] == "ok" and checks["api key"]["status"] == "ok"
    assert checks["runsc"]["status"] == "ok" and checks["envd"]["status"] == "ok"
    assert p.returncode == (0 if data["ok"] else 1)
    down = cli("doctor", env={**os.environ, "FORKYARD_URL": "http://127.0.0.1:9"})
    assert down.returncode == 1 and "cannot reach server" in down.stdout
    wrong = cli("doctor", "--json", env={**os.environ, "E2B_API_KEY": "e2b_wrong"})
    key = {c["check"]: c for c in json.loads(wrong.stdout)["checks"]}["api key"]
    assert key["status"] == "fail" and "unset E2B_API_KEY" in json.dumps(key)  # not "run forkyard auth"


# -- sandbox commands ------------------------------------------------------------------------

def test_ls_info_and_filters(sbx):
    listed = cli_json("ls", "--metadata", "suite=cli")
    assert [s["sandboxID"] for s in listed] == [sbx]
    assert cli_json("ls", "--metadata", "suite=other") == []
    assert sbx not in [s["sandboxID"] for s in cli_json("ls", "--state", "paused")]
    assert sbx in cli("ls").stdout.split("\n")  # piped: one id a line (table on a TTY: test_fidelity_cli)
    info = cli_json("info", sbx)
    assert info["state"] == "running" and info["templateID"] == "base" and "envdAccessToken" not in info
    m = info["metrics"]  # measured figures, not placeholders
    assert m["cpuCount"] >= 1 and 0 < m["memUsed"] < m["memTotal"] and 0 <= m["cpuUsedPct"] <= 100, m
    assert "running" in cli("info", sbx).stdout


def test_exec_streams_and_returns_exit_code(sbx):
    p = cli("exec", sbx, "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert p.returncode == 7 and p.stdout == "out\n" and p.stderr == "err\n"
    p = cli("exec", sbx, "--", "echo $GREETING $((6*7)) | tr a-z A-Z")  # one argument: a shell line
    assert p.returncode == 0 and p.stdout == "HEY 42\n"
    p = cli("exec", sbx, "--", "printf", "%s|", "$GREETING", "two words")  # several arguments: quoted
    assert p.returncode == 0 and p.stdout == "$GREETING|two words|"
    p = cli("exec", sbx, "--cwd", "/tmp", "--env", "X=1", "--", "echo $X; pwd")
    assert p.stdout == "1\n/tmp\n"
    p = cli("exec", sbx, "--json", "--", "echo json; exit 2")
    r = json.loads(p.stdout)
    assert p.returncode == 2
    assert r["exitCode"] == 2 and r["stdout"] == "json\n"


def test_exec_output_is_live(sbx):
    proc = subprocess.Popen([*CLI, "exec", sbx, "--", "echo first; sleep 8; echo second"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline()
        assert first == "first\n"
        assert proc.poll() is None  # still running: the line came before the command ended
        assert proc.wait(timeout=120) == 0 and proc.stdout.read() == "second\n"
    finally:
        proc.kill()


def test_upload_download_roundtrip(sbx, tmp_path):
    data = os.urandom(3 << 20) + b"end"
    src = tmp_path / "blob.bin"
    src.write_bytes(data)
    p = cli("upload", sbx, str(src), "/home/user/")
    assert p.returncode == 0, p.stderr
    assert cli("exec", sbx, "--", "stat -c %s /home/user/blob.bin").stdout.strip() == str(len(data))
    dest = tmp_path / "back.bin"
    p = cli("download", sbx, "/home/user/blob.bin", str(dest))
    assert p.returncode == 0, p.stderr
    assert dest.read_bytes() == data
    p = cli("download", sbx, "/home/user/nope.bin", str(tmp_path / "x"))
    assert p.returncode == 1 and "does not exist" in p.stderr


def test_logs_says_what_it_shows(sbx):
    from e2b import Sandbox

    h = Sandbox.connect(sbx).commands.run("sleep 300", background=True)  # a process envd tracks
    p = cli("logs", sbx)
    assert p.returncode == 0, p.stderr
    assert "no sandbox logs endpoint" not in p.stderr  # the logs endpoints exist (issue 9)
    assert "started: /bin/bash -l -c sleep 300" in p.stdout
    h.kill()


def test_timeout_pause_resume(sbx, server):
    assert cli("timeout", sbx, "500").returncode == 0
    assert cli("pause", sbx).returncode == 0
    assert sbx in [s["sandboxID"] for s in cli_json("ls", "--state", "paused")]
    again = cli("pause", sbx)  # already paused: not an error
    assert again.returncode == 0 and "already paused" in again.stdout
    assert cli("resume", sbx, "--timeout", "600").returncode == 0
    assert cli_json("info", sbx)["state"] == "running"
    assert cli("exec", sbx, "--", "echo back").stdout == "back\n"


def test_fork_and_snapshots(sbx, server):
    cli("exec", sbx, "--", "echo parent > /home/user/who")
    children = cli_json("fork", sbx, "-n", "2", "--timeout", "120")
    ids = [c["sandbox"]["sandboxID"] for c in children]
    try:
        assert len(ids) == 2 and sbx not in ids
        for cid in ids:
            assert cli("exec", cid, "--", "cat /home/user/who").stdout == "parent\n"
    finally:
        p = cli("rm", *ids)
    assert p.returncode == 0 and all(_gone(server, i) for i in ids)
    snap = cli_json("snapshot", "create", sbx, "--name", "cli-snap")
    sid = snap["snapshotID"]
    assert sid in [s["snapshotID"] for s in cli_json("snapshot", "list", "--sandbox", sbx)]
    assert sid in cli("snapshot", "list").stdout.split("\n")  # piped: ids only
    assert "cli-snap" in [n for s in cli_json("snapshot", "list") for n in s["names"]]
    assert cli("snapshot", "rm", sid).returncode == 0
    assert sid not in [s["snapshotID"] for s in cli_json("snapshot", "list")]


def _docker_save_tarball(path) -> None:
    """A minimal `docker save` tarball: one layer with bash and its libraries (host files)."""
    import io
    import tarfile
    from pathlib import Path

    files = {"/bin/bash": Path("/bin/bash").read_bytes()}
    ldd = subprocess.run(["ldd", "/bin/bash"], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        parts = line.split()
        lib = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if lib.startswith("/"):
            files[lib] = Path(lib).resolve().read_bytes()

    def tar(members: dict[str, bytes | None]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            for name, data in members.items():
                ti = tarfile.TarInfo(name)
                if data is None:
                    ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                    tf.addfile(ti)
                else:
                    ti.size, ti.mode = len(data), 0o755
                    tf.addfile(ti, io.BytesIO(data))
        return buf.getvalue()

    dirs = sorted({str(Path(p).parent).lstrip("/") for p in files} | {"etc", "data"})
    layer = tar({**{d: None for d in dirs}, **{p.lstrip("/"): b for p, b in files.items()},
                 "etc/passwd": b"root:x:0:0:root:/root:/bin/bash\n", "data/hello.txt": b"from cli import\n"})
    cfg = json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                      "rootfs": {"type": "layers", "diff_ids": []}}).encode()
    manifest = json.dumps([{"Config": "cfg.json", "RepoTags": ["tiny:latest"], "Layers": ["l0/layer.tar"]}]).encode()
    Path(path).write_bytes(tar({"cfg.json": cfg, "l0": None, "l0/layer.tar": layer, "manifest.json": manifest}))


def test_template_list_import_rm(server, tmp_path):
    assert "base" in [t["templateID"] for t in cli_json("template", "list")]
    assert "base" in cli("template", "list").stdout
    p = cli("template", "rm", "no-such-template")
    assert p.returncode == 1 and "not found" in p.stderr
    name = f"cli-img-{os.getpid()}"
    _docker_save_tarball(tmp_path / "img.tar")
    p = cli("template", "import", name, str(tmp_path / "img.tar"))
    try:
        assert p.returncode == 0, p.stderr
        assert name in [t["templateID"] for t in cli_json("template", "list")]
        again = cli("template", "import", name, str(tmp_path / "img.tar"))
        assert again.returncode == 1 and "already exists" in again.stderr
    finally:
        p = cli("template", "rm", name)
    assert p.returncode == 0, p.stderr
    assert name not in [t["templateID"] for t in cli_json("template", "list")]


def test_template_build_from_dockerfile(server, tmp_path):
    (tmp_path / "hello.txt").write_text("copied by the cli build\n")
    (tmp_path / "Dockerfile").write_text("FROM e2bdev/base:latest\nCOPY hello.txt /home/user/\n"
                                         "RUN echo built > /home/user/marker\n")
    name = f"cli-built-{os.getpid()}"
    p = cli("template", "build", name, "-f", str(tmp_path / "Dockerfile"), timeout=600)
    try:
        assert p.returncode == 0, p.stderr
        sid = cli("start", name, "--detach", "--timeout", "60").stdout.strip()
        try:
            r = cli("exec", sid, "--", "cat /home/user/hello.txt /home/user/marker")
            assert r.stdout == "copied by the cli build\nbuilt\n"
        finally:
            cli("rm", sid)
    finally:
        cli("template", "rm", name)


def test_template_build_and_import_not_supported(tmp_path):
    """Against a server without the template endpoints (a stub answering 404)."""
    import http.server
    import threading

    class NotFoundHandler(http.server.BaseHTTPRequestHandler):
        def _404(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            body = b'{"code":404,"message":"Not Found"}'
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _404

        def log_message(self, *a):
            pass

    stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFoundHandler)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    env = {**os.environ, "FORKYARD_URL": f"http://127.0.0.1:{stub.server_address[1]}", "E2B_API_KEY": "e2b_x"}
    try:
        (tmp_path / "Dockerfile").write_text("FROM e2bdev/base:latest\nRUN true\n")
        (tmp_path / "img.tar").write_bytes(b"x" * 100)
        for args in (["build", "mine", "-f", str(tmp_path / "Dockerfile")], ["import", "mine", str(tmp_path / "img.tar")]):
            p = cli("template", *args, env=env)
            assert p.returncode == 1 and "not supported by this server" in p.stderr, p.stderr
    finally:
        stub.shutdown()


def test_rm_alias_kill(server):
    sid = cli("start", "--detach", "--timeout", "60").stdout.strip()
    p = cli("kill", sid, "--json")
    assert p.returncode == 0 and json.loads(p.stdout) == [{"sandboxID": sid, "ok": True}]
    assert _gone(server, sid)


# -- interactive shell through a real PTY ----------------------------------------------------

class Term:
    """The CLI on the slave side of a fresh PTY; the test types on the master side."""

    def __init__(self, *args: str, rows: int = 40, cols: int = 120):
        self.master, self.slave = os.openpty()
        self.set_size(rows, cols)
        self.attrs_before = termios.tcgetattr(self.slave)
        self.proc = subprocess.Popen([*CLI, *args], stdin=self.slave, stdout=self.slave, stderr=self.slave,
                                     start_new_session=True)
        self.buf = b""

    def set_size(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.master, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def _pump(self, wait: float) -> None:
        r, _, _ = select.select([self.master], [], [], wait)
        if r:
            try:
                self.buf += os.read(self.master, 65536)
            except OSError:  # EIO: every slave user exited
                time.sleep(wait)

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.time() + timeout
        rx = re.compile(pattern.encode())
        while time.time() < deadline:
            m = rx.search(self.buf)
            if m:
                self.buf = self.buf[m.end():]
                return m
            self._pump(0.2)
        raise AssertionError(f"{pattern!r} not seen; output so far: {self.buf[-2000:]!r}")

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def wait(self, timeout: float = 120) -> int:
        deadline = time.time() + timeout
        while self.proc.poll() is None and time.time() < deadline:
            self._pump(0.2)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        os.close(self.slave)


def test_start_attaches_shell_and_kills_on_exit(server):
    t = Term("start", "base", "--timeout", "120", rows=33, cols=97)
    try:
        sid = t.expect(r"sandbox ([a-z0-9]+)").group(1).decode()
        t.expect(r"\$ ")  # the prompt
        t.type("stty size; echo h''i; exit 3\r")
        t.expect(r"33 97")
        t.expect(r"\bhi\b")
        assert t.wait() == 3
        assert termios.tcgetattr(t.slave) == t.attrs_before  # raw mode undone
    finally:
        t.close()
    assert _gone(server, sid)  # started without --keep: killed with the shell


def test_connect_resumes_forwards_ctrl_c_and_resizes(server):
    sid = cli("start", "--detach", "--timeout", "300").stdout.strip()
    try:
        assert cli("pause", sid).returncode == 0
        t = Term("connect", sid, rows=30, cols=100)
        try:
            t.expect(r"\$ ")
            t.type("sleep 600\r")
            time.sleep(1)
            t.type("\x03")  # Ctrl-C interrupts the remote sleep, not the CLI
            t.expect(r"\$ ")
            assert t.proc.poll() is None
            t.set_size(45, 150)
            t.proc.send_signal(signal.SIGWINCH)
            time.sleep(1)
            t.type("stty size; echo $((40+2)); exit 3\r")
            t.expect(r"45 150")
            t.expect(r"\b42\b")
            assert t.wait() == 3
            assert termios.tcgetattr(t.slave) == t.attrs_before
        finally:
            t.close()
        assert cli_json("info", sid)["state"] == "running"  # connect resumed it and left it running
    finally:
        cli("rm", sid)


def test_top_and_ls_tables_fit_80_columns():
    """`forkyard top` and `ls` tables at 80 columns: no cell wraps, ids and sizes stay
    whole; the template and the last column shrink with an ellipsis."""
    from rich.console import Console

    from forkyard.cli._common import fitted_table
    from forkyard.cli.top import render

    ids = [f"i{n}k4d2n5qx8z0abcdef" for n in range(3)]
    data = {"nodes": {"nodes": [{"nodeID": "node-eu-west-1a-17", "status": "up", "heartbeatAge": 0.4,
                                 "report": {"running": 3, "paused": 0, "max_sandboxes": 40, "vcpus_reserved": 6,
                                            "vcpus": 16, "load1": 1.25}}]},
            "sandboxes": [{"sandboxID": i, "templateID": "code-interpreter-v1", "state": "running",
                           "startedAt": "2026-12-01T10:00:00Z", "cpuCount": 2,
                           "usage": {"cpuUsedPct": 12.5, "memUsed": 300 << 20, "memTotal": 512 << 20},
                           "metadata": {"forkyard.parentSandboxID": ids[0]}} for i in ids]}
    ls = fitted_table(["ID", "TEMPLATE", "STATE", "STARTED", "EXPIRES", "CPU", "MEM", "METADATA"],
                      [[i, "code-interpreter-v1", "[green]running[/green]", "12m ago", "in 4m", "2", "512 MiB",
                        "suite=cli user=alice"] for i in ids], flexible=("TEMPLATE", "METADATA"), width=80)
    for shown in (render(data, "cpu", "http://127.0.0.1:3000", width=80), ls):
        con = Console(width=80, record=True, force_terminal=False)
        con.print(shown)
        lines = con.export_text().splitlines()
        assert all(len(line) <= 80 for line in lines), lines
        for i in ids:
            assert sum(line.startswith(i + " ") for line in lines) == 1, lines
        assert any("512 MiB" in line or "300.0 MiB/512.0 MiB" in line for line in lines), lines
        assert any(line.startswith("ID ") and (" VCPU " in line or " CPU " in line) for line in lines), lines
