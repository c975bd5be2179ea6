"""The node's package cache: two well-kept caching servers the node runs as supervised
child processes, for sandboxes only (:mod:`forkyard.pkgcache`).

* ``pypi``: proxpi (a PyPI caching mirror) under gunicorn, on
  :data:`~forkyard.pkgcache.config.PYPI_PORT`;
* ``squid``: squid, a reverse proxy of the npm registry on
  :data:`~forkyard.pkgcache.config.NPM_PORT` and a forward proxy for apt on
  :data:`~forkyard.pkgcache.config.APT_PORT`.

Both listen only on the cache's address (:class:`PackageCacheSettings.address`), which the
network puts on the host's ``lo`` and opens to this node's sandboxes on exactly these
ports (:class:`forkyard.network.firewall.HostServices`).

Each runs as an unprivileged account (``FORKYARD_PACKAGE_CACHE_USER``) in a private mount
namespace where its own directory, ``<data>/package-cache/<name>`` (0700, that account's),
is bind-mounted at :data:`MOUNT_POINT`: the data directory stays 0700 root, and the
service sees its files at a fixed path. Its stdout and stderr go to
``<data>/package-cache/logs/<name>.log`` (root's, 0600), at most :data:`LOG_MAX_BYTES`
per file plus one older ``.1``. A service that exits is started again after a pause
that doubles up to :data:`MAX_BACKOFF_S`; each start and exit is one log line of the
node. Sandboxes are configured only for the services that answer
(:meth:`PackageCache.ready`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import pwd
import shutil
import signal
import sys
import time
from pathlib import Path

from forkyard.config import PackageCacheSettings
from forkyard.pkgcache import config as conf

log = logging.getLogger("forkyard.pkgcache")

#: Where a service sees its own directory (in its private mount namespace).
MOUNT_POINT = "/mnt"
#: Bytes one log file keeps before it is moved to ``.1`` (the older one is dropped).
LOG_MAX_BYTES = 4 << 20
#: Longest wait for a service to answer on its port after it started (s).
START_TIMEOUT_S = 30.0
#: Longest pause before a service that exited is started again (s).
MAX_BACKOFF_S = 60.0
#: How long a stopping service may take after SIGTERM before SIGKILL (s).
STOP_TIMEOUT_S = 10.0
#: Of a service's log, what a failure message quotes (bytes read from its end).
TAIL_BYTES = 2048
#: squid's cache directory below its mount point (created by ``squid -z``).
SQUID_SPOOL = "spool"
#: The host's CA bundle (Debian's ``ca-certificates``), which proxpi verifies PyPI with
#: (squid uses OpenSSL's default store, the same certificates).
SYSTEM_CAS = "/etc/ssl/certs/ca-certificates.crt"


def _wrap(data_dir: Path, uid: int, gid: int, argv: list[str], nofile: int = 4096) -> list[str]:
    """argv that runs ``argv`` as ``uid:gid`` (no other groups, no new privileges) in a
    private mount namespace where ``data_dir`` is at :data:`MOUNT_POINT` (and the cwd),
    with at most ``nofile`` open files."""
    script = 'mount --bind "$1" "$2" && cd "$2" && shift 2 && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script, "sh",
            str(data_dir), MOUNT_POINT, "prlimit", f"--nofile={nofile}:{nofile}", "--", "setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
            "--no-new-privs", "--", *argv]


class _Log:
    """A bounded log file written from a service's output (0600, root's)."""

    def __init__(self, path: Path):
        self.path = path

    def write(self, data: bytes) -> None:
        try:
            if self.path.exists() and self.path.stat().st_size + len(data) > LOG_MAX_BYTES:
                os.replace(self.path, self.path.with_name(self.path.name + ".1"))
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as e:  # a full disk must not stop the service
            log.debug("writing %s: %s", self.path, e)

    def tail(self) -> str:
        """The last line of the log with text in it ('' when none)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - TAIL_BYTES))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:300] if lines else ""


