"""Sandbox commands: start, connect, exec, ls, info, pause, resume, fork, snapshot,
timeout, rm/kill, upload, download, logs."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table
from rich.text import Text

from forkyard.cli._common import (
    JSON_OPT,
    ago,
    complete_sandbox_id,
    complete_template,
    err,
    fail,
    human_bytes,
    out,
    parse_kv,
    print_json,
    print_table,
    run,
)
from forkyard.client import AsyncForkyard, Conflict, ForkError, NotFound, NotSupported

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


ID_ARG = typer.Argument(..., help="Sandbox id (see `forkyard ls`).", autocompletion=complete_sandbox_id)
IDS_ARG = typer.Argument(..., help="Sandbox ids (see `forkyard ls`).", autocompletion=complete_sandbox_id)

snapshot_app = typer.Typer(help="Create, list and delete snapshots (usable as templates).", no_args_is_help=True)

#: Terminal control characters (ESC, BEL, …) in text a sandbox wrote become "?" when
#: printed, so a sandbox cannot drive the operator's terminal.
_NO_CONTROL = {c: "?" for c in [*range(0x00, 0x09), *range(0x0a, 0x20), 0x7f]}


def _not_found(sandbox_id: str, error: Exception | None = None) -> None:
    """Fail with "sandbox … not found", plus why it died when the server says (a sandbox
    killed for its resources: "…: it was killed: out of memory (limit 512 MiB), at …")."""
    cause = str(error or "").partition(": it was killed: ")[2]
    fail(f"sandbox {sandbox_id} not found" + (f": it was killed: {cause}" if cause else ""),
         "list sandboxes with `forkyard ls`")


def register(app: typer.Typer) -> None:
    """Add the sandbox commands to ``app``."""
    app.add_typer(snapshot_app, name="snapshot")

    @app.command()
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

    @app.command()
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
                _not_found(sandbox_id, e)
            from forkyard.cli.terminal import attach_shell

            return await attach_shell(c, sbx, keepalive_s=timeout)

        raise typer.Exit(run(go))

    @app.command("exec", context_settings={"ignore_unknown_options": True})
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
                _not_found(sandbox_id, e)

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

    @app.command("ls")
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
            t = Table(box=None, header_style="bold")
            t.add_column("ID", no_wrap=True)
            for col in ("TEMPLATE", "STATE", "STARTED", "EXPIRES", "CPU", "MEM", "METADATA"):
                t.add_column(col)
            for s in items:
                st = "[green]running[/green]" if s.state == "running" else "[yellow]paused[/yellow]"
                expires = "-" if s.state == "paused" else ago(s.end_at)
                t.add_row(s.sandbox_id, s.template_id, st, ago(s.started_at), expires, str(s.cpu_count or "-"),
                          f"{s.memory_mb} MiB" if s.memory_mb else "-",
                          " ".join(f"{k}={v}" for k, v in s.metadata.items()))
            print_table(t, [s.sandbox_id for s in items])

        run(go)

    @app.command()
    def info(sandbox_id: str = ID_ARG, as_json: bool = JSON_OPT):
        """Show one sandbox: state, template, times, limits, metadata, current usage."""

        async def go(c: AsyncForkyard):
            try:
                s = await c.get_sandbox(sandbox_id)
            except NotFound as e:
                _not_found(sandbox_id, e)
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

    @app.command("rm")
    def rm(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
        """Kill sandboxes (running or paused). Alias: kill."""
        _each(sandbox_ids, "kill", lambda c, s: c.kill(s), as_json, "killed")

    @app.command("kill", hidden=True)
    def kill(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
        """Kill sandboxes (alias of rm)."""
        _each(sandbox_ids, "kill", lambda c, s: c.kill(s), as_json, "killed")

    @app.command()
    def pause(sandbox_ids: list[str] = IDS_ARG, as_json: bool = JSON_OPT):
        """Pause sandboxes: memory and files are checkpointed; resume continues them (a
        paused one is left as it is)."""
        _each(sandbox_ids, "pause", lambda c, s: c.pause(s), as_json, "paused",
              already=("is paused", "is already paused"))

    @app.command()
    def resume(
        sandbox_ids: list[str] = IDS_ARG,
        timeout: int | None = typer.Option(None, "--timeout", "-t", help="New lifetime in seconds."),
        as_json: bool = JSON_OPT,
    ):
        """Resume paused sandboxes under the same ids (a running one is left as it is)."""
        _each(sandbox_ids, "resume", lambda c, s: c.resume(s, timeout), as_json, "resumed",
              already=("already running", "is already running"))

    @app.command("timeout")
    def set_timeout(
        sandbox_id: str = ID_ARG,
        seconds: int = typer.Argument(..., help="Expire this many seconds from now (0…86400).", min=0, max=86400),
        as_json: bool = JSON_OPT,
    ):
        """Set when a sandbox expires (from now; may shorten its life)."""
        _each([sandbox_id], "set the timeout of", lambda c, s: c.set_timeout(s, seconds), as_json,
              f"expires in {seconds} s")

    @app.command()
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
                _not_found(sandbox_id, e)
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

    @app.command()
    def upload(
        sandbox_id: str = ID_ARG,
        local: Path = typer.Argument(..., help="Local file.", exists=True, dir_okay=False, readable=True),
        remote: str = typer.Argument(..., help="Path in the sandbox (ending in / → keep the file name)."),
        user: str | None = typer.Option(None, "--user", "-u", help="Owner in the sandbox (default: user)."),
    ):
        """Copy a local file into a sandbox, with a progress bar."""
        dest = remote + local.name if remote.endswith("/") else remote
        size = local.stat().st_size

        async def go(c: AsyncForkyard):
            try:
                sbx = await c.connect(sandbox_id)
            except NotFound as e:
                _not_found(sandbox_id, e)
            with _progress() as p:
                task = p.add_task(f"upload {local.name}", total=size)

                async def chunks():
                    with open(local, "rb") as f:  # noqa: ASYNC230 — sequential 1 MiB reads
                        while chunk := f.read(1 << 20):
                            p.advance(task, len(chunk))
                            yield chunk

                await sbx.files.write(dest, chunks(), user=user, request_timeout=0)
            out.print(f"{local} → {sandbox_id}:{dest} ({human_bytes(size)})", highlight=False)

        run(go)

    @app.command()
    def download(
        sandbox_id: str = ID_ARG,
        remote: str = typer.Argument(..., help="File path in the sandbox."),
        local: Path | None = typer.Argument(None, help="Local path (default: the file name, here; "
                                                          "a directory → keep the name)."),
        user: str | None = typer.Option(None, "--user", "-u", help="Read as this user."),
    ):
        """Copy a file out of a sandbox, with a progress bar."""
        dest = local or Path(os.path.basename(remote.rstrip("/")))
        if dest.is_dir():
            dest = dest / os.path.basename(remote.rstrip("/"))

        async def go(c: AsyncForkyard):
            from e2b.exceptions import NotFoundException

            try:
                sbx = await c.connect(sandbox_id)
            except NotFound as e:
                _not_found(sandbox_id, e)
            try:
                entry = await sbx.files.get_info(remote, user=user)
            except NotFoundException:
                fail(f"{remote} does not exist in sandbox {sandbox_id}")
            if entry.type is not None and getattr(entry.type, "value", entry.type) == "dir":
                fail(f"{remote} is a directory; download files one by one "
                     f"(list them with `forkyard exec {sandbox_id} -- ls {shlex.quote(remote)}`)")
            tmp = dest.with_name(dest.name + ".part")
            got = 0
            try:
                with _progress() as p, open(tmp, "wb") as f:  # noqa: ASYNC230
                    task = p.add_task(f"download {os.path.basename(remote)}", total=entry.size)
                    stream = await sbx.files.read(remote, format="stream", user=user)
                    async with stream:
                        async for chunk in stream:
                            f.write(chunk)
                            got += len(chunk)
                            p.advance(task, len(chunk))
                os.replace(tmp, dest)
            finally:
                if tmp.exists():
                    tmp.unlink()
            out.print(f"{sandbox_id}:{remote} → {dest} ({human_bytes(got)})", highlight=False)

        run(go)

    @app.command()
    def logs(sandbox_id: str = ID_ARG, as_json: bool = JSON_OPT):
        """Show a sandbox's logs: envd's and the runtime's lines since it last started or
        resumed, including each process envd started and how it ended (or, from a server
        without a logs endpoint, its running processes).

        When the server has no logs endpoint this says so and lists the processes running in the sandbox, from envd."""

        async def go(c: AsyncForkyard) -> int:
            try:
                lines = await c.logs(sandbox_id)
            except NotFound as e:
                _not_found(sandbox_id, e)
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
                _not_found(sandbox_id, e)
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


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False)
