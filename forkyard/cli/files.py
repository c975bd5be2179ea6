"""Files in and out of a sandbox with a progress bar: ``forkyard upload`` and
``download`` (:func:`progress_bar` serves ``template import`` too)."""

from __future__ import annotations

import os
import shlex
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

from forkyard.cli._common import ID_ARG, err, fail, human_bytes, not_found, out, run
from forkyard.client import AsyncForkyard, NotFound

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


@commands.command()
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
            not_found(sandbox_id, e)
        with progress_bar() as p:
            task = p.add_task(f"upload {local.name}", total=size)

            async def chunks():
                with open(local, "rb") as f:  # noqa: ASYNC230 — sequential 1 MiB reads
                    while chunk := f.read(1 << 20):
                        p.advance(task, len(chunk))
                        yield chunk

            await sbx.files.write(dest, chunks(), user=user, request_timeout=0)
        out.print(f"{local} → {sandbox_id}:{dest} ({human_bytes(size)})", highlight=False)

    run(go)


@commands.command()
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
            not_found(sandbox_id, e)
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
            with progress_bar() as p, open(tmp, "wb") as f:  # noqa: ASYNC230
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


def progress_bar() -> Progress:
    """A transfer progress bar on stderr (bytes, speed, time left)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=err, transient=False)
