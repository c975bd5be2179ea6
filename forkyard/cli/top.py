"""``forkyard top``: a live terminal view (Rich) of nodes and sandboxes with their CPU
and memory, refreshing every ``--interval`` seconds, sorted by CPU, memory or age
(``--sort``, or the keys ``c`` / ``m`` / ``a`` while it runs; ``q`` quits). ``--once``
prints one frame and exits (scripts, tests); ``--json`` prints the data once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from datetime import datetime

import typer
from rich.console import Group
from rich.text import Text

from forkyard.cli._common import JSON_OPT, ago, fail, fitted_table, human_bytes, out, print_json, run
from forkyard.client import AsyncForkyard
from forkyard.ids import rfc3339

#: ``forkyard top``; :mod:`forkyard.cli.main` adds it to the ``forkyard`` app.
commands = typer.Typer()

SORTS = ("cpu", "mem", "age")
#: Sandboxes whose usage is asked for at once (each is one call to its envd).
PARALLEL = 16


async def snapshot(c: AsyncForkyard, limit: int) -> dict:
    """One sample: ``{"nodes": node metrics, "sandboxes": [{sandbox fields…, "usage":
    latest metrics or {}}]}`` for at most ``limit`` sandboxes (newest first)."""
    node, sandboxes = await asyncio.gather(c.node_metrics(), c.list_sandboxes())
    sandboxes = sandboxes[:limit]
    sem = asyncio.Semaphore(PARALLEL)

    async def usage(s) -> dict:
        if s.state != "running":
            return {}
        async with sem:
            try:
                return await c.metrics(s.sandbox_id)
            except Exception:  # noqa: BLE001 — gone or busy meanwhile: shown without usage
                return {}

    usages = await asyncio.gather(*(usage(s) for s in sandboxes))
    return {"nodes": node, "sandboxes": [{**s.to_json(), "usage": u} for s, u in zip(sandboxes, usages)],
            "time": rfc3339(time.time())}


def _sort_key(sort: str):
    def key(s: dict):
        u = s.get("usage") or {}
        if sort == "cpu":
            return -float(u.get("cpuUsedPct") or -1)
        if sort == "mem":
            return -float(u.get("memUsed") or -1)
        return s.get("startedAt") or ""  # age: oldest first
    return key


def render(data: dict, sort: str, url: str, width: int | None = None) -> Group:
    """The frame for ``data`` (from :func:`snapshot`), sandboxes sorted by ``sort``, fitted
    to ``width`` columns (default: the terminal's)."""
    node = data["nodes"]
    node_rows = []
    if "nodes" in node:
        for n in node["nodes"]:
            r = n.get("report", {})
            st = {"up": "green", "draining": "yellow"}.get(n["status"], "red")
            node_rows.append([n["nodeID"], f"[{st}]{n['status']}[/{st}]", str(r.get("running", 0)),
                              str(r.get("paused", 0)), f"{r.get('running', 0)}/{r.get('max_sandboxes', '?')}",
                              f"{r.get('vcpus_reserved', 0)}/{r.get('vcpus', '?')}", f"{r.get('load1', 0):.2f}",
                              f"{n.get('heartbeatAge', 0):.1f}s"])
    else:
        c = node.get("sandboxes", {})
        node_rows.append([url, "[green]up[/green]", str(c.get("running", 0)), str(c.get("paused", 0)),
                          f"{len(node.get('spareSlots', []))} spare slots", "-", "-", "-"])
    nodes = fitted_table(["NODE", "STATUS", "RUNNING", "PAUSED", "CAPACITY", "VCPUS", "LOAD", "HEARTBEAT"],
                         node_rows, flexible=("NODE",), width=width, title="nodes", title_justify="left")
    rows = []
    for s in sorted(data["sandboxes"], key=_sort_key(sort)):
        u = s.get("usage") or {}
        started = datetime.fromisoformat(s["startedAt"].replace("Z", "+00:00")) if s.get("startedAt") else None
        state = "[green]running[/green]" if s["state"] == "running" else "[yellow]paused[/yellow]"
        rows.append([s["sandboxID"], s.get("templateID", ""), state, ago(started).removesuffix(" ago"),
                     f"{u['cpuUsedPct']:.1f}" if "cpuUsedPct" in u else "-", str(s.get("cpuCount", "-")),
                     f"{human_bytes(u['memUsed'])}/{human_bytes(u.get('memTotal'))}" if "memUsed" in u else "-",
                     (s.get("metadata") or {}).get("forkyard.parentSandboxID", "")])
    sbx = fitted_table(["ID", "TEMPLATE", "STATE", "AGE", "CPU%", "VCPU", "MEM", "PARENT"], rows,
                       flexible=("TEMPLATE", "PARENT"), width=width,
                       title=f"sandboxes (sorted by {sort}; keys: c cpu, m mem, a age, q quit)", title_justify="left")
    header = Text(f"forkyard top — {url} — {len(data['sandboxes'])} sandboxes — {time.strftime('%H:%M:%S')}",
                  style="bold")
    return Group(header, nodes, Text(""), sbx)


@contextlib.contextmanager
def _keys(on_key):
    """While active, call ``on_key(char)`` for each key pressed (stdin a TTY: cbreak mode)."""
    if not sys.stdin.isatty():
        yield
        return
    import termios
    import tty

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    loop = asyncio.get_running_loop()
    tty.setcbreak(fd, termios.TCSANOW)  # not TCSAFLUSH: keep keys typed already
    loop.add_reader(fd, lambda: on_key(os.read(fd, 1).decode(errors="ignore")))
    try:
        yield
    finally:
        loop.remove_reader(fd)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@commands.command()
def top(
    sort: str = typer.Option("cpu", "--sort", "-s", help="Sort sandboxes by cpu, mem or age."),
    interval: float = typer.Option(2.0, "--interval", "-n", help="Seconds between refreshes (≥ 0.5)."),
    once: bool = typer.Option(False, "--once", help="Print one frame and exit."),
    limit: int = typer.Option(200, "--limit", help="Most sandboxes shown (newest first), 1-1000."),
    as_json: bool = JSON_OPT,
):
    """Live view of nodes and sandboxes with CPU and memory (Ctrl-C or q to quit)."""
    if sort not in SORTS:
        fail(f"unknown sort {sort!r}", "use --sort cpu, mem or age")
    if interval < 0.5:
        fail(f"--interval {interval} is too short", "use 0.5 seconds or more")
    if not 1 <= limit <= 1000:
        fail(f"--limit {limit} is out of range", "use 1 to 1000")

    async def go(c: AsyncForkyard):
        data = await snapshot(c, limit)
        if as_json:
            print_json(data)
            return
        if once or not sys.stdout.isatty():
            out.print(render(data, sort, c.url))
            return
        from rich.live import Live

        state = {"sort": sort, "quit": asyncio.Event(), "wake": asyncio.Event()}

        def on_key(ch: str) -> None:
            ch = ch.lower()
            if ch == "q":
                state["quit"].set()
            elif ch in "cma" and ch:
                state["sort"] = {"c": "cpu", "m": "mem", "a": "age"}[ch]
            state["wake"].set()

        # Keys first: a key pressed as soon as the first frame shows is not lost.
        with _keys(on_key), Live(render(data, sort, c.url), console=out, screen=True, auto_refresh=False) as live:
            while not state["quit"].is_set():
                state["wake"].clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(state["wake"].wait(), timeout=interval)
                if state["quit"].is_set():
                    break
                if not state["wake"].is_set():
                    data = await snapshot(c, limit)
                live.update(render(data, state["sort"], c.url), refresh=True)

    run(go)
