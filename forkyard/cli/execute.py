"""``forkyard exec``: one command in a sandbox, output streamed live, the exit code a
shell would report."""

from __future__ import annotations

import os
import shlex
import sys

import typer

from forkyard.cli._common import ID_ARG, err, not_found, parse_kv, print_json, run
from forkyard.client import AsyncForkyard, NotFound

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


def exit_code_of(code: int, error: str | None) -> int:
    """A command's exit code as a shell reports it: envd ends a command killed by a
    signal with exit code -1 and ``error`` "signal: NAME" (Go's ``os.ProcessState``
    wording, e.g. "signal: killed"); that becomes 128 + the signal's number."""
    import signal as _signal

    if code != -1 or not error or not error.startswith("signal: "):
        return code
    name = error[len("signal: "):].split(" (core dumped)")[0].strip().lower()
    if name.startswith("signal ") and name[7:].isdigit():
        return 128 + int(name[7:])
    for sig in _signal.Signals:
        desc = _signal.strsignal(sig)
        if desc and desc.lower() == name:
            return 128 + sig.value
    return 255


@commands.command("exec", context_settings={"ignore_unknown_options": True})
def exec_(
    sandbox_id: str = ID_ARG,
    cmd: list[str] = typer.Argument(..., help="Command after `--`. One argument is run as a shell line; "
                                               "several are quoted and joined."),
    cwd: str | None = typer.Option(None, "--cwd", help="Working directory in the sandbox."),
    user: str | None = typer.Option(None, "--user", "-u", help="User to run as (default: user)."),
    env: list[str] | None = typer.Option(None, "--env", "-e", help="KEY=VALUE (repeatable)."),
    timeout: float = typer.Option(0, "--timeout", help="Kill the command after this many seconds (0: never); "
                                                       "exit code 124."),
    interactive: bool = typer.Option(False, "--interactive", "-i", help="Forward this terminal's stdin to the "
                                                                         "command (EOF closes it)."),
    as_json: bool = typer.Option(False, "--json", help="Buffer the output; print stdout, stderr and exit "
                                                      "code as JSON."),
):
    """Run one command in a sandbox; output streams live.

    Exit code: the command's; 128+N when it died by signal N; 124 when --timeout
    killed it (as GNU timeout)."""
    line = cmd[0] if len(cmd) == 1 else shlex.join(cmd)
    envs = parse_kv(env, "env")

    async def go(c: AsyncForkyard) -> int:
        import asyncio

        from e2b import CommandExitException, TimeoutException

        try:
            sbx = await c.connect(sandbox_id, timeout=max(int(timeout) + 60, 300))
        except NotFound as e:
            not_found(sandbox_id, e)

        def w(stream):
            def write(s: str) -> None:
                stream.write(s)
                stream.flush()
            return write

        kw = {} if as_json else {"on_stdout": w(sys.stdout), "on_stderr": w(sys.stderr)}
        handle = await sbx.commands.run(line, cwd=cwd, user=user, envs=envs, timeout=timeout or 0,
                                        background=True, stdin=True if interactive else None, **kw)
        feeder = asyncio.create_task(_feed_stdin(sbx, handle.pid)) if interactive else None
        try:
            r = await handle.wait()
            code, so, se, error = r.exit_code, r.stdout, r.stderr, r.error
        except CommandExitException as e:
            code, so, se, error = e.exit_code, e.stdout, e.stderr, e.error
        except TimeoutException:
            try:
                await handle.kill()
            except Exception:  # noqa: BLE001 — it may have ended meanwhile
                pass
            err.print(f"timed out after {timeout:g} s", highlight=False)
            return 124
        finally:
            if feeder is not None:
                feeder.cancel()
        code = exit_code_of(code, error)
        if as_json:
            print_json({"sandboxID": sandbox_id, "command": line, "exitCode": code, "stdout": so, "stderr": se})
        return code

    raise typer.Exit(run(go))


async def _feed_stdin(sbx, pid: int) -> None:
    """Copy this process's stdin to command ``pid`` until EOF, then close its stdin."""
    import asyncio

    loop = asyncio.get_running_loop()
    while True:
        data = await loop.run_in_executor(None, lambda: os.read(sys.stdin.fileno(), 65536))
        if not data:
            break
        await sbx.commands.send_stdin(pid, data)
    await sbx.commands.close_stdin(pid)