class _Service:
    """One supervised child: started, watched, restarted, stopped."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ports: tuple[int, ...], address: str,
                 log_path: Path, owner: tuple[int, int], prepare: list[str] | None = None):
        self.name, self.argv, self.env, self.ports, self.address = name, argv, env, ports, address
        self.owner = owner
        self.log = _Log(log_path)
        self.prepare = prepare
        self.proc: asyncio.subprocess.Process | None = None
        self.ready = False
        self.starts = 0
        self.task: asyncio.Task | None = None
        self.first = asyncio.Event()  # set once the first start answered or failed
        self.error: str | None = None

    async def _pump(self, stream: asyncio.StreamReader, transport: asyncio.BaseTransport) -> None:
        try:
            while chunk := await stream.read(65536):
                self.log.write(chunk)
        finally:
            transport.close()

    async def _answers(self) -> bool:
        for port in self.ports:
            try:
                _, w = await asyncio.wait_for(asyncio.open_connection(self.address, port), 2.0)
            except (OSError, TimeoutError):
                return False
            w.close()
            with contextlib.suppress(OSError):
                await w.wait_closed()
        return True

    async def _spawn(self, argv: list[str]) -> tuple[asyncio.subprocess.Process, asyncio.Task]:
        """Start ``argv`` in a session of its own, its stdout and stderr into a pipe the
        service's account owns (squid opens ``/dev/stdout`` again, which checks the
        pipe's owner); returns the process and the task copying the pipe to the log."""
        r, w = os.pipe()
        try:
            os.fchown(w, *self.owner)
            proc = await asyncio.create_subprocess_exec(
                *argv, env=self.env, stdin=asyncio.subprocess.DEVNULL, stdout=w, stderr=w, start_new_session=True)
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(r, "rb", 0))
        return proc, asyncio.create_task(self._pump(reader, transport))

    async def run(self) -> None:
        """Start the service, again after each exit (with backoff), until cancelled."""
        backoff = 1.0
        while True:
            started = time.monotonic()
            try:
                await self._once()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 — reported, then retried
                self.error = f"{e}"
            self.ready = False
            log.error("package cache: %s stopped: %s (log: %s); starting it again in %.0f s",
                      self.name, self.error, self.log.path, backoff)
            self.first.set()
            await asyncio.sleep(backoff)
            backoff = 1.0 if time.monotonic() - started > 10 * MAX_BACKOFF_S else min(MAX_BACKOFF_S, backoff * 2)

    async def _once(self) -> None:
        if self.prepare is not None:
            prep, pump = await self._spawn(self.prepare)
            try:
                rc = await asyncio.wait_for(asyncio.shield(prep.wait()), 120)
            finally:
                await self._kill(prep)  # stopped or timed out meanwhile: nothing is left
                await self._drain(pump)
            if rc != 0:
                raise RuntimeError(f"preparing it failed with exit code {rc}: {self.log.tail()}")
        proc, pump = await self._spawn(self.argv)
        self.proc = proc
        self.starts += 1
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while not await self._answers():
                if proc.returncode is not None:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"it did not answer on port(s) {self.ports} in {START_TIMEOUT_S:.0f} s")
                await asyncio.sleep(0.2)
            if proc.returncode is None:
                self.ready, self.error = True, None
                log.info("package cache: %s serves on %s port(s) %s (pid %d)", self.name, self.address,
                         ",".join(map(str, self.ports)), proc.pid)
                self.first.set()
            rc = await proc.wait()
            self.error = f"exit code {rc}: {self.log.tail()}"
        finally:
            await self._kill(proc)
            await self._drain(pump)

    @staticmethod
    async def _drain(pump: asyncio.Task) -> None:
        """Let ``pump`` copy what is left of the output, at most 5 s (a process that left
        the service's group could hold the pipe open)."""
        try:
            await asyncio.wait_for(asyncio.shield(pump), 5.0)
        except TimeoutError:
            pump.cancel()
        except Exception:  # noqa: BLE001 — a log write failing is no reason to stop
            pass

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM the service's process group, SIGKILL it after :data:`STOP_TIMEOUT_S`."""
        for sig, wait in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), wait)
                # its workers (gunicorn's) are in the same group: make sure none is left
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                return
            except TimeoutError:
                continue

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.ready = False


