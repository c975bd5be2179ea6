"""What sandboxes there are and what each is now: ``forkyard ls`` and ``info``."""

from __future__ import annotations

import typer
from rich.table import Table

from forkyard.cli._common import (
    ID_ARG,
    JSON_OPT,
    ago,
    err,
    fail,
    human_bytes,
    not_found,
    out,
    parse_kv,
    print_json,
    fitted_table,
    print_table,
    run,
)
from forkyard.client import AsyncForkyard, NotFound

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


@commands.command("ls")
def ls(
    state: list[str] | None = typer.Option(None, "--state", "-s", help="running or paused (repeatable)."),
    metadata: list[str] | None = typer.Option(None, "--metadata", "-m", help="KEY=VALUE filter (repeatable)."),
    template: str | None = typer.Option(None, "--template", help="Only sandboxes of this template."),
    as_json: bool = JSON_OPT,
):
    """List sandboxes (running and paused, newest first)."""
    for s in state or []:
        if s not in ("running", "paused"):
            fail(f"unknown state {s!r}", "use --state running or --state paused")
    md = parse_kv(metadata, "metadata")

    async def go(c: AsyncForkyard):
        items = await c.list_sandboxes(state=state, metadata=md, template=template)
        if as_json:
            print_json([s.to_json() for s in items])
            return
        if not items:
            err.print("no sandboxes" + (" match" if (state or md or template) else ""))
            return
        rows = []
        for s in items:
            st = "[green]running[/green]" if s.state == "running" else "[yellow]paused[/yellow]"
            expires = "-" if s.state == "paused" else ago(s.end_at)
            rows.append([s.sandbox_id, s.template_id, st, ago(s.started_at), expires, str(s.cpu_count or "-"),
                         f"{s.memory_mb} MiB" if s.memory_mb else "-",
                         " ".join(f"{k}={v}" for k, v in s.metadata.items())])
        t = fitted_table(["ID", "TEMPLATE", "STATE", "STARTED", "EXPIRES", "CPU", "MEM", "METADATA"], rows,
                         flexible=("TEMPLATE", "METADATA"))
        print_table(t, [s.sandbox_id for s in items])

    run(go)


@commands.command()
def info(sandbox_id: str = ID_ARG, as_json: bool = JSON_OPT):
    """Show one sandbox: state, template, times, limits, metadata, current usage."""

    async def go(c: AsyncForkyard):
        try:
            s = await c.get_sandbox(sandbox_id)
        except NotFound as e:
            not_found(sandbox_id, e)
        m = {}
        if s.state == "running":
            try:
                m = await c.metrics(sandbox_id)
            except Exception:  # noqa: BLE001 — usage is optional
                m = {}
        if as_json:
            print_json({**s.to_json(), "metrics": m})
            return
        t = Table(box=None, show_header=False)
        t.add_column(style="bold")
        t.add_column()
        rows = [("id", s.sandbox_id), ("template", s.template_id), ("state", s.state),
                ("started", f"{s.started_at:%Y-%m-%d %H:%M:%S} UTC ({ago(s.started_at)})" if s.started_at else "-"),
                ("expires", f"{s.end_at:%Y-%m-%d %H:%M:%S} UTC ({ago(s.end_at)})" if s.end_at else "-"),
                ("on expiry", s.on_timeout or "-"), ("cpus", str(s.cpu_count or "-")),
                ("memory", f"{s.memory_mb} MiB" if s.memory_mb else "-"), ("envd", s.envd_version or "-")]
        rows += [(f"metadata {k}", v) for k, v in s.metadata.items()]
        if m:
            rows += [("cpu used", f"{m.get('cpuUsedPct', 0):.1f} %"),
                     ("mem used", f"{human_bytes(m.get('memUsed'))} / {human_bytes(m.get('memTotal'))}"),
                     ("disk used", f"{human_bytes(m.get('diskUsed'))} / {_disk_total(m.get('diskTotal'))}")]
        for k, v in rows:
            t.add_row(k, v)
        out.print(t, highlight=False)

    run(go)


def _disk_total(n) -> str:
    """Disk size, or ``unlimited`` for gVisor's "no limit" (close to 2**63 bytes)."""
    return "unlimited" if isinstance(n, (int, float)) and n >= 1 << 62 else human_bytes(n)
