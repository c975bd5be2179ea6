"""Reap runsc's sandbox and gofer processes promptly.

``runsc run --detach`` double-forks: the sandbox (``runsc-sandbox``), the gofer and the
systrap stub processes are orphaned when the ``runsc`` command exits, and get reparented
to the nearest *child subreaper* — or to the host's PID 1. Until someone reaps a dead
sandbox, ``runsc`` sees its pid as alive, so ``runsc delete`` waits and ``runsc state``
still says ``running``. On this project's machines PID 1 reaps orphans only about once
a second (measured: a killed sandbox stayed a zombie 1.2–1.7 s), which made every
destroy take 1.3 s+.

:func:`ensure_reaper` makes this process a child subreaper (``PR_SET_CHILD_SUBREAPER``)
and starts one daemon thread that reaps zombie children whose command name is ``exe`` —
runsc re-executes ``/proc/self/exe`` for the sandbox, gofer and stubs, so that is their
``comm``. Other children are left to whoever spawned them (asyncio and ``subprocess``
reap their own), so no exit status is stolen.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_CHILD_SUBREAPER = 36
_RUNSC_COMM = "exe"
_lock = threading.Lock()
_started_pid: int | None = None


def _stat(pid: int) -> tuple[str, str, int] | None:
    """``(comm, state, ppid)`` of ``pid`` or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    lpar, rpar = data.find("("), data.rfind(")")
    rest = data[rpar + 2 :].split()
    return data[lpar + 1 : rpar], rest[0], int(rest[1])


