"""Template ``code-interpreter-v1`` (forkyard/templates/code_interpreter.py, the server in
forkyard/guest/code_interpreter/) through the unchanged ``e2b-code-interpreter`` SDKs:
PyPI 2.11 here, npm 2.8 in tests/ts/code_interpreter.mjs.

The template is built once per test session (``forkyard template add code-interpreter``'s
code path: wheels and Deno fetched on this host, kept under the test data root so later
sessions download nothing, then a build on ``base``), which takes a few minutes. Skipped
when this host cannot fetch the packages (no registry reachable)."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import TEST_ROOT

e2b_ci = pytest.importorskip("e2b_code_interpreter")
Sandbox = e2b_ci.Sandbox
TS = Path(__file__).parent / "ts"
#: The first test builds the template (minutes on these 2-core hosts).
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="session")
def code_interpreter(server) -> str:
    """Build ``code-interpreter-v1`` on the session server once; its name."""
    from e2b import Template

    from forkyard.templates import code_interpreter as ci

    root = TEST_ROOT / "code-interpreter-context"
    root.mkdir(parents=True, exist_ok=True)
    try:
        ci.prepare_context(root, log=lambda m: None)
    except ci.PrepareError as e:
        pytest.skip(f"cannot fetch the code interpreter's packages on this host: {e}")
    logs: list[str] = []
    try:
        Template.build(ci.make_template(root), ci.NAME, memory_mb=ci.MEMORY_MB,
                       on_build_logs=lambda entry: logs.append(str(getattr(entry, "message", entry))))
    except Exception as e:
        raise AssertionError(f"building {ci.NAME} failed: {e}\n" + "\n".join(logs[-40:])) from e
    return ci.NAME


def _fork(server, sid: str, count: int) -> list[str]:
    with server.api() as c:
        r = c.post(f"/sandboxes/{sid}/fork", json={"count": count, "timeout": 300})
    assert r.status_code == 201, r.text
    return [e["sandbox"]["sandboxID"] for e in r.json()]


def test_run_code_state_streams_errors_charts_and_javascript(code_interpreter):
    sbx = Sandbox.create(timeout=300)  # the SDK's default template: code-interpreter-v1
    try:
        sbx.run_code("x = 41")
        out: list[str] = []
        ex = sbx.run_code("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\nx + 1",
                          on_stdout=lambda m: out.append(m.line))
        assert ex.text == "42" and ex.error is None  # state kept between calls
        assert ex.logs.stdout == ["to out\n"] and ex.logs.stderr == ["to err\n"] and out == ["to out\n"]
        assert ex.execution_count == 2

        ex = sbx.run_code("def f():\n    raise ValueError('bad value')\nf()")
        assert ex.error.name == "ValueError" and ex.error.value == "bad value"
        assert "f()" in ex.error.traceback and "ValueError" in ex.error.traceback

        ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [4, 5, 6])\n"
                          "plt.title('rising')\nplt.show()")
        [chart] = ex.results
        assert base64.b64decode(chart.png).startswith(b"\x89PNG")
        assert chart.chart.type.value == "line" and chart.chart.title == "rising"
        assert [p for p in chart.chart.elements[0].points] == [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)]

        ex = sbx.run_code("import os\nos.environ.get('ONLY_HERE'), os.getcwd(), os.getuid()",
                          envs={"ONLY_HERE": "yes"})
        assert ex.text == "('yes', '/home/user', 0)"  # as E2B: root in /home/user
        assert sbx.run_code("import os; os.environ.get('ONLY_HERE')").text is None  # for that run only

        js = sbx.run_code("const xs: number[] = [1, 2, 3];\nconsole.log('js says', xs.length);\n"
                          "xs.map(v => v * 2)", language="ts")
        assert js.logs.stdout == ["js says 3\n"] and js.text == "[ 2, 4, 6 ]"
        assert sbx.run_code("xs.length", language="ts").text == "3"  # the default TypeScript context
        # javascript's default context is another kernel (as on E2B: one default per language)
        assert sbx.run_code("typeof xs", language="javascript").text == "undefined"
    finally:
        sbx.kill()


def test_contexts_and_timeout(code_interpreter):
    sbx = Sandbox.create(timeout=300)
    try:
        ctx = sbx.create_code_context(cwd="/tmp")
        assert ctx.language == "python" and ctx.cwd == "/tmp"
        sbx.run_code("y = 'in ctx'", context=ctx)
        assert sbx.run_code("import os; (y, os.getcwd())", context=ctx).text == "('in ctx', '/tmp')"
        assert sbx.run_code("'y' in globals()").text == "False"  # the default context is another kernel
        js = sbx.create_code_context(language="javascript")
        assert sbx.run_code("1 + 1", context=js).text == "2"
        listed = {c.id: c.language for c in sbx.list_code_contexts()}
        assert listed[ctx.id] == "python" and listed[js.id] == "javascript"
        assert sorted(listed.values()).count("python") == 2  # the default contexts are listed too
        sbx.remove_code_context(ctx)
        sbx.remove_code_context(js.id)
        assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
        with pytest.raises(Exception):
            sbx.run_code("1", context=ctx)

        t0 = time.monotonic()
        with pytest.raises(e2b_ci.TimeoutException):
            sbx.run_code("import time\ntime.sleep(60)", timeout=3)
        assert time.monotonic() - t0 < 20
        # The abandoned cell was interrupted: the kernel answers at once, state intact.
        t0 = time.monotonic()
        assert sbx.run_code("1 + 2").text == "3"
        assert time.monotonic() - t0 < 10
    finally:
        sbx.kill()


def test_pause_resume_and_fork_keep_the_kernels(code_interpreter, server):
    sbx = Sandbox.create(timeout=300)
    children: list[str] = []
    try:
        sbx.run_code("import numpy as np\nstate = np.arange(5)")
        sbx.run_code("let counter = 7;", language="js")
        assert sbx.pause() is True
        same = Sandbox.connect(sbx.sandbox_id, timeout=300)  # resumes, memory and all
        assert same.run_code("int(state.sum())").text == "10"
        assert same.run_code("counter", language="js").text == "7"
        children = _fork(server, sbx.sandbox_id, 2)
        for i, cid in enumerate(children):
            child = Sandbox.connect(cid)
            assert child.run_code(f"state = state + {i}\nint(state.sum())").text == str(10 + 5 * i)
            assert child.run_code("counter", language="js").text == "7"
        assert same.run_code("int(state.sum())").text == "10"  # children changed only themselves
    finally:
        for cid in children:
            Sandbox.kill(cid)
        sbx.kill()


def test_filesystem_only_pause_is_refused_and_the_interpreter_keeps_running(code_interpreter, server):
    """A filesystem-only pause of a code-interpreter sandbox is refused (409; the SDK's
    ``pause`` answers False): the template's own files (its venv and Deno, installed over
    ``base``) count as changed files and are more than a filesystem image may hold. The
    sandbox keeps running and the kernels keep their state; a pause with memory works."""
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.run_code("v = 'still here'")
        with server.api() as c:
            r = c.post(f"/sandboxes/{sbx.sandbox_id}/pause", json={"memory": False})
        assert r.status_code == 409 and "pause with memory instead" in r.text, r.text
        assert sbx.pause(keep_memory=False) is False
        assert sbx.is_running()
        assert sbx.run_code("v").text == "still here"
    finally:
        sbx.kill()


def test_bad_requests_get_clear_4xx(code_interpreter):
    sbx = Sandbox.create(timeout=300)
    try:
        url, headers = sbx._jupyter_url, {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
        # Only the sandbox's access token runs code (stricter than E2B's server: anyone who
        # knows the id reaches the port through the proxy); /contexts and /health stay
        # open as on E2B (the SDKs send no token there).
        assert sbx._envd_access_token
        for token in (None, "not-" + sbx._envd_access_token):
            bad = {**headers, **({"X-Access-Token": token} if token else {})}
            r = httpx.post(f"{url}/execute", json={"code": "open('/tmp/pwned', 'w')"}, headers=bad)
            assert r.status_code == 401 and "access token" in r.json()["message"], (token, r.status_code, r.text)
            assert httpx.post(f"{url}/execute/", json={"code": "1"}, headers=bad).status_code in (401, 404)
        assert httpx.get(f"{url}/health", headers=headers).status_code == 200
        assert not sbx.files.exists("/tmp/pwned")
        headers["X-Access-Token"] = sbx._envd_access_token
        r = httpx.post(f"{url}/execute", json={"code": "1", "language": "cobol"}, headers=headers)
        assert r.status_code == 400 and "cobol" in r.text
        r = httpx.post(f"{url}/execute", json={"code": "1", "language": "python", "context_id": "x"}, headers=headers)
        assert r.status_code == 400
        r = httpx.post(f"{url}/execute", json={"code": 5}, headers=headers)
        assert r.status_code == 400 and "code" in r.text
        r = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "nope"}, headers=headers)
        assert r.status_code == 404
    finally:
        sbx.kill()


@pytest.mark.skipif(shutil.which("node") is None or not (TS / "node_modules" / "@e2b" / "code-interpreter").is_dir(),
                    reason="node or tests/ts/node_modules/@e2b/code-interpreter missing (npm ci --prefix tests/ts)")
def test_npm_sdk_smoke(code_interpreter):
    p = subprocess.run(["node", "code_interpreter.mjs"], cwd=TS, env=dict(os.environ), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"ok": True}


def test_the_package_cache_is_private(code_interpreter):
    """The downloads, the build context and the inputs stamp that ``prepare_context``
    keeps (here the session's cache, reused or filled) are the user's own: directories
    0700, files 0600 — nothing in them for other local users."""
    import stat

    root = TEST_ROOT / "code-interpreter-context"
    open_to_others = [str(p) for p in [root, *root.rglob("*")]
                      if not p.is_symlink() and stat.S_IMODE(p.lstat().st_mode) & 0o077]
    assert open_to_others == []


def test_cli_add_refuses_what_it_cannot_build(tmp_path):
    """``forkyard template add``: an unknown name, and a host without npm, fail with a
    message (exit 1, no traceback) before anything is downloaded or built."""
    import sys

    cli = [sys.executable, "-m", "forkyard.cli.main", "template", "add"]
    p = subprocess.run([*cli, "nope"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "unknown template 'nope'" in p.stderr and "code-interpreter" in p.stderr
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # python, but no npm
    p = subprocess.run([*cli, "code-interpreter", "--cache-dir", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert p.returncode == 1 and "npm is not installed" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and not any(tmp_path.iterdir())


@pytest.mark.parametrize("spec", ["evil @ file:///tmp/evil", "evil @ https://example.com/evil-1.0.tar.gz",
                                  "--index-url http://127.0.0.1:1/simple", "scipy\n--trusted-host x", "./pkgdir"])
def test_pip_extras_are_index_packages_only(tmp_path, spec):
    """`template add code-interpreter --pip X`: X becomes a line of the requirements file
    pip reads on this host, where a URL or directory would be built (its setup.py run as
    the CLI's user) and an option line would change the index: refused before anything
    is fetched or written (attack review)."""
    from forkyard.templates import code_interpreter as ci

    with pytest.raises(ci.PrepareError, match="--pip"):
        ci.prepare_context(tmp_path, [spec], log=lambda m: None)
    assert not (tmp_path / "code-interpreter").exists()
