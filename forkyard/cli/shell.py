"""Interactive shells: ``forkyard start`` (create a sandbox and attach) and ``forkyard
connect`` (attach to one). The terminal bridge is :mod:`forkyard.cli.terminal`."""

from __future__ import annotations

import typer

from forkyard.cli._common import ID_ARG, JSON_OPT, complete_template, err, not_found, parse_kv, print_json, run
from forkyard.client import AsyncForkyard, NotFound

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


@commands.command()
def start(
    template: str = typer.Argument("base", help="Template, template id or snapshot to start from.",
                                   autocompletion=complete_template),
    timeout: int = typer.Option(300, "--timeout", "-t", help="Lifetime in seconds (kept alive while attached)."),
    metadata: list[str] | None = typer.Option(None, "--metadata", "-m", help="KEY=VALUE label (repeatable)."),
    env: list[str] | None = typer.Option(None, "--env", "-e", help="KEY=VALUE environment variable (repeatable)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Do not attach a shell; print the id and exit."),
    keep: bool = typer.Option(False, "--keep", help="Keep the sandbox running after the shell exits."),
    auto_pause: bool = typer.Option(False, "--auto-pause", help="Pause instead of kill when the lifetime ends."),
    as_json: bool = JSON_OPT,
):
    """Create a sandbox and attach an interactive shell.

    The exit code is the shell's. Without --keep the sandbox is killed when the shell exits."""
    md, envs = parse_kv(metadata, "metadata"), parse_kv(env, "env")

    async def go(c: AsyncForkyard) -> int:
        info = await c.create_sandbox(template, timeout=timeout, metadata=md, envs=envs, auto_pause=auto_pause)
        if detach:
            if as_json:
                print_json(info.to_json())
            else:
                print(info.sandbox_id, flush=True)
            return 0
        err.print(f"[green]sandbox {info.sandbox_id}[/green] ({template}) — exit the shell to "
                  + ("detach" if keep else "kill it"), highlight=False)
        from forkyard.cli.terminal import attach_shell

        try:
            return await attach_shell(c, c.sandbox(info), keepalive_s=timeout)
        finally:
            if not keep:
                try:
                    await c.kill(info.sandbox_id)
                except NotFound:
                    pass
            else:
                err.print(f"sandbox {info.sandbox_id} keeps running; reattach with "
                          f"`forkyard connect {info.sandbox_id}`", highlight=False)

    raise typer.Exit(run(go))


@commands.command()
def connect(
    sandbox_id: str = ID_ARG,
    timeout: int = typer.Option(300, "--timeout", "-t", help="Keep it alive at least this many seconds."),
):
    """Attach an interactive shell to a sandbox (resumed first if paused).

    The exit code is the shell's. The sandbox keeps running afterwards."""

    async def go(c: AsyncForkyard) -> int:
        try:
            sbx = await c.connect(sandbox_id, timeout=timeout)
        except NotFound as e:
            not_found(sandbox_id, e)
        from forkyard.cli.terminal import attach_shell

        return await attach_shell(c, sbx, keepalive_s=timeout)

    raise typer.Exit(run(go))
