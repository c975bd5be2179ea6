"""``forkyard logs``: what happened in a sandbox (envd's and the runtime's lines), or,
from a server without a logs endpoint, its running processes."""

from __future__ import annotations

import shlex

import typer
from rich.table import Table

from forkyard.cli._common import ID_ARG, JSON_OPT, err, not_found, out, print_json, run
from forkyard.client import AsyncForkyard, NotFound, NotSupported

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()

#: Terminal control characters (ESC, BEL, …) in text a sandbox wrote become "?" when
#: printed, so a sandbox cannot drive the operator's terminal.
_NO_CONTROL = {c: "?" for c in [*range(0x00, 0x09), *range(0x0a, 0x20), 0x7f]}


@commands.command()
def logs(sandbox_id: str = ID_ARG, as_json: bool = JSON_OPT):
    """Show a sandbox's logs: envd's and the runtime's lines since it last started or
    resumed, including each process envd started and how it ended (or, from a server
    without a logs endpoint, its running processes).

    When the server has no logs endpoint this says so and lists the processes running in the sandbox, from envd."""

    async def go(c: AsyncForkyard) -> int:
        try:
            lines = await c.logs(sandbox_id)
        except NotFound as e:
            not_found(sandbox_id, e)
        except NotSupported as e:
            err.print(f"[yellow]{e.message}[/yellow]; no sandbox log is kept. "
                      "Processes running in the sandbox, from envd:", highlight=False)
            s = await c.get_sandbox(sandbox_id)
            if s.state != "running":
                err.print(f"sandbox {sandbox_id} is {s.state}; `forkyard resume {sandbox_id}` to inspect it",
                          highlight=False)
                return 1
            procs = await c.sandbox(s).commands.list()
            if as_json:
                print_json({"logs": None, "processes": [{"pid": p.pid, "cmd": p.cmd, "args": p.args,
                                                         "cwd": p.cwd, "tag": p.tag} for p in procs]})
                return 0
            if not procs:
                err.print("no process started through envd is running")
                return 0
            t = Table(box=None, header_style="bold")
            t.add_column("PID")
            t.add_column("COMMAND")
            t.add_column("CWD")
            for p in procs:
                t.add_row(str(p.pid), shlex.join([p.cmd, *p.args]), p.cwd or "-")
            out.print(t, highlight=False)
            return 0
        if as_json:
            print_json(lines)
        else:
            for entry in lines:  # sandbox-written text: no markup, no terminal control codes
                text = f"{entry.get('timestamp', '')} {entry.get('line', entry)}".translate(_NO_CONTROL)
                out.print(text, highlight=False, markup=False)
        return 0

    raise typer.Exit(run(go))
