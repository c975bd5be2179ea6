"""Shared CLI plumbing: consoles, error reporting, JSON output, id completion and the
sandbox-id arguments."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import typer
from rich.console import Console

from forkyard.client import AsyncForkyard, ForkyardError

#: Messages, progress and tables meant for people go to stderr unless they are the result.
err = Console(stderr=True)
#: Results (tables, ids, JSON) go to stdout.
#: Piped output is not cut at 80 columns (ids must survive `| grep`/`| awk`).
out = Console(width=None if sys.stdout.isatty() else 400)

T = TypeVar("T")

JSON_OPT = typer.Option(False, "--json", help="Print the result as JSON on stdout.")


def fitted_table(columns: list[str], rows: list[list[str]], flexible: tuple[str, ...], width: int | None = None,
                 **table_kw: Any):
    """A rich ``Table`` of ``rows`` (cells may hold rich markup) that fits ``width``
    columns (default: the results console's, e.g. an 80-column terminal) without wrapping
    a cell: every column keeps its widest cell's width except those in ``flexible``, which
    share what is left in order, cut with an ellipsis; one left under 4 columns is not
    shown. ``table_kw`` goes to ``Table`` (title, …); CPU/MEM/VCPU and ``…%`` columns are
    right-aligned."""
    from rich.table import Table
    from rich.text import Text

    natural = [max([len(col), *(Text.from_markup(r[i]).cell_len for r in rows)]) for i, col in enumerate(columns)]
    left = (width or out.width) - sum(w for c, w in zip(columns, natural) if c not in flexible) - 2 * (len(columns) - 1)
    shown: dict[int, int] = {}
    for i, col in enumerate(columns):
        if col in flexible:
            give = min(natural[i], left)
            if give >= 4:
                shown[i] = give
                left -= give
        else:
            shown[i] = natural[i]
    t = Table(box=None, header_style="bold", pad_edge=False, **table_kw)
    for i in shown:
        col = columns[i]
        justify = "right" if col.endswith("%") or col in ("CPU", "MEM", "VCPU") else "left"
        t.add_column(col, no_wrap=True, overflow="ellipsis", justify=justify, width=shown[i])
    for r in rows:
        t.add_row(*(r[i] for i in shown))
    return t


def print_table(table, ids: list[str]) -> None:
    """``table`` on a terminal; when stdout is piped, only ``ids``, one a line (for
    ``| xargs`` and ``while read``); ``--json`` gives the full rows."""
    if sys.stdout.isatty():
        out.print(table, highlight=False)
    else:
        for i in ids:
            print(i)


def _flag_help_without_value() -> None:
    """Show boolean flags in ``--help`` without a value placeholder (typer 0.29 prints
    ``--json <bool>``, which reads as if the flag took an argument)."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich
    if getattr(shown, "_forkyard", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich._forkyard = True
    TyperOption.display_type_rich = display_type_rich


_flag_help_without_value()


def fail(msg: str, hint: str = "", code: int = 1):
    """Print ``error: msg`` (and a hint) on stderr and exit with ``code``."""
    err.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
    if hint:
        err.print(f"[dim]hint:[/dim] {hint}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _sdk_error_text(e: BaseException) -> str | None:
    """A one-line text for e2b SDK exceptions, ``None`` for others."""
    try:
        from e2b.exceptions import SandboxException
    except ImportError:  # pragma: no cover
        return None
    if isinstance(e, SandboxException):
        return f"{type(e).__name__}: {e}".strip()
    return None


def run(coro_fn: Callable[[AsyncForkyard], Awaitable[T]]) -> T:
    """Run ``coro_fn(client)`` on a fresh event loop with a client from the config and
    turn failures into messages: :class:`ForkyardError` and e2b SDK errors exit 1 with
    what failed and what to do; Ctrl-C exits 130. ``typer.Exit`` passes through."""

    async def main() -> T:
        async with AsyncForkyard() as client:
            return await coro_fn(client)

    try:
        return asyncio.run(main())
    except ForkyardError as e:
        fail(e.message, e.hint)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]")
        raise typer.Exit(130)
    except (typer.Exit, typer.Abort, SystemExit):
        raise
    except Exception as e:
        text = _sdk_error_text(e)
        if text is None:
            raise
        fail(text)
    raise AssertionError("unreachable")  # pragma: no cover


def print_json(data: Any) -> None:
    """Pretty JSON on stdout (datetimes as ISO strings, bytes as UTF-8)."""

    def default(o):
        if isinstance(o, datetime):
            return o.isoformat().replace("+00:00", "Z")
        if isinstance(o, (bytes, bytearray)):
            return o.decode("utf-8", "replace")
        return str(o)

    sys.stdout.write(json.dumps(data, indent=2, default=default) + "\n")
    sys.stdout.flush()


def ago(ts: datetime | None) -> str:
    """``3m ago`` / ``in 4m`` relative to now; ``-`` for None."""
    if ts is None:
        return "-"
    d = (ts - datetime.now(UTC)).total_seconds()
    s = abs(int(d))
    txt = f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"
    return f"in {txt}" if d >= 0 else f"{txt} ago"


def human_bytes(n: float | None) -> str:
    """``1.5 MiB`` style size; ``-`` for None."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def complete_sandbox_id(incomplete: str) -> list[str]:
    """Shell completion for sandbox ids (asks the server, 2 s budget; silent on errors)."""
    async def ids() -> list[str]:
        async with AsyncForkyard(timeout=2) as c:
            return [s.sandbox_id for s in await c.list_sandboxes()]

    try:
        return [i for i in asyncio.run(ids()) if i.startswith(incomplete)]
    except Exception:  # noqa: BLE001 — completion must never print errors
        return []


def complete_template(incomplete: str) -> list[str]:
    """Shell completion for template names (asks the server; silent on errors)."""
    async def names() -> list[str]:
        async with AsyncForkyard(timeout=2) as c:
            return [t.template_id for t in await c.list_templates()]

    try:
        return [n for n in asyncio.run(names()) if n.startswith(incomplete)]
    except Exception:  # noqa: BLE001
        return []


def parse_kv(items: list[str] | None, what: str) -> dict[str, str]:
    """``["k=v", …]`` → dict; exits with a message on an item without ``=``."""
    outd: dict[str, str] = {}
    for it in items or []:
        if "=" not in it:
            fail(f"{what} {it!r} is not KEY=VALUE")
        k, v = it.split("=", 1)
        outd[k] = v
    return outd


ID_ARG = typer.Argument(..., help="Sandbox id (see `forkyard ls`).", autocompletion=complete_sandbox_id)
IDS_ARG = typer.Argument(..., help="Sandbox ids (see `forkyard ls`).", autocompletion=complete_sandbox_id)


def not_found(sandbox_id: str, error: Exception | None = None) -> None:
    """Fail with "sandbox … not found", plus why it died when the server says (a sandbox
    killed for its resources: "…: it was killed: out of memory (limit 512 MiB), at …")."""
    cause = str(error or "").partition(": it was killed: ")[2]
    fail(f"sandbox {sandbox_id} not found" + (f": it was killed: {cause}" if cause else ""),
         "list sandboxes with `forkyard ls`")
