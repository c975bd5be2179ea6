"""The node's package cache (``FORKYARD_PACKAGE_CACHE=on``, forkyard/pkgcache; beyond
E2B): ``pip``, ``npm`` and ``apt`` in real ``base`` sandboxes, created through the e2b
SDK, fetch through the node's proxpi and squid, which fetch from the real PyPI, npm
registry and Debian archive (this host reaches them; sandboxes do not). A first install
downloads from upstream; the same install in a second sandbox is served from the cache
(proxpi's log of its downloads, squid's access log). Through the cache nothing off its
allowlist is reachable, a deny-all sandbox reaches nothing, and with the cache off (the
default) nothing listens and sandboxes are configured as before. Downloads: a few
hundred KB of packages and Debian's bookworm indexes (~10 MB).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest
from e2b import Sandbox, Template

from _slot import SLOT

pytestmark = pytest.mark.timeout(900)

#: This session's cache address (tests/_slot.py: sessions on one host must not share it).
ADDR = f"169.254.{100 + SLOT}.1"
PYPI, APT, NPM = 3141, 3142, 4873
PIP_CONF = "/etc/xdg/pip/pip.conf"
APT_CONF = "/etc/apt/apt.conf.d/90forkyard-package-cache"
FILES = [PIP_CONF, "/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc", APT_CONF]
#: What the first install fetches: a pure wheel and a compiled one (cp311, manylinux).
WHEELS = ("six==1.17.0", "markupsafe==3.0.2")
NPM_PACKAGE = "is-number@7.0.0"
DEB = "sl"
#: The template TestPackageCache builds with the cache on.
BUILT = f"pkgcache-build-{SLOT}"


def _sh(sbx, cmd: str, user: str = "user", timeout: int = 300):
    """Run ``cmd``; returns (exit code, stdout+stderr) without raising on a non-zero exit."""
    from e2b.sandbox.commands.command_handle import CommandExitException

    try:
        r = sbx.commands.run(cmd, user=user, timeout=timeout)
        return r.exit_code, r.stdout + r.stderr
    except CommandExitException as e:
        return e.exit_code, e.stdout + e.stderr


def _timed(sbx, cmd: str, user: str = "user") -> float:
    t0 = time.monotonic()
    rc, out = _sh(sbx, cmd, user=user)
    assert rc == 0, out[-2000:]
    return time.monotonic() - t0


def _on_lo() -> list[str]:
    return subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", "lo"], capture_output=True, text=True).stdout


def _listening(port: int) -> bool:
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
    return ADDR in out


def _node(server) -> dict:
    with server.api() as c:
        return c.get("/metrics/node").json()


def test_off_by_default_nothing_listens_sandboxes_as_before(server):
    """With the cache off (the default): no cache address on the host, nothing listens on
    the cache's ports, and a sandbox gets none of the cache's files."""
    assert _node(server)["packageCache"] is None
    assert ADDR not in _on_lo()
    assert not any(_listening(p) for p in (PYPI, APT, NPM))
    sbx = Sandbox.create("base", timeout=120)
    try:
        rc, out = _sh(sbx, "ls " + " ".join(FILES) + " 2>&1; pip config list", user="root")
        assert out.count("No such file") == len(FILES), out
        assert "index-url" not in out
    finally:
        sbx.kill()


@pytest.fixture(scope="class")
def cache_on(server):
    """The session server restarted with the package cache on (a 512 MiB bound) until
    the class's tests are done; then restarted without it, and checked to have left
    no cache process nor its address behind."""
    # A warm pool of one: the first sandbox is a hand-out, later ones cold creates (both
    # are pointed at the cache).
    env = dict(FORKYARD_PACKAGE_CACHE="on", FORKYARD_PACKAGE_CACHE_ADDR=ADDR, FORKYARD_PACKAGE_CACHE_MB="512",
               FORKYARD_POOL="base:1")
    with server.restarted_with(**env):
        deadline = time.time() + 90
        while True:
            node = _node(server)
            pc = node["packageCache"]
            if all(s["ready"] for s in pc["services"].values()) and node["pool"]["base"]["ready"] >= 1:
                break
            assert time.time() < deadline, pc
            time.sleep(0.5)
        yield server, Path(pc["dir"])
        groups = [s["pid"] for s in _node(server)["packageCache"]["services"].values()]
    # every process of each server's group (gunicorn's worker too) is gone with the server
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit() and _pgid(p) in groups]
    assert not left, f"cache processes outlived their server: {left}"
    assert ADDR not in _on_lo()


def _pgid(proc: Path) -> int | None:
    try:
        return int((proc / "stat").read_text().rpartition(")")[2].split()[2])
    except (OSError, IndexError, ValueError):
        return None


def _log(root: Path, name: str) -> str:
    return (root / "logs" / f"{name}.log").read_text(errors="replace")


def _upstream_bytes(lines: list[str]) -> int:
    """Bytes squid fetched from upstream for these access-log lines (those it answered
    from its cache have hierarchy code HIER_NONE)."""
    return sum(int(line.split()[4]) for line in lines if "HIER_DIRECT" in line or "FIRSTUP_PARENT" in line)


@pytest.mark.usefixtures("cache_on")
class TestPackageCache:
    figures: dict[str, float] = {}

    def test_service_files_private(self, cache_on):
        """The cache's directory is 0700 (root's), each service's 0700 (its account's),
        its logs 0600; its services listen on the cache's address only."""
        _, root = cache_on
        assert root.stat().st_mode & 0o777 == 0o700
        for name in ("pypi", "squid", "logs"):
            assert (root / name).stat().st_mode & 0o777 == 0o700
        for f in (root / "logs").iterdir():
            assert f.stat().st_mode & 0o777 == 0o600, f
        for port in (PYPI, APT, NPM):
            out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True).stdout
            assert out.strip() and all(ADDR in line for line in out.strip().splitlines()), out

    def test_pip_first_then_cached(self, cache_on):
        """pip in a sandbox installs a pure and a compiled wheel through the cache (one
        upstream download each); a second sandbox's install downloads nothing."""
        _, root = cache_on
        cmd = f"pip install --no-cache-dir --target /tmp/t {' '.join(WHEELS)} && PYTHONPATH=/tmp/t python3 -c " \
              "'import six, markupsafe; print(markupsafe.escape(\"<x>\"))'"
        a = Sandbox.create("base", timeout=300)
        try:
            assert _node(cache_on[0])["pool"]["base"]["hits"] == 1  # a pooled sandbox's hand-out
            rc, conf = _sh(a, f"cat {PIP_CONF}")
            assert rc == 0 and f"http://{ADDR}:{PYPI}/index/" in conf
            self.figures["pip first"] = _timed(a, cmd)
        finally:
            a.kill()
        log = _log(root, "pypi")
        downloads = re.findall(r"Downloading '(https://[^']+)'", log)
        for wheel in ("six-1.17.0-py2.py3-none-any.whl", "markupsafe-3.0.2-cp311-cp311-manylinux"):  # any case
            assert sum(wheel in u.lower() for u in downloads) == 1, downloads
        files = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (root / "pypi" / "files").rglob("*.whl")}
        assert len(files) == 2, files
        b = Sandbox.create("base", timeout=300)
        try:
            self.figures["pip cached"] = _timed(b, cmd)
        finally:
            b.kill()
        assert re.findall(r"Downloading '(https://[^']+)'", _log(root, "pypi")) == downloads  # nothing new
        assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in (root / "pypi" / "files").rglob("*.whl")} == files

    def test_npm_first_then_cached(self, cache_on):
        """npm in a sandbox installs a package through the cache; in a second sandbox its
        tarball and metadata come from the cache (squid: HIT, no upstream fetch)."""
        _, root = cache_on
        cmd = f"mkdir -p /tmp/n && cd /tmp/n && npm install --no-audit --no-fund --no-update-notifier {NPM_PACKAGE} " \
              "&& node -e 'console.log(require(\"is-number\")(5))'"
        tgz = "/is-number/-/is-number-7.0.0.tgz"
        a = Sandbox.create("base", timeout=300)
        try:
            self.figures["npm first"] = _timed(a, cmd)
        finally:
            a.kill()
        first = [line for line in _log(root, "squid").splitlines() if tgz in line]
        assert len(first) == 1 and "TCP_MISS/200" in first[0] and "FIRSTUP_PARENT" in first[0], first
        b = Sandbox.create("base", timeout=300)
        try:
            self.figures["npm cached"] = _timed(b, cmd)
        finally:
            b.kill()
        lines = _log(root, "squid").splitlines()
        second = [line for line in lines if tgz in line][1:]
        assert len(second) == 1 and "HIT/200" in second[0] and "HIER_NONE" in second[0], second
        meta = [line for line in lines if re.search(r" http://registry\.npmjs\.org/is-number ", line)]
        assert len(meta) == 2 and "HIER_NONE" in meta[1], meta

    def test_apt_first_then_cached(self, cache_on):
        """apt-get update + install of a small package in a sandbox through the cache; a
        second sandbox's gets the package and the package lists from the cache."""
        _, root = cache_on
        cmd = f"apt-get update -qq -o Acquire::Languages=none && " \
              f"DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends {DEB} && /usr/games/sl -h; " \
              f"test -x /usr/games/sl"
        a = Sandbox.create("base", timeout=300)
        try:
            rc, conf = _sh(a, f"cat {APT_CONF}")
            assert rc == 0 and f"http://{ADDR}:{APT}/" in conf
            self.figures["apt first"] = _timed(a, cmd, user="root")
        finally:
            a.kill()
        n = len(_log(root, "squid").splitlines())
        self.figures["apt first, MB from upstream"] = _upstream_bytes(
            [line for line in _log(root, "squid").splitlines() if " http://deb.debian.org/" in line]) / 1e6
        debs = [line for line in _log(root, "squid").splitlines() if f"/{DEB}_" in line and ".deb" in line]
        assert len(debs) == 1 and "TCP_MISS/200" in debs[0], debs
        b = Sandbox.create("base", timeout=300)
        try:
            self.figures["apt cached"] = _timed(b, cmd, user="root")
        finally:
            b.kill()
        second = _log(root, "squid").splitlines()[n:]
        self.figures["apt cached, MB from upstream"] = _upstream_bytes(second) / 1e6
        fetched = [line for line in second if ("/by-hash/" in line or ".deb " in line) and "HIER_DIRECT" in line]
        assert not fetched, fetched  # package lists and the package: no upstream download
        assert any(f"/{DEB}_" in line and "HIT/200" in line for line in second), second

    def test_allowlist(self, cache_on):
        """Through the cache nothing off its allowlist is reachable (another host, an
        address on the host's network, loopback, CONNECT, another port); no other port
        of the host is reachable at the cache's address; sandboxes still cannot reach
        PyPI directly; a deny-all sandbox reaches nothing, one allowed the cache's
        address reaches it."""
        server, root = cache_on
        api_port = server.port
        # a host service on every address: reachable from the host, not from sandboxes
        lsock = socket.create_server(("0.0.0.0", 0))
        other = lsock.getsockname()[1]
        threading.Thread(target=lambda: [c.close() for c in iter(lambda: lsock.accept()[0], None)],
                         daemon=True).start()
        sbx = Sandbox.create("base", timeout=300)
        try:
            def code(args: str) -> str:
                rc, out = _sh(sbx, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 10 {args}")
                return out.strip()

            apt = f"-x http://{ADDR}:{APT}"
            assert code(f"{apt} http://deb.debian.org/debian/dists/bookworm/Release") == "200"
            assert code(f"{apt} http://example.com/") == "403"
            assert code(f"{apt} http://127.0.0.1:{api_port}/health") == "403"
            assert code(f"{apt} http://10.0.0.1/") == "403"
            assert code(f"{apt} http://{ADDR}:{PYPI}/health") == "403"
            assert code(f"{apt} http://deb.debian.org:8080/debian/") == "403"
            rc, out = _sh(sbx, f"curl -s --max-time 10 {apt} https://pypi.org/simple/six/")
            assert rc != 0  # CONNECT refused
            # the npm port only ever goes to the registry, whatever the request names
            npm = f"http://{ADDR}:{NPM}"
            before = len(_log(root, "squid").splitlines())
            code(f"-x {npm} http://127.0.0.1:{api_port}/health")
            code(f"-x {npm} http://example.com/")
            assert code(f"-H 'Host: 127.0.0.1:{api_port}' {npm}/is-number") == "200"
            lines = _log(root, "squid").splitlines()[before:]
            assert len(lines) == 3 and all(" http://registry.npmjs.org/" in line for line in lines), lines
            # proxpi serves only files its index lists
            assert code(f"http://{ADDR}:{PYPI}/index/six/evil-1.0-py3-none-any.whl") == "404"
            assert code(f"http://{ADDR}:{PYPI}/index/six/") == "200"
            # another port at the cache's address: dropped (curl times out: 28)
            assert socket.create_connection((ADDR, other), timeout=5)  # the host reaches it
            rc, _ = _sh(sbx, f"curl -s --max-time 3 http://{ADDR}:{other}/")
            assert rc == 28
            rc, _ = _sh(sbx, f"curl -s --max-time 3 http://{ADDR}:{api_port}/health")
            assert rc == 28
            # PyPI directly: blocked as before (its addresses are in the blocked ranges here)
            rc, _ = _sh(sbx, "curl -s --max-time 5 https://pypi.org/simple/six/")
            assert rc != 0
        finally:
            sbx.kill()
            lsock.close()
        offline = Sandbox.create("base", timeout=120, allow_internet_access=False)
        try:
            rc, _ = _sh(offline, f"curl -s --max-time 3 http://{ADDR}:{PYPI}/health")
            assert rc == 28  # deny-all: the cache too
        finally:
            offline.kill()
        only = Sandbox.create("base", timeout=120, network={"allow_out": [f"{ADDR}/32"], "deny_out": ["0.0.0.0/0"]})
        try:
            rc, out = _sh(only, f"curl -s --max-time 10 http://{ADDR}:{PYPI}/health")
            assert rc == 0 and "success" in out
        finally:
            only.kill()

    def test_template_build_fetches_through_cache(self, cache_on):
        """A template build's steps fetch through the cache; the template keeps none of
        the cache's files (a sandbox made from it gets them at create, as every sandbox)."""
        name = BUILT
        logs: list = []
        Template.build(Template().from_template("base")
                       .run_cmd("pip install --no-cache-dir --target /home/user/t six==1.17.0")
                       .run_cmd(f"cat {PIP_CONF}"), name, on_build_logs=logs.append)
        text = "\n".join(str(getattr(e, "message", e)) for e in logs)
        assert "Removing the package cache's configuration" in text
        assert f"index-url = http://{ADDR}:{PYPI}/index/" in text
        sbx = Sandbox.create(name, timeout=120)
        try:
            rc, out = _sh(sbx, "ls /home/user/t/six.py && head -1 " + PIP_CONF)
            assert rc == 0 and "forkyard package cache" in out
        finally:
            sbx.kill()

    def test_a_service_that_dies_is_started_again(self, cache_on):
        """squid killed: the node says so in one log line and starts it again; sandboxes
        created meanwhile are not pointed at the services that are down."""
        server, root = cache_on
        pc = _node(server)["packageCache"]["services"]["squid"]
        os.kill(pc["pid"], 9)
        deadline = time.time() + 60
        while True:
            now = _node(server)["packageCache"]["services"]["squid"]
            if now["ready"] and now["starts"] == pc["starts"] + 1:
                break
            assert time.time() < deadline, now
            time.sleep(0.2)
        lines = [ln for ln in server.log.read_text(errors="replace").splitlines() if "package cache: squid stopped" in ln]
        assert lines and "starting it again" in lines[-1], lines

    def test_one_sandbox_cannot_take_every_connection(self, cache_on):
        """A sandbox holding many idle connections to the cache gets at most
        HostServices.max_conns (32) of them, the rest refused at once (squid holds a few
        thousand: one sandbox used to take them all and apt/npm stopped for everyone);
        the services still answer others."""
        server, _ = cache_on
        script = (f"import socket, resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (4096, 4096))\n"
                  f"held, refused = [], 0\nfor _ in range(200):\n"
                  f"    try:\n        held.append(socket.create_connection(('{ADDR}', {NPM}), timeout=5))\n"
                  f"    except ConnectionRefusedError:\n        refused += 1\n"
                  f"print(len(held), refused)\nimport time; time.sleep(30)\n")
        sbx = Sandbox.create("base", timeout=120)
        try:
            sbx.files.write("/tmp/hold.py", script)
            sbx.commands.run("python3 /tmp/hold.py > /tmp/hold.out 2>&1", user="root", background=True)
            deadline = time.time() + 60
            out = ""
            while not out.strip() and time.time() < deadline:
                time.sleep(0.5)
                out = _sh(sbx, "cat /tmp/hold.out", user="root")[1]
            held, refused = map(int, out.split())
            assert held == 32 and refused == 168, out
            # the host (and other sandboxes) are still served meanwhile
            r = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10", "-x",
                                f"http://{ADDR}:{APT}", "http://deb.debian.org/debian/dists/bookworm/Release"],
                               capture_output=True, text=True)
            assert r.stdout == "200", r
        finally:
            sbx.kill()

    def test_proxpi_refuses_writes_and_odd_names(self, cache_on):
        """proxpi behind forkyard's checks (forkyard/pkgcache/proxpi_app.py): a sandbox
        cannot drop its cached lists (DELETE /cache/...), a project's name is normalised
        (another spelling is not fetched and kept again: 2^n spellings of a big project
        filled the host's memory), '..' is no project (it fetched the index host's root)."""
        _, root = cache_on
        sbx = Sandbox.create("base", timeout=120)
        try:
            def code(args: str) -> str:
                _, out = _sh(sbx, f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 60 {args}")
                return out.strip()

            base = f"http://{ADDR}:{PYPI}"
            assert code(f"-X DELETE {base}/cache/list") == "405"
            assert code(f"-X DELETE {base}/cache/six") == "405"
            assert code(f"-X POST {base}/index/six/") == "405"
            assert code(f"--path-as-is {base}/index/../") == "404"
            assert code(f"--path-as-is {base}/index/six/..") == "404"
            assert code(f"{base}/") == "404"
            assert code(f"{base}/index/six/") == "200"
            for spelling in ("Six", "SIX", "sIx"):
                assert code(f"{base}/index/{spelling}/") == "200"
        finally:
            sbx.kill()
        fetched = re.findall(r"Refreshing '([^']+)'", _log(root, "pypi"))
        assert not {"Six", "SIX", "sIx", ".."} & set(fetched), fetched

    def test_figures(self, cache_on):
        """Report first vs cached install times (seconds; printed with -s)."""
        print({k: round(v, 2) for k, v in sorted(self.figures.items())})


def test_template_built_with_cache_keeps_none_of_it(server):
    """After the cache is turned off again: a sandbox from the template built through it
    has what the build installed and none of the cache's files."""
    sbx = Sandbox.create(BUILT, timeout=120)
    try:
        rc, out = _sh(sbx, "ls /home/user/t/six.py; ls " + " ".join(FILES) + " 2>&1", user="root")
        assert "/home/user/t/six.py" in out and out.count("No such file") == len(FILES), out
    finally:
        sbx.kill()
        with server.api() as c:
            c.delete(f"/templates/{BUILT}")


def test_apt_port_never_fetches_an_address_by_its_reverse_name():
    """squid's apt port allows hosts by name; an address in the request is refused even
    when its reverse name is a listed host (squid's dstdomain looked the address up by
    default, so a tenant who controls the PTR record of an address could make the cache
    fetch from it). A client's Authorization and Cookie headers are not sent upstream
    (the upstreams are anonymous, and the cache is shared). squid with the cache's
    configuration, in a network namespace of its own where a hosts file names
    192.0.2.77 deb.debian.org."""
    import shutil
    import tempfile

    from forkyard.config import PackageCacheSettings
    from forkyard.pkgcache import config as conf

    if shutil.which("squid") is None:
        pytest.skip("no squid")
    d = Path(tempfile.mkdtemp(prefix="pkrd"))  # squid's account (nobody) writes its logs there
    os.chmod(d, 0o777)
    text = conf.squid_conf("192.0.2.1", conf.check(PackageCacheSettings(address="192.0.2.1")), str(d / "spool"), 64)
    text = "\n".join(ln for ln in text.splitlines() if not ln.startswith(("cache_dir", "cache_log", "access_log")))
    (d / "hosts").write_text("192.0.2.77 deb.debian.org\n")
    (d / "squid.conf").write_text(text + f"\nhosts_file {d}/hosts\ncache_log {d}/cache.log\n"
                                  f"access_log {d}/access.log squid\ncache_effective_user nobody\n")
    for f in ("hosts", "squid.conf"):
        os.chmod(d / f, 0o644)
    ns = f"pkrd{SLOT}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    procs = []
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        for a in ("192.0.2.1/32", "192.0.2.77/32"):
            subprocess.run(["ip", "-n", ns, "addr", "add", a, "dev", "lo"], check=True)
        echo = ("import http.server as h\nclass E(h.BaseHTTPRequestHandler):\n def do_GET(self):\n"
                "  b = str(self.headers).encode()\n  self.send_response(200)\n"
                "  self.send_header('Cache-Control', 'no-store')\n  self.send_header('Content-Length', str(len(b)))\n"
                "  self.end_headers()\n  self.wfile.write(b)\nh.HTTPServer(('192.0.2.77', 80), E).serve_forever()\n")
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", echo],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, "squid", "-n", f"pkrd{SLOT}", "-N", "-f",
                                       str(d / "squid.conf")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

        def get(url: str, *args: str) -> str:
            return subprocess.run(["ip", "netns", "exec", ns, "curl", "-s", "-w", "%{http_code}", "--max-time", "10",
                                   "-x", "http://192.0.2.1:3142", *args, url], capture_output=True, text=True).stdout

        deadline = time.time() + 30
        while not get("http://deb.debian.org/x").endswith("200"):  # the listed name: fetched
            assert time.time() < deadline, (d / "cache.log").read_text(errors="replace")[-2000:]
            time.sleep(0.5)
        assert get("http://192.0.2.77/x").endswith("403")
        # and a client's credentials never go upstream (the upstream echoes the headers it got)
        seen = get("http://deb.debian.org/y", "-H", "Authorization: Bearer s3cret", "-H", "Cookie: c=s3cret",
                   "-H", "X-Other: kept")
        assert seen.endswith("200") and "X-Other: kept" in seen and "s3cret" not in seen, seen
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=20)
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(d, ignore_errors=True)


def test_missing_part_stops_the_server_with_one_line(tmp_path):
    """With the cache on and its squid missing the server does not start, and says what
    to do in one line."""
    import sys

    from conftest import free_port

    from _slot import LETTER

    env = dict(os.environ, FORKYARD_PACKAGE_CACHE="on", FORKYARD_SQUID=str(tmp_path / "no-squid"),
               FORKYARD_DATA_DIR=str(tmp_path / "data"), FORKYARD_PORT=str(free_port()),
               FORKYARD_NET_PREFIX=f"pk{LETTER}", FORKYARD_OUTER_NET=f"10.{112 + SLOT}.0.0/16",
               FORKYARD_API_KEY="e2b_" + "0" * 40)
    p = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if "squid" in ln]
    assert len(lines) == 1 and "package cache: squid not found" in lines[0] and "apt-get install" in lines[0], \
        p.stdout + p.stderr