def _reap(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


def sweep() -> int:
    """Reap every zombie child of this process that is a runsc helper; return how many."""
    me = os.getpid()
    reaped = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        st = _stat(int(name))
        if st and st[2] == me and st[1] == "Z" and st[0] == _RUNSC_COMM:
            reaped += _reap(int(name))
    return reaped


def _loop() -> None:
    backoff = 0.01
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            time.sleep(0.05)  # no children at all right now
            continue
        except InterruptedError:
            continue
        except Exception as exc:  # noqa: BLE001 — never let the reaper die
            log.warning("reaper: waitid failed: %s", exc)
            time.sleep(0.5)
            continue
        if info is None:
            continue
        st = _stat(info.si_pid)
        if st is not None and st[0] == _RUNSC_COMM:
            _reap(info.si_pid)
            backoff = 0.01
            continue
        # Someone else's child: its owner reaps it. Meanwhile reap ours behind it, and
        # back off so a child whose owner never waits does not make us spin.
        sweep()
        time.sleep(backoff)
        backoff = min(backoff * 2, 1.0)


def ensure_reaper() -> bool:
    """Make this process a child subreaper and start the reaper thread (idempotent).

    Returns:
        True when the reaper runs; False if the kernel refused ``PR_SET_CHILD_SUBREAPER``
        (then orphans go to PID 1 and destroys are slower, but still correct).
    """
    global _started_pid
    with _lock:
        if _started_pid == os.getpid():
            return True
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            log.warning("PR_SET_CHILD_SUBREAPER failed: %s", os.strerror(ctypes.get_errno()))
            return False
        threading.Thread(target=_loop, name="forkyard-reaper", daemon=True).start()
        _started_pid = os.getpid()
        return True


# ---- the per-node reaper daemon -----------------------------------------------------------
#
# The thread above reaps only while this server process lives. After a restart, the
# sandboxes it started have lost their subreaper (the old process) and belong to the
# host's PID 1, which reaps about once a second: a re-adopted sandbox took ~1.5-2 s to
# die (measured, tests/test_restart.py). So sandboxes are started by a small daemon
# instead, one per runsc root (``<data dir>/runsc/reaper.sock``), that is a child
# subreaper and outlives server restarts: runsc's orphans are reparented to it and
# reaped at once whichever server process kills them. It leaves when it has had no
# child and no client for IDLE_EXIT_S.
#
# Protocol (Unix stream socket, one request per connection): the client sends one JSON
# line ``{"argv": [...]}`` with three file descriptors (stdin, stdout, stderr) attached
# (SCM_RIGHTS); the daemon answers ``{"pid": N}`` once the process runs (or
# ``{"error": "..."}``) and ``{"rc": R}`` when it exits (R < 0: killed by signal -R).
# With ``"console": {"path": P, "max_bytes": N}`` the process's stdout and stderr are
# instead a pipe that the daemon copies to P, bounded (:mod:`.console`; the answer then
# says ``"console": true``), and ``{"rc": R}`` comes once what it wrote is in P. The
# socket's name changed with that (``reaper2.sock``), so a server never hands a console
# to an older daemon that would ignore it.

import json as _json
import socket as _socket
import subprocess as _subprocess
import sys as _sys

from forkyard.runtime.gvisor import console

IDLE_EXIT_S = 30.0
SOCKET_NAME = "reaper2.sock"


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class _Daemon:
    def __init__(self, path: str):
        self.path = path
        self.lock = threading.Lock()
        self.waiting: dict[int, _socket.socket] = {}  # pid → client to tell its exit code
        self.clients = 0
        self.last_busy = time.monotonic()
        self.wake = threading.Event()
        self.childless = True  # no child at all (then no orphan can come to us either)
        self.pumps: dict[int, console.Pump] = {}  # pid → its console pump (until it exits)
        self.consoles: list[console.Pump] = []  # every pump still copying

    def serve(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER failed")
        lsock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        tmp = f"{self.path}.{os.getpid()}"
        lsock.bind(tmp)
        os.chmod(tmp, 0o600)
        lsock.listen(256)
        os.rename(tmp, self.path)  # atomically replaces a dead daemon's socket
        threading.Thread(target=self._reap_loop, daemon=True).start()
        lsock.settimeout(1.0)
        while True:
            try:
                conn, _ = lsock.accept()
            except TimeoutError:
                with self.lock:
                    self.consoles = [p for p in self.consoles if not p.done.is_set()]
                    idle = not self.waiting and not self.clients and self.childless and not self.consoles
                    if idle and time.monotonic() - self.last_busy > IDLE_EXIT_S:
                        # Leave only if the socket is still ours; unlink first, so a
                        # client that finds no socket starts a new daemon.
                        try:
                            if os.stat(self.path).st_ino == os.fstat(lsock.fileno()).st_ino:
                                os.unlink(self.path)
                        except OSError:
                            pass
                        return
                    if not idle:
                        self.last_busy = time.monotonic()
                continue
            with self.lock:
                self.clients += 1
                self.last_busy = time.monotonic()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: _socket.socket) -> None:
        fds: list[int] = []
        try:
            msg, fds, _, _ = _socket.recv_fds(conn, 65536, 3)
            req = _json.loads(msg)
            argv = [str(a) for a in req["argv"]]
            if len(fds) != 3:
                raise ValueError("expected 3 file descriptors")
            out, err, pump = fds[1], fds[2], None
            if req.get("console"):
                w, pump = console.open_pipe(Path(req["console"]["path"]), int(req["console"]["max_bytes"]))
                fds.append(w)  # closed below, once the child has its copy
                out = err = w
            with self.lock:  # registered before the reap loop can see it exit
                pid = os.posix_spawnp(argv[0], argv, os.environ, setsid=True, file_actions=[
                    (os.POSIX_SPAWN_DUP2, fds[0], 0), (os.POSIX_SPAWN_DUP2, out, 1),
                    (os.POSIX_SPAWN_DUP2, err, 2)])
                self.waiting[pid] = conn
                self.childless = False
                if pump is not None:
                    self.pumps[pid] = pump
                    self.consoles.append(pump)
            self.wake.set()
            conn.sendall(_json.dumps({"pid": pid, "console": pump is not None}).encode() + b"\n")
        except Exception as exc:  # noqa: BLE001 — told to the client
            try:
                conn.sendall(_json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            except OSError:
                pass
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)
            with self.lock:
                self.clients -= 1
                self.last_busy = time.monotonic()

    def _reap_loop(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                with self.lock:
                    self.childless = not self.waiting
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            except InterruptedError:
                continue
            with self.lock:
                conn = self.waiting.pop(pid, None)
                pump = self.pumps.pop(pid, None)
                self.last_busy = time.monotonic()
            if pump is not None:
                pump.drain()  # what runsc wrote before it exited is in the file when we answer
            if conn is not None:
                try:
                    conn.sendall(_json.dumps({"rc": _exit_code(status)}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()


def socket_path(runsc_root: Path) -> Path:
    """Where the reaper daemon of the runsc root ``runsc_root`` listens."""
    return Path(runsc_root) / SOCKET_NAME


_daemons: dict[str, _subprocess.Popen] = {}
_DAEMON_MAIN = ("import logging, sys; from forkyard.runtime.gvisor.reaper import serve_daemon; "
                "serve_daemon(sys.argv[1])")


def _connect(path: Path) -> _socket.socket:
    s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        raise
    return s


def _start_daemon(path: Path) -> None:
    """Start the daemon for ``path`` (detached: its own session, so signals to the
    server's process group never reach it) and wait ≤ 5 s until it listens."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log_path = path.parent / "reaper.log"
    with open(log_path, "ab") as logf:
        proc = _subprocess.Popen([_sys.executable, "-c", _DAEMON_MAIN, str(path)],
                                 stdin=_subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True,
                                 close_fds=True)
    _daemons[str(path)] = proc
    # Its exit status is collected by a thread (this process is a subreaper whose own
    # loop leaves non-runsc children to their owners).
    threading.Thread(target=proc.wait, daemon=True).start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            _connect(path).close()
            return
        except OSError:
            if proc.poll() is not None:
                raise OSError(f"reaper daemon exited with {proc.returncode}; see {log_path}")
            time.sleep(0.01)
    raise OSError(f"reaper daemon did not listen on {path} within 5 s; see {log_path}")


class Spawned:
    """A process the reaper daemon started: ``pid`` and :meth:`wait` for its exit code."""

    def __init__(self, conn: _socket.socket, pid: int, rest: bytes):
        self.conn = conn
        self.pid = pid
        self._buf = rest
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Exit code (negative: killed by that signal). Raises OSError if the daemon
        went away first."""
        if self.returncode is not None:
            return self.returncode
        loop = asyncio.get_running_loop()
        while b"\n" not in self._buf:
            chunk = await loop.sock_recv(self.conn, 4096)
            if not chunk:
                self.conn.close()
                raise OSError("reaper daemon closed the connection before the process exited")
            self._buf += chunk
        self.conn.close()
        self.returncode = int(_json.loads(self._buf.split(b"\n", 1)[0])["rc"])
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the process (it stays reaped by the daemon)."""
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


_start_lock = asyncio.Lock()


async def spawn(runsc_root: Path, argv: list[str], stdin: int, stdout: int, stderr: int,
                console: dict | None = None) -> Spawned:
    """Start ``argv`` (PATH looked up; in its own session) as a child of the reaper
    daemon of ``runsc_root`` — started first if none runs — with the given file
    descriptors as its stdin/stdout/stderr; with ``console`` (``{"path": str,
    "max_bytes": int}``) its stdout/stderr are a pipe the daemon copies to that file,
    bounded (:mod:`.console`), and ``stdout``/``stderr`` are not used.

    Raises:
        OSError: the daemon could not be started or refused (its message).
    """
    path = socket_path(runsc_root)
    for attempt in (1, 2):
        try:
            return await _spawn_once(path, argv, stdin, stdout, stderr, console)
        except _Gone:
            if attempt == 2:
                raise OSError("reaper daemon closed the connection") from None
            # It was leaving (idle) just as we connected: the next one starts anew.
    raise AssertionError("unreachable")


class _Gone(OSError):
    pass


async def _spawn_once(path: Path, argv: list[str], stdin: int, stdout: int, stderr: int,
                      console: dict | None) -> Spawned:
    loop = asyncio.get_running_loop()
    try:
        conn = _connect(path)
    except OSError:
        async with _start_lock:
            try:
                conn = _connect(path)
            except OSError:
                await asyncio.to_thread(_start_daemon, path)
                conn = _connect(path)
    try:
        req = {"argv": argv, **({"console": console} if console else {})}
        _socket.send_fds(conn, [_json.dumps(req).encode()], [stdin, stdout, stderr])
        conn.setblocking(False)
        buf = b""
        while b"\n" not in buf:
            chunk = await loop.sock_recv(conn, 4096)
            if not chunk:
                raise _Gone()
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        ans = _json.loads(line)
        if "pid" not in ans:
            raise OSError(f"reaper daemon could not start {argv[0]}: {ans.get('error')}")
        return Spawned(conn, int(ans["pid"]), rest)
    except BaseException:
        conn.close()
        raise


def serve_daemon(path: str) -> None:
    """Run the reaper daemon on the Unix socket ``path`` until it has been idle (no
    child, no client) for :data:`IDLE_EXIT_S`. Runs in its own process
    (:func:`spawn` starts it)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s reaper %(message)s")
    _Daemon(path).serve()
