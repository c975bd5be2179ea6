"""``forkyard snapshot create|list|rm``: snapshots of running sandboxes (usable as
templates)."""

from __future__ import annotations

import typer
from rich.table import Table

from forkyard.cli._common import ID_ARG, JSON_OPT, ago, err, human_bytes, not_found, out, print_json, print_table, run
from forkyard.client import AsyncForkyard, NotFound

#: ``forkyard snapshot``, added by :mod:`forkyard.cli.main`.
snapshot_app = typer.Typer(help="Create, list and delete snapshots (usable as templates).", no_args_is_help=True)


@snapshot_app.command("create")
def snapshot_create(
    sandbox_id: str = ID_ARG,
    name: str | None = typer.Option(None, "--name", help="Name to start sandboxes from (`forkyard start NAME`)."),
    as_json: bool = JSON_OPT,
):
    """Snapshot a running sandbox (memory + files); it keeps running."""

    async def go(c: AsyncForkyard):
        try:
            with err.status(f"snapshotting {sandbox_id}…"):
                s = await c.create_snapshot(sandbox_id, name)
        except NotFound as e:
            not_found(sandbox_id, e)
        if as_json:
            print_json(s.raw)
        else:
            out.print(s.snapshot_id, highlight=False)

    run(go)


@snapshot_app.command("list")
@snapshot_app.command("ls", hidden=True)
def snapshot_list(
    sandbox_id: str | None = typer.Option(None, "--sandbox", help="Only snapshots of this sandbox."),
    name: str | None = typer.Option(None, "--name", help="Only snapshots with this name."),
    as_json: bool = JSON_OPT,
):
    """List snapshots, newest first."""

    async def go(c: AsyncForkyard):
        items = sorted(await c.list_snapshots(sandbox_id, name), key=lambda s: s.created_at.timestamp() if s.created_at else 0, reverse=True)
        if as_json:
            print_json([s.raw for s in items])
            return
        if not items:
            err.print("no snapshots")
            return
        t = Table(box=None, header_style="bold")
        t.add_column("ID", no_wrap=True)
        for col in ("NAMES", "SOURCE", "TEMPLATE", "SIZE", "CREATED"):
            t.add_column(col)
        for s in items:
            t.add_row(s.snapshot_id, ",".join(s.names), s.sandbox_id or "-", s.template_id or "-",
                      human_bytes(s.size_bytes), ago(s.created_at))
        print_table(t, [s.snapshot_id for s in items])

    run(go)


@snapshot_app.command("rm")
def snapshot_rm(snapshot_ids: list[str] = typer.Argument(..., help="Snapshot ids."), as_json: bool = JSON_OPT):
    """Delete snapshots."""

    async def go(c: AsyncForkyard) -> int:
        results, bad = [], 0
        for sid in snapshot_ids:
            try:
                await c.delete_snapshot(sid)
                results.append({"snapshotID": sid, "ok": True})
                if not as_json:
                    out.print(f"{sid} deleted", highlight=False)
            except NotFound:
                bad += 1
                results.append({"snapshotID": sid, "ok": False, "error": "not found"})
                if not as_json:
                    err.print(f"[red]error:[/red] snapshot {sid} not found (see `forkyard snapshot list`)",
                              highlight=False)
        if as_json:
            print_json(results)
        return 1 if bad else 0

    raise typer.Exit(run(go))
