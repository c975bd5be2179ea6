"""Issue 18 item 5: what an agent does in a ``base`` sandbox works, through the real e2b SDK.

``workload.sh`` (next to this file) is the work, one step per kind: C programs (dynamic
and static) run from ``~`` and ``/usr/local/bin``, copied binaries and an image file
hard-linked into ``/usr/local/bin``, a ``.so`` through ctypes, ``make -j2``, a Python C
extension, a venv (copied binaries) with ``pip install`` of a pure and a compiled wheel
from a package index, an npm package from a tarball, git on a 2,000-file repo cloned
from ``/tmp`` to ``~``, shebang scripts, a 200 MiB file in ``/tmp`` moved and linked to
``~``, sqlite, multiprocessing, and HTTP servers on ``0.0.0.0``, ``::``, ``127.0.0.1``,
``localhost`` and ``::1`` (reached here through the proxy and ``get_host``). Plus one
command with 50 MB of output.

The script runs in one sandbox, again in it after a pause/resume, and in a fork child;
each time the programs, venv and packages made by the runs before still work, and every
server started before still answers. It also runs natively, meanwhile, in a host chroot
of the same template rootfs (the last test checks it passed there), so a failure in a
sandbox is forkyard's, not the script's.

Sandboxes cannot reach package registries here, so the test serves its own: the wheels
and the npm tarball are built in the chroot, and a PEP 503 index with them is served
from its own network namespace on a TEST-NET-3 address (203.0.113.0/24), which a
forkyard server started for this module lets its sandboxes reach (the default egress
rules block documentation ranges).
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

import _chroot
import conftest

HERE = Path(__file__).parent
SCRIPT = (HERE / "workload.sh").read_text()
_N = conftest.SLOT
#: This session's /29 of TEST-NET-3: host side .1, the package index .2.
SUBNET = ipaddress.ip_network(f"203.0.113.{8 * _N}/29")
HOST_SIDE, INDEX_IP = str(SUBNET[1]), str(SUBNET[2])
INDEX_NS, INDEX_IF = f"fywl{_N}", f"fywl{_N}h"
INDEX = f"http://{INDEX_IP}"
#: Network slots of this module's server (tests/_slot.py lists every range).
PREFIX, OUTER = conftest.NET_PREFIX + "w", f"10.213.{16 * _N}.0/20"
ADDRESSES = ["0.0.0.0", "::", "127.0.0.1", "localhost", "::1"]
STEPS = ["c_programs", "copied_binaries", "shared_library", "make_project", "c_extension", "venv_pip",
         "npm_package", "git_repo", "shebang_scripts", "tmp_on_disk", "sqlite", "multiprocessing", "servers"]
BIG_OUTPUT = "head -c 50000000 /dev/zero | tr '\\0' x"
#: What the programs made by run TAG still do (run in later sandboxes: they must still work).
STILL_WORKS = ("cd ~/wl-{t} && ./hello x && ./hello-static x && wl-hello-{t} x && wl-hello-static-{t} x && "
               "echo linked | gzip | wl-gz-{t} -d && proj/sum && python3 -c 'import wlspam' && "
               "venv/bin/python -c 'import wlpure, wlcext; print(wlcext.twice(1))' && "
               "(cd npmproj && node -e 'require(\"wl-pkg\")') && ./s.py && git -C clone log --oneline | wc -l")

ARTIFACTS = r"""
set -e
mkdir -p ~/out ~/src/wlpure/wlpure ~/src/wlcext ~/src/wl-pkg && cd ~/src
printf 'def answer():\n    return 42\n' > wlpure/wlpure/__init__.py
printf '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n[project]\nname = "wlpure"\nversion = "1.0"\n' > wlpure/pyproject.toml
cat > wlcext/wlcext.c <<'EOF'
#include <Python.h>
static PyObject *twice(PyObject *self, PyObject *args) {
  long n; if (!PyArg_ParseTuple(args, "l", &n)) return NULL; return PyLong_FromLong(2 * n);
}
static PyMethodDef methods[] = {{"twice", twice, METH_VARARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "wlcext", NULL, -1, methods};
PyMODINIT_FUNC PyInit_wlcext(void) { return PyModule_Create(&mod); }
EOF
printf 'from setuptools import setup, Extension\nsetup(name="wlcext", version="1.0", ext_modules=[Extension("wlcext", ["wlcext.c"])])\n' > wlcext/setup.py
for p in wlpure wlcext; do PIP_NO_INDEX=1 pip wheel -q --no-deps --no-build-isolation -w ~/out "./$p"; done
cd wl-pkg
printf '{"name": "wl-pkg", "version": "1.0.0", "main": "index.js", "bin": {"wl-pkg": "bin.js"}}\n' > package.json
printf 'exports.answer = () => 42;\n' > index.js
printf '#!/usr/bin/env node\nconsole.log("wl-pkg " + require("./index.js").answer());\n' > bin.js
npm pack --silent --pack-destination ~/out >/dev/null
ls ~/out
"""


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def rootfs(base_template) -> Path:
    return base_template


@pytest.fixture(scope="module")
def index_dir(rootfs, tmp_path_factory) -> Path:
    """A PEP 503 index (``simple/``) and ``files/`` with the wheels and npm tarball,
    built in a chroot of the template (its Python and npm)."""
    scratch = tmp_path_factory.mktemp("wl-build")
    r = _chroot.run(rootfs, scratch / "fs", ARTIFACTS, {}, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    built = scratch / "fs/upper/home/user/out"
    www = tmp_path_factory.mktemp("wl-index")
    (www / "files").mkdir()
    for f in built.iterdir():
        shutil.copy(f, www / "files" / f.name)
    names = sorted(f.name for f in (www / "files").iterdir())
    assert any(n.startswith("wlpure-1.0-py3") for n in names) and any(n.startswith("wlcext-1.0-cp3") for n in names) \
        and "wl-pkg-1.0.0.tgz" in names, names
    for project in ("wlpure", "wlcext"):
        page = www / "simple" / project / "index.html"
        page.parent.mkdir(parents=True)
        page.write_text("".join(f'<a href="../../files/{n}">{n}</a>\n' for n in names if n.startswith(project + "-")))
    (www / "simple/index.html").write_text('<a href="wlpure/">wlpure</a>\n<a href="wlcext/">wlcext</a>\n')
    shutil.rmtree(scratch, ignore_errors=True)
    return www


@pytest.fixture(scope="module")
def index(index_dir):
    """The index served on INDEX_IP:80 in netns INDEX_NS, routed from the host."""
    _sh("ip", "netns", "del", INDEX_NS, check=False)
    _sh("ip", "link", "del", INDEX_IF, check=False)
    _sh("ip", "netns", "add", INDEX_NS)
    proc = None
    try:
        _sh("ip", "link", "add", INDEX_IF, "type", "veth", "peer", "name", "eth0", "netns", INDEX_NS)
        _sh("ip", "addr", "add", f"{HOST_SIDE}/29", "dev", INDEX_IF)
        _sh("ip", "link", "set", INDEX_IF, "up")
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{INDEX_IP}/29", "dev", "eth0"],
                    ["ip", "link", "set", "eth0", "up"], ["ip", "route", "add", "default", "via", HOST_SIDE]):
            _sh("ip", "netns", "exec", INDEX_NS, *cmd)
        proc = subprocess.Popen(["ip", "netns", "exec", INDEX_NS, sys.executable, "-m", "http.server", "80",
                                 "--bind", INDEX_IP, "--directory", str(index_dir)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 20
        while _sh("curl", "-sf", "-m", "2", f"{INDEX}/simple/", check=False).returncode != 0:
            assert time.time() < deadline, "the package index did not come up"
            time.sleep(0.2)
        yield INDEX
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        _sh("ip", "link", "del", INDEX_IF, check=False)
        _sh("ip", "netns", "del", INDEX_NS, check=False)


@pytest.fixture(scope="module")
def native(rootfs, index, tmp_path_factory) -> concurrent.futures.Future:
    """The workload run natively in a chroot of the template, started in the background
    (the sandbox runs need not wait for it): a future of ``{step: ms}``."""
    scratch = tmp_path_factory.mktemp("wl-native")
    port = _free_ports(len(ADDRESSES))  # the host's network: servers bind its loopback

    def reference() -> dict[str, int]:
        r = _chroot.run(rootfs, scratch / "fs", SCRIPT,
                        {"WL_TAG": "native", "WL_INDEX": index, "WL_PORT": str(port)}, timeout=400)
        assert r.returncode == 0 and r.stdout.rstrip().endswith("all ok"), r.stdout + r.stderr
        big = _chroot.run(rootfs, scratch / "fs", BIG_OUTPUT, {}, timeout=60)
        assert len(big.stdout) == 50_000_000 and big.stdout.strip("x") == ""
        return _steps(r.stdout)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(reference)
        yield future
        try:
            future.result()  # done before the index goes away
        except BaseException:  # noqa: BLE001 — reported by the test that asks
            pass
    shutil.rmtree(scratch, ignore_errors=True)


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive TCP ports free on the host's wildcard addresses,
    below the ephemeral range (32768-, where outgoing connections take theirs)."""
    for _ in range(100):
        first = 20000 + secrets.randbelow(12000)
        try:
            for p in range(first, first + n):
                for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
                    with socket.socket(family) as s:
                        s.bind((addr, p))
            return first
        except OSError:
            continue
    raise AssertionError(f"no {n} free consecutive ports")


def _steps(out: str) -> dict[str, int]:
    return {w[1]: int(w[2]) for w in (line.split() for line in out.splitlines()) if len(w) == 3 and w[0] == "ok"}


@pytest.fixture(scope="module")
def wl_server(base_template, index, tmp_path_factory):
    """A forkyard server whose sandboxes may reach the index's /29 (and nothing else of
    the documentation ranges); the e2b SDK is pointed at it for the module."""
    from forkyard.network.firewall import BLOCKED_EGRESS
    from forkyard.network.slots import NetnsNetwork

    blocked = []
    for net in map(ipaddress.ip_network, BLOCKED_EGRESS):
        blocked += [str(n) for n in net.address_exclude(SUBNET)] if SUBNET.subnet_of(net) else [str(net)]

    class WorkloadServer(conftest.ServerProc):
        def env(self):
            return {**super().env(), "FORKYARD_NET_PREFIX": PREFIX, "FORKYARD_OUTER_NET": OUTER,
                    "FORKYARD_BLOCKED_EGRESS": ",".join(blocked)}

    srv = WorkloadServer(tmp_path_factory.mktemp("wl-server") / "data", conftest.TEST_ROOT / "templates")
    srv.data_dir.mkdir()
    srv.start()
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    os.environ.update(E2B_API_URL=srv.url, E2B_SANDBOX_URL=srv.url, E2B_API_KEY=srv.api_key)
    try:
        yield srv
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            srv.kill_all()
        finally:
            srv.stop()
            conftest.stop_reaper(srv.data_dir / "runsc")
            NetnsNetwork(None, outer_net=OUTER, prefix=PREFIX).teardown_host()
        left = conftest.host_leftovers(srv.data_dir / "runsc")
        netns = _sh("ip", "netns", "list").stdout.split()
        assert left["runsc"] == [] and left["mounts"] == [] and not [n for n in netns if n.startswith(PREFIX)], left


class Run:
    """One sandbox the module's tests hand on: the sandbox and the runs made in it so far
    (``tag``, first server port)."""

    def __init__(self, sbx: Sandbox):
        self.sbx = sbx
        self.runs: list[tuple[str, int]] = []


@pytest.fixture(scope="module")
def shared(wl_server):
    """One sandbox for the module (kept across its tests; killed, with its fork, after)."""
    sbx = Sandbox.create("base", timeout=900)
    holder = Run(sbx)
    yield holder
    for s in {holder.sbx.sandbox_id, sbx.sandbox_id}:
        try:
            Sandbox.kill(s)
        except Exception:  # noqa: BLE001 — already gone
            pass


def _served(srv, sbx: Sandbox, port: int, address: str) -> None:
    """The server on ``port`` answers through the proxy at ``get_host(port)``."""
    host = sbx.get_host(port)
    deadline = time.time() + 15
    while True:
        try:
            r = httpx.get(f"http://127.0.0.1:{srv.port}/", headers={"Host": host}, timeout=5)
            if r.status_code == 200:
                assert r.text == f"served {address}\n", r.text
                return
        except httpx.HTTPError as e:
            r = e
        assert time.time() < deadline, f"server on {address}:{port} not reachable through the proxy: {r}"
        time.sleep(0.1)


def _command(sbx: Sandbox, cmd: str, **kwargs):
    """``commands.run`` that fails the test with the command's output when it exits
    non-zero (the SDK's exception message leaves stdout out)."""
    from e2b.sandbox.commands.command_handle import CommandExitException

    try:
        return sbx.commands.run(cmd, **kwargs)
    except CommandExitException as e:
        failed = e
    pytest.fail(f"{cmd!r} exited {failed.exit_code}:\n{failed.stdout}\n{failed.stderr}", pytrace=False)


def _run_workload(srv, holder: Run, sbx: Sandbox, index: str, tag: str, native: concurrent.futures.Future) -> None:
    """The whole workload in ``sbx``: every step passes, as natively; what earlier runs
    made still works and their servers still answer; then the new servers answer
    through the proxy and one command prints 50 MB."""
    for old, port in holder.runs:
        r = _command(sbx, STILL_WORKS.format(t=old), timeout=120)
        assert r.stdout.split()[-1] == "2", (old, r.stdout, r.stderr)
        for i, address in enumerate(ADDRESSES):
            _served(srv, sbx, port + i, address)
    port = 8100 + 10 * len(holder.runs)
    sbx.files.write("/home/user/workload.sh", SCRIPT)
    t0 = time.monotonic()
    r = _command(sbx, "bash ~/workload.sh", envs={"WL_TAG": tag, "WL_INDEX": index, "WL_PORT": str(port)},
                 timeout=600)
    took = time.monotonic() - t0
    steps = _steps(r.stdout)
    assert r.exit_code == 0 and r.stdout.rstrip().endswith("all ok") and list(steps) == STEPS, r.stdout + r.stderr
    ref = native.result() if native.done() and not native.exception() else {}
    print(f"\nrun {tag}: {took:.1f} s; step ms in the sandbox / natively: "
          + ", ".join(f"{k} {steps[k]}/{ref.get(k, '-')}" for k in STEPS))
    for i, address in enumerate(ADDRESSES):
        _served(srv, sbx, port + i, address)
    big = sbx.commands.run(BIG_OUTPUT, timeout=120)
    assert len(big.stdout) == 50_000_000 and big.stdout.strip("x") == ""
    holder.runs.append((tag, port))


@pytest.mark.timeout(900)
def test_the_workload_runs_in_a_sandbox(wl_server, shared, index, native):
    _run_workload(wl_server, shared, shared.sbx, index, "a", native)


@pytest.mark.timeout(900)
def test_the_workload_runs_after_a_pause_and_resume(wl_server, shared, index, native):
    if not shared.runs:
        pytest.skip("the first run failed")
    shared.sbx.pause()
    shared.sbx = Sandbox.connect(shared.sbx.sandbox_id, timeout=900)
    _run_workload(wl_server, shared, shared.sbx, index, "b", native)


@pytest.mark.timeout(900)
def test_the_workload_runs_in_a_fork_child(wl_server, shared, index, native):
    if not shared.runs:
        pytest.skip("the first run failed")
    kid = shared.sbx.fork(count=1, timeout=900)[0]
    try:
        child = Run(kid)
        child.runs = list(shared.runs)
        _run_workload(wl_server, child, kid, index, "c", native)
    finally:
        kid.kill()


@pytest.mark.timeout(600)
def test_the_workload_runs_natively(native):
    """The reference run in a chroot of the same rootfs passes every step."""
    assert list(native.result(timeout=500)) == STEPS
