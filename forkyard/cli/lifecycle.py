"""Changing sandboxes' state: ``forkyard rm``/``kill``, ``pause``, ``resume``,
``timeout`` (each takes many ids and reports each) and ``fork``."""

from __future__ import annotations

import sys

import typer
from rich.table import Table
from rich.text import Text

from forkyard.cli._common import ID_ARG, IDS_ARG, JSON_OPT, err, not_found, out, print_json, print_table, run
from forkyard.client import AsyncForkyard, Conflict, ForkError, NotFound

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


def _each(ids: list[str], verb: str, fn, as_json: bool, done: str,
          already: tuple[str, str] | None = None) -> None:
    """Apply ``fn(client, id)`` to every id; report each; exit 1 if any failed.
    ``already`` = (text in the 409 message, what to report): that conflict means the
    sandbox is in the wanted state already, which is not an error."""

    async def go(c: AsyncForkyard) -> int:
        results, bad = [], 0
        for sid in ids:
            try:
                await fn(c, sid)
                results.append({"sandboxID": sid, "ok": True})
                if not as_json:
                    out.print(f"{sid} {done}", highlight=False)
            except NotFound:
                bad += 1
                results.append({"sandboxID": sid, "ok": False, "error": "not found"})
                if not as_json:
                    err.print(f"[red]error:[/red] sandbox {sid} not found (see `forkyard ls`)", highlight=False)
            except Conflict as e:
                if already is not None and already[0] in e.message:
                    results.append({"sandboxID": sid, "ok": True, "already": True})
                    if not as_json:
                        out.print(f"{sid} {already[1]}", highlight=False)
                    continue
                bad += 1
                results.append({"sandboxID": sid, "ok": False, "error": e.message})
                if not as_json:
                    why = e.message.split(f"{sid}: ", 1)[-1]  # the client prefixes "<op> <id>: "
                    msg = f"cannot {verb}: {why}" if sid in why else f"cannot {verb} {sid}: {why}"
                    err.print(f"[red]error:[/red] {msg}", highlight=False)
        if as_json:
            print_json(results)
        return 1 if bad else 0

    raise typer.Exit(run(go))


@commands.command("rm")
def rm(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
    """Kill sandboxes (running or paused). Alias: kill."""
    _each(sandbox_ids, "kill", lambda c, s: c.kill(s), as_json, "killed")


@commands.command("kill", hidden=True)
def kill(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
    """Kill sandboxes (alias of rm)."""
    _each(sandbox_ids, "kill", lambda c, s: c.kill(s), as_json, "killed")


@commands.command()
def pause(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
    """Pause sandboxes: memory and files are checkpointed; resume continues them (a
    paused one is left as it is)."""
    _each(sandbox_ids, "pause", lambda c, s: c.pause(s), as_json, "paused",
          already=("is paused", "is already paused"))


@commands.command()
def resume(
    sandbox_ids: list[str] = IDS_ARG,
    timeout: int | None = typer.Option(None, "--timeout", "-t", help="New lifetime in seconds."),
    as_json: bool = JSON_OPT,
):
    """Resume paused sandboxes under the same ids (a running one is left as it is)."""
    _each(sandbox_ids, "resume", lambda c, s: c.resume(s, timeout), as_json, "resumed",
          already=("already running", "is already running"))


@commands.command("timeout")
def set_timeout(
    sandbox_id: str = ID_ARG,
    seconds: int = typer.Argument(..., help="Expire this many seconds from now (0…86400).", min=0, max=86400),
    as_json: bool = JSON_OPT,
):
    """Set when a sandbox expires (from now; may shorten its life)."""
    _each([sandbox_id], "set the timeout of", lambda c, s: c.set_timeout(s, seconds), as_json,
          f"expires in {seconds} s")


@commands.command()
def fork(
    sandbox_id: str = ID_ARG,
    n: int = typer.Option(1, "-n", "--count", help="Number of children.", min=1),
    timeout: int = typer.Option(300, "--timeout", "-t", help="Each child's lifetime in seconds."),
    as_json: bool = JSON_OPT,
):
    """Fork a running sandbox into N children.

    Memory and files are copied; the source keeps running with the same id. Exit code 1 if any child failed."""

    async def go(c: AsyncForkyard) -> int:
        try:
            with err.status(f"forking {sandbox_id} into {n}…"):
                res = await c.fork_info(sandbox_id, n, timeout)
        except NotFound as e:
            not_found(sandbox_id, e)
        if as_json:
            print_json([{"error": {"code": r.status, "message": r.message}} if isinstance(r, ForkError)
                        else {"sandbox": r.to_json()} for r in res])
        else:
            t = Table(box=None, header_style="bold")
            t.add_column("#")
            t.add_column("CHILD", no_wrap=True)
            t.add_column("RESULT")
            for i, r in enumerate(res):
                if isinstance(r, ForkError):
                    t.add_row(str(i), "-", Text(str(r), style="red"))  # server text: no markup
                else:
                    t.add_row(str(i), r.sandbox_id, "[green]running[/green]")
            print_table(t, [r.sandbox_id for r in res if not isinstance(r, ForkError)])
            if not sys.stdout.isatty():  # piped: the ids went out, the failures go to stderr
                for i, r in enumerate(res):
                    if isinstance(r, ForkError):
                        err.print(Text(f"error: child {i}: {r}"), highlight=False)
        return 1 if any(isinstance(r, ForkError) for r in res) else 0

    raise typer.Exit(run(go))
