"""The host processes of a gVisor sandbox: starting ``runsc run/restore --detach`` under
the node's reaper daemon, runsc's on-disk state, killing the sandbox and gofer processes
(faster than ``runsc delete`` alone), finding checkpoints still running, and nudging
a restored envd.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from forkyard.runtime.base import RuntimeError_
from forkyard.runtime.gvisor import console, reaper
from forkyard.runtime.gvisor.runsc import Runsc

log = logging.getLogger("forkyard.runtime.gvisor.driver")


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2 : data.rfind(b")") + 3] not in (b"Z", b"X")


async def spawn_detached(runsc_root: Path, argv: list[str], console_path: Path, console_max_bytes: int,
                         use_daemon: bool = True):
    """Start ``argv`` (``runsc run/restore --detach`` in its wrapper) with stdout and
    stderr into a pipe copied to ``console_path`` with at most ``console_max_bytes``
    bytes kept (:mod:`.console`), as a child of the node's reaper daemon
    (:func:`.reaper.spawn`; the copying runs there too): the sandbox and gofer it leaves
    behind are then reaped at once when they die, and the console keeps being copied,
    also after this server process was restarted. Falls back to a child of this process
    (reaped by this process's reaper thread, or by PID 1 after a restart: ~1-2 s per
    destroy; its console copied by a thread of this process, so only until it exits)
    when the daemon cannot be used.

    Returns:
        an object with ``pid``, ``async wait() -> int`` (once it exited, what it wrote is
        in ``console_path``) and ``kill()``.
    """
    if use_daemon:
        try:
            with open(os.devnull, "rb") as devnull:
                return await reaper.spawn(runsc_root, argv, devnull.fileno(), devnull.fileno(), devnull.fileno(),
                                          console={"path": str(console_path), "max_bytes": int(console_max_bytes)})
        except OSError as e:
            log.warning("reaper daemon unavailable (%s); runsc runs as this process's child", e)
    w, pump = console.open_pipe(console_path, console_max_bytes)
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=w, stderr=w, start_new_session=True)
    finally:
        os.close(w)
    return _Drained(proc, pump)


class _Drained:
    """A child of this process whose :meth:`wait` returns once its output is copied."""

    def __init__(self, proc, pump):
        self.proc, self.pump, self.pid = proc, pump, proc.pid

    async def wait(self) -> int:
        rc = await self.proc.wait()
        await asyncio.to_thread(self.pump.drain)
        return rc

    def kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass


def container_files_exist(runsc_root: Path, sandbox_id: str) -> bool:
    """Whether runsc keeps state files of a container ``sandbox_id`` under ``runsc_root``."""
    try:
        return any(p.name.startswith(f"{sandbox_id}_") for p in runsc_root.iterdir())
    except FileNotFoundError:
        return False


def state_file(runsc_root: Path, sandbox_id: str) -> dict | None:
    """runsc's on-disk container state (internal format; None if absent/unreadable)."""
    try:
        for path in runsc_root.glob(f"{sandbox_id}_sandbox:*.state"):
            return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    return None


async def kill_sandbox_process(runsc_root: Path, sandbox_id: str) -> None:
    """SIGKILL the sandbox process and wait (≤ 2 s) until it is reaped.

    ``runsc delete --force`` does the same but then polls every 100 ms; killing
    first and waiting here (the reaper reaps within a millisecond or so) makes
    destroy ~100 ms faster. Best effort: any surprise leaves the work to runsc.
    """
    st = state_file(runsc_root, sandbox_id)
    try:
        pid = int((st or {}).get("sandbox", {}).get("pid") or 0)
    except (TypeError, ValueError, AttributeError):
        return
    if pid <= 1 or not pid_alive(pid):
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if not f.read().startswith(b"runsc-sandbox"):
                return  # pid reused by something else
        os.kill(pid, 9)
    except (OSError, ProcessLookupError):
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while os.path.exists(f"/proc/{pid}") and loop.time() < deadline:
        await asyncio.sleep(0.002)
    # The gofer exits once the sandbox is gone; make sure, so no runsc process
    # outlives destroy (runsc delete signals it but does not wait for it).
    try:
        gofer = int((st or {}).get("goferPid") or 0)
    except (TypeError, ValueError):
        gofer = 0
    if gofer > 1 and pid_alive(gofer):
        try:
            with open(f"/proc/{gofer}/cmdline", "rb") as f:
                if f.read().startswith(b"runsc-gofer"):
                    os.kill(gofer, 9)
        except OSError:
            return
        deadline = loop.time() + 2.0
        while os.path.exists(f"/proc/{gofer}") and loop.time() < deadline:
            await asyncio.sleep(0.002)


def checkpointing(runsc_root: Path) -> list[str]:
    """Ids that a ``runsc --root=<runsc_root> checkpoint`` process is working on now
    (read from ``/proc``: one started by a killed server keeps going). Blocking."""
    root = f"--root={runsc_root}"
    ids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if root in args and "checkpoint" in args:
            ids.append(args[-1])
    return ids


async def rearm_envd(runsc: Runsc, sandbox_id: str) -> None:
    """Tell a restored envd to re-register its listening socket (SIGUSR1, ~9-20 ms
    of ``runsc kill``); the driver does it only with ``FORKYARD_ENVD_REARM=1``.

    runsc (0.0~20240729) resets every TCP connection of a checkpoint
    (``--net-disconnect-ok``); when the image held any, the restored listening
    socket's existing edge-triggered epoll registration never fired again, so Go's
    poller never woke envd's Accept: clients connected and then waited forever.
    envd re-registers the socket on SIGUSR1 (and by itself within ~1 s otherwise, see
    envd ``server.RearmListener``). The pinned build marks every epoll interest
    ready at restore (gVisor PR 14147), so this is off by default
    (docs/runtime.md). Best effort: a failure is logged, not raised.
    """
    try:
        rc, _, err = await runsc.run(["kill", sandbox_id, "USR1"])
    except RuntimeError_ as exc:
        rc, err = -1, str(exc)
    if rc != 0:
        log.warning("runsc kill %s USR1 (envd listener rearm) failed: %s", sandbox_id, err)
