"""A sandbox's console, bounded: what the sandbox writes to its stdio (envd's log, and
anything written to ``/proc/1/fd/1`` or ``/proc/1/fd/2`` inside) goes into a pipe, and
a host-side pump copies it to ``<workdir>/console.log`` with a size cap (issue 25 item 5).

Why a pipe and a reader rather than a size-limited file: a file handed to runsc grows
as fast as the sandbox writes (200 MB in seconds, outside its disk), and the kernel
cannot cap one file of a process that also writes its disk image (``RLIMIT_FSIZE``
would hit the sentry's overlay file too, and ``SIGXFSZ`` kills it). The pump never
stops reading — a full or failing disk, or a flood, only drops bytes — so the writer
inside never blocks on it; it keeps the newest bytes: ``console.log`` holds at most half
of ``max_bytes`` and is then renamed ``console.log.1`` (replacing the older half) and
started anew, so the two together never exceed ``max_bytes``
(``FORKYARD_CONSOLE_LOG_MAX_BYTES``, per sandbox).

The pump runs in the node's reaper daemon (:mod:`.reaper`), which outlives server
restarts, so a sandbox's console keeps working across them; it ends when the last
writer closes the pipe (the sandbox stopped: destroy, or a pause's checkpoint), and a
resume, restore or fork starts the next one, appending to the same file (a fork to its
own). Everything that arrives here is the sandbox's own output: runsc's messages at
start share the pipe (they are the container's stdio), which is why
:mod:`forkyard.orchestrator.logs` marks every console line as the sandbox's.
"""

from __future__ import annotations

import fcntl
import logging
import os
import termios
import threading
import time
from pathlib import Path

from forkyard.runtime.events import rotated

log = logging.getLogger(__name__)

#: Bytes asked of the kernel for the pipe (F_SETPIPE_SZ; the default is 64 KiB).
PIPE_SIZE = 1 << 20
_F_SETPIPE_SZ = 1031
#: Bytes read at a time.
READ_CHUNK = 1 << 20


class Pump:
    """Copies pipe ``read_fd`` to ``path`` keeping ``path`` + :func:`rotated` ≤ ``max_bytes``
    (bytes; at least 2). Owns ``read_fd``. :meth:`start` runs it on a daemon thread;
    :meth:`drain` waits until what is in the pipe now has been written."""

    def __init__(self, read_fd: int, path: Path, max_bytes: int):
        self.fd, self.path = read_fd, Path(path)
        self.half = max(1, int(max_bytes) // 2)
        self.done = threading.Event()
        self.handled = 0  # bytes read and written (or dropped)
        self.idle = True  # waiting in read()
        self.failed = False
        self.dropped = 0

    def start(self) -> Pump:
        """Start the copying thread; returns self."""
        threading.Thread(target=self._run, name=f"console-{self.path.parent.name}", daemon=True).start()
        return self

    def _open(self):
        return open(self.path, "ab", buffering=0)

    def _run(self) -> None:
        out = None
        try:
            while True:
                self.idle = True
                try:
                    data = os.read(self.fd, READ_CHUNK)
                except InterruptedError:
                    continue
                except OSError:
                    return
                finally:
                    self.idle = False
                if not data:
                    return
                try:
                    out = self._write(out, data)
                except Exception as exc:  # noqa: BLE001 — never stop reading (the writer would block)
                    if not self.failed:  # once per pump: a full disk must not fill the daemon's log
                        log.warning("console of %s: %s; its bytes are dropped while that lasts",
                                    self.path.parent.name, exc)
                    self.failed = True
                    self.dropped += len(data)
                    if out is not None:
                        try:
                            out.close()
                        except OSError:
                            pass
                    out = None
                finally:
                    self.handled += len(data)
        finally:
            if out is not None:
                try:
                    out.close()
                except OSError:
                    pass
            os.close(self.fd)
            self.done.set()

    def _write(self, out, data: bytes):
        if out is None:
            out = self._open()
        while data:
            size = out.tell()
            if size >= self.half:
                out.close()
                os.replace(self.path, rotated(self.path))
                out = self._open()
                size = 0
            if len(data) > self.half:  # only the newest half of a larger chunk can stay
                self.dropped += len(data) - self.half
                data = data[-self.half:]
            room = self.half - size
            out.write(data[:room])
            data = data[room:]
        return out

    def _pending(self) -> int:
        buf = bytearray(4)
        fcntl.ioctl(self.fd, termios.FIONREAD, buf)
        return int.from_bytes(buf, "little")

    def drain(self, timeout_s: float = 1.0) -> None:
        """Wait (≤ ``timeout_s``) until the bytes in the pipe now are in the file: a
        process that wrote and exited has then all its bytes there, however much the
        sandbox keeps writing."""
        deadline = time.monotonic() + timeout_s
        try:
            start, pending, was_idle = self.handled, self._pending(), self.idle
            while time.monotonic() < deadline and not self.done.is_set():
                if self.idle and self._pending() == 0:
                    return
                if self.handled >= start + pending and (was_idle or self.handled > start):
                    return
                time.sleep(0.002)
        except OSError:
            return


def open_pipe(path: Path, max_bytes: int) -> tuple[int, Pump]:
    """A pipe for a sandbox's stdio: ``(write_fd, pump)``, the pump started (it owns the
    read end; the caller passes ``write_fd`` on and closes it)."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # the default size works too, with more reads
    return w, Pump(r, path, max_bytes).start()


def size(path: Path) -> int:
    """``path``'s size in bytes, 0 when it cannot be read."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tail(console: Path, offset: int, limit: int = 20000) -> str:
    """What ``console`` got from byte ``offset`` on (all of it when it rotated since), at
    most its last ``limit`` bytes, decoded; "" when unreadable."""
    try:
        with open(console, "rb") as f:
            f.seek(offset if size(console) >= offset else 0)
            return f.read()[-limit:].decode(errors="replace")
    except OSError:
        return ""
