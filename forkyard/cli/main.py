"""The ``forkyard`` console script: the one place the CLI is put together from its
command modules (each holds one concern and never imports this one)."""

from __future__ import annotations

import inspect
import sys

import typer

from forkyard.cli import admin, cluster, execute, files, info, lifecycle, logs, serve, shell, snapshots, top

app = typer.Typer(help="forkyard: forkable gVisor sandboxes behind an E2B-compatible API.",
                  no_args_is_help=True, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("forkyard")
        except PackageNotFoundError:  # run from a checkout without installing
            v = "0.1.0"
        print(f"forkyard {v}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", help="Print the version and exit.", callback=_version,
                                 is_eager=True),
) -> None:
    """forkyard: forkable gVisor sandboxes behind an E2B-compatible API."""


# Every command, in the order `forkyard --help` lists them: a Typer added without a name
# hands its commands to the root; the named groups follow.
for _commands in (
    serve.commands,      # serve
    shell.commands,      # start, connect
    execute.commands,    # exec
    info.commands,       # ls, info
    lifecycle.commands,  # rm, kill, pause, resume, timeout, fork
    files.commands,      # upload, download
    logs.commands,       # logs
    admin.commands,      # auth, doctor
    cluster.commands,    # scheduler, gateway
    top.commands,        # top
):
    app.add_typer(_commands)
app.add_typer(snapshots.snapshot_app, name="snapshot")
app.add_typer(admin.template_app, name="template")
app.add_typer(cluster.node_app, name="node")
app.add_typer(cluster.cluster_app, name="cluster")


def reflow(doc: str) -> str:
    """``doc`` (a docstring) with the hard wraps inside each paragraph joined, so the
    terminal's width wraps ``--help`` instead of the source's 88 columns. Paragraphs stay
    apart (blank lines); lines that start a list item (``-``, ``*``, ``•``) or are indented
    keep their own line."""
    out: list[str] = []
    for line in inspect.cleandoc(doc).splitlines():
        keep = not line.strip() or line[0].isspace() or line.lstrip()[:2] in ("- ", "* ", "• ")
        if out and out[-1].strip() and not keep and not out[-1][0].isspace():
            out[-1] += " " + line.strip()
        else:
            out.append(line)
    return "\n".join(out)


def _reflow_all(group: typer.Typer) -> None:
    """Set every command's help (from its docstring, reflowed) in ``group`` and below."""
    for command in group.registered_commands:
        if command.help is None and command.callback is not None and command.callback.__doc__:
            command.help = reflow(command.callback.__doc__)
    for sub in group.registered_groups:
        if sub.typer_instance is not None:
            _reflow_all(sub.typer_instance)


_reflow_all(app)


def main() -> None:  # pragma: no cover - console entry
    """Console entry point: run the Typer app, then leave without interpreter finalization.

    The e2b SDK talks to envd through pyqwest, whose tokio threads may still be handing a
    finished response back to Python when the interpreter finalizes; CPython 3.11 then
    ``pthread_exit``s that Rust thread and glibc aborts the process (exit 134 after the
    command already succeeded or failed cleanly; see curioswitch/pyqwest#164). Every
    command has finished its work and closed its clients when ``app()`` returns, so we
    flush stdout/stderr and ``os._exit`` with the command's exit code instead.
    """
    import os

    code: int = 0
    try:
        app()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:  # sys.exit("message") prints the message and exits 1
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 — a closed pipe must not change the exit code
                pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
