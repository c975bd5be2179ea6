"""Interactive PTY shell inside a sandbox, bridged to the local terminal.

The local terminal is put in raw mode (so Ctrl-C, Ctrl-D, arrows … travel to the remote
shell as bytes) and restored on every exit path; SIGWINCH resizes the remote PTY; the
remote shell's exit code is returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import termios
import tty

from forkyard.client import AsyncForkyard


def _size(fd: int) -> tuple[int, int]:
    """(rows, cols) of the terminal on ``fd``, 24×80 when it is not a terminal."""
    try:
        sz = os.get_terminal_size(fd)
        if sz.lines > 0 and sz.columns > 0:
            return sz.lines, sz.columns
    except OSError:
        pass
    sz = shutil.get_terminal_size((80, 24))
    return sz.lines, sz.columns


@contextlib.contextmanager
def raw_terminal(fd: int):
    """Raw mode on ``fd`` for the duration (no-op when it is not a terminal); the
    previous mode is restored however the block exits."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setraw(fd)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def attach_shell(client: AsyncForkyard, sandbox, *, keepalive_s: int = 300,
                       user: str | None = None, cwd: str | None = None) -> int:
    """Open a login shell in a PTY in ``sandbox`` (e2b ``AsyncSandbox``) and bridge it
    to this process's stdin/stdout until the shell exits.

    Args:
        keepalive_s: while attached the sandbox is refreshed to live at least this many
            more seconds (checked every 30 s), so an interactive session does not expire.
        user / cwd: shell user (default: the template's, ``user``) and directory.

    Returns:
        The shell's exit code (0…255).

    Raises:
        e2b SDK exceptions when the PTY cannot be started.
    """
    from e2b import CommandExitException, PtySize

    in_fd, out_fd = sys.stdin.fileno(), sys.stdout.fileno()
    loop = asyncio.get_running_loop()
    rows, cols = _size(in_fd if os.isatty(in_fd) else out_fd)

    def on_data(chunk: bytes) -> None:
        os.write(out_fd, bytes(chunk))

    handle = await sandbox.pty.create(PtySize(rows=rows, cols=cols), on_data=on_data, user=user, cwd=cwd,
                                      timeout=0)
    pid = handle.pid
    inbox: asyncio.Queue[bytes | None] = asyncio.Queue()

    def readable() -> None:
        try:
            data = os.read(in_fd, 65536)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(in_fd)
            inbox.put_nowait(None)
        else:
            inbox.put_nowait(data)

    async def pump_input() -> None:
        while True:
            data = await inbox.get()
            if data is None:  # local EOF: tell the shell (Ctrl-D), then stop reading
                with contextlib.suppress(Exception):
                    await sandbox.pty.send_stdin(pid, b"\x04")
                return
            await sandbox.pty.send_stdin(pid, data)

    async def resize() -> None:
        r, c = _size(in_fd)
        with contextlib.suppress(Exception):
            await sandbox.pty.resize(pid, PtySize(rows=r, cols=c))

    async def keepalive() -> None:
        while True:
            await asyncio.sleep(30)
            with contextlib.suppress(Exception):
                await client.refresh(sandbox.sandbox_id, min(keepalive_s, 3600))

    tasks: list[asyncio.Task] = []
    with raw_terminal(in_fd):
        loop.add_reader(in_fd, readable)
        if os.isatty(in_fd):
            loop.add_signal_handler(signal.SIGWINCH, lambda: tasks.append(loop.create_task(resize())))
        tasks += [loop.create_task(pump_input()), loop.create_task(keepalive())]
        try:
            result = await handle.wait()
            code = result.exit_code
        except CommandExitException as e:
            code = e.exit_code
        finally:
            loop.remove_reader(in_fd)
            if os.isatty(in_fd):
                loop.remove_signal_handler(signal.SIGWINCH)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return code if code is not None else 1