class PackageCache:
    """The node's package cache (see the module docstring).

    Args:
        settings: the cache's settings (``enabled`` is not looked at: the composition
            root makes one only when it is on).
        data_dir: the node's data directory (the cache lives in ``<data_dir>/package-cache``).
    """

    def __init__(self, settings: PackageCacheSettings, data_dir: Path):
        self.settings = settings
        self.root = data_dir / "package-cache"
        self.upstreams = conf.check(settings)
        self._services: dict[str, _Service] = {}

    @property
    def address(self) -> str:
        """The address sandboxes reach the cache at."""
        return self.settings.address

    def check(self) -> None:
        """Check, changing nothing, that everything the services need is here.

        Raises:
            PackageCacheError: one line naming what is missing and what to do.
        """
        s = self.settings
        off = "or set FORKYARD_PACKAGE_CACHE=off"
        try:
            pwd.getpwnam(s.user)
        except KeyError:
            raise conf.PackageCacheError(
                f"package cache: user {s.user!r} does not exist: run deploy/install.sh (or `useradd --system "
                f"--no-create-home --shell /usr/sbin/nologin {s.user}`), set FORKYARD_PACKAGE_CACHE_USER, {off}") from None
        if shutil.which(s.squid) is None:
            raise conf.PackageCacheError(f"package cache: squid not found ({s.squid!r}): `apt-get install "
                                         f"squid-openssl` (deploy/install.sh does), set FORKYARD_SQUID, {off}")
        for tool in ("unshare", "setpriv", "prlimit"):
            if shutil.which(tool) is None:
                raise conf.PackageCacheError(f"package cache: {tool} not found (util-linux), {off}")
        for module, dist in (("proxpi", "proxpi"), ("gunicorn", "gunicorn")):
            if importlib.util.find_spec(module) is None:
                raise conf.PackageCacheError(f"package cache: Python package {dist!r} is missing from "
                                             f"{sys.prefix}: `pip install -e .` (deploy/install.sh does), {off}")

    def _dir(self, name: str, uid: int, gid: int) -> Path:
        d = self.root / name
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(d, uid, gid)
        os.chmod(d, 0o700)
        return d

    def _make(self) -> None:
        s = self.settings
        pw = pwd.getpwnam(s.user)
        uid, gid = pw.pw_uid, pw.pw_gid
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        logs = self.root / "logs"
        logs.mkdir(mode=0o700, exist_ok=True)
        half = max(32, s.size_mb // 2)
        base_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
                    "HOME": MOUNT_POINT, "TMPDIR": MOUNT_POINT}
        base_env.update(s.host_proxy)  # a host that reaches the registries through a proxy of its own
        squid_bin = shutil.which(s.squid)
        sq_dir = self._dir("squid", uid, gid)
        conf_path = sq_dir / "squid.conf"
        conf_path.write_text(conf.squid_conf(s.address, self.upstreams, f"{MOUNT_POINT}/{SQUID_SPOOL}", half))
        os.chown(conf_path, uid, gid)
        os.chmod(conf_path, 0o600)
        squid_conf = f"{MOUNT_POINT}/squid.conf"
        self._services["squid"] = _Service(
            "squid", _wrap(sq_dir, uid, gid, [squid_bin, "-N", "-f", squid_conf], nofile=conf.MAX_FDS), base_env,
            (conf.NPM_PORT, conf.APT_PORT), s.address, logs / "squid.log", (uid, gid),
            prepare=_wrap(sq_dir, uid, gid, [squid_bin, "-N", "-z", "-f", squid_conf]))
        py_dir = self._dir("pypi", uid, gid)
        env = {**base_env, **conf.proxpi_env(self.upstreams, f"{MOUNT_POINT}/files", half)}
        if Path(SYSTEM_CAS).is_file():  # requests' own bundle does not have the host's added CAs
            env["REQUESTS_CA_BUNDLE"] = SYSTEM_CAS
        argv = [sys.executable, "-m", "gunicorn", "--bind", f"{s.address}:{conf.PYPI_PORT}", "--workers", "1",
                "--threads", "16", "--timeout", "660", "--graceful-timeout", "5", "--limit-request-line", "8190",
                "--access-logfile", "-", "--error-logfile", "-", "forkyard.pkgcache.proxpi_app:app"]
        self._services["pypi"] = _Service("pypi", _wrap(py_dir, uid, gid, argv), env, (conf.PYPI_PORT,),
                                          s.address, logs / "pypi.log", (uid, gid))

    async def start(self) -> None:
        """Start the services and wait until each answers or failed its first start (at
        most :data:`START_TIMEOUT_S` + a preparation). A service that fails is reported
        in one log line and retried in the background; the node serves meanwhile, and
        sandboxes are not pointed at it until it answers.

        Raises:
            PackageCacheError: the cache's directories cannot be made.
        """
        try:
            await asyncio.to_thread(self._make)
        except (OSError, KeyError) as e:
            raise conf.PackageCacheError(f"package cache: preparing {self.root} failed: {e}") from e
        for svc in self._services.values():
            svc.task = asyncio.create_task(svc.run(), name=f"pkgcache-{svc.name}")
        await asyncio.wait([asyncio.create_task(s.first.wait()) for s in self._services.values()],
                           timeout=START_TIMEOUT_S + 150)

    async def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL); their caches stay on disk."""
        await asyncio.gather(*(s.stop() for s in self._services.values()))

    def ready(self) -> set[str]:
        """What sandboxes can use now: ``pypi`` (proxpi answers), ``npm`` and ``apt``
        (squid answers)."""
        out = set()
        if (p := self._services.get("pypi")) and p.ready:
            out.add("pypi")
        if (q := self._services.get("squid")) and q.ready:
            out |= {"npm", "apt"}
        return out

    def guest_files(self) -> dict[str, str]:
        """The files a sandbox created now gets (:func:`forkyard.pkgcache.config.guest_files`
        for :meth:`ready`); empty when no service answers."""
        return conf.guest_files(self.address, self.ready())

    def describe(self) -> dict:
        """``{"address", "ports": {name: port}, "services": {name: {"ready", "starts",
        "pid", "error"}}, "dir"}`` for the node's metrics."""
        return {
            "address": self.address,
            "ports": {"pypi": conf.PYPI_PORT, "npm": conf.NPM_PORT, "apt": conf.APT_PORT},
            "dir": str(self.root),
            "services": {n: {"ready": s.ready, "starts": s.starts,
                             "pid": s.proc.pid if s.proc and s.proc.returncode is None else None,
                             "error": s.error} for n, s in self._services.items()},
        }
