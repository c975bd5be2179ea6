"""Setup and template commands: auth, doctor, template list|rm|build|import|add."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import typer
from rich.table import Table

from forkyard.cli._common import JSON_OPT, err, fail, out, print_json, print_table, run
from forkyard.cli.files import progress_bar
from forkyard.client import (
    AsyncForkyard,
    AuthError,
    ForkyardError,
    NotFound,
    ServerUnreachable,
)
from forkyard.client.config import (
    config_path,
    read_config_file,
    resolve,
    write_config_file,
)
from forkyard.config import ClientSettings, user_cache_dir

#: ``auth`` and ``doctor``; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()
#: ``forkyard template``, added by :mod:`forkyard.cli.main`.
template_app = typer.Typer(help="List, delete, build and import templates.", no_args_is_help=True)


@commands.command()
def auth(
    url: str | None = typer.Option(None, "--url", help="Server URL, e.g. http://127.0.0.1:3000."),
    api_key: str | None = typer.Option(None, "--api-key", help="API key (prompted when omitted)."),
    show: bool = typer.Option(False, "--show", help="Only show what is configured and where it comes from."),
    check: bool = typer.Option(True, help="Verify URL and key against the server before saving."),
):
    """Store the server URL and API key in a 0600 config file.

    FORKYARD_URL / E2B_API_URL and E2B_API_KEY override the file."""
    path = config_path()
    if show:
        r = resolve()
        key = (r.api_key[:8] + "…") if r.api_key else "(none)"
        out.print(f"config file: {path}{'' if path.exists() else ' (missing)'}\n"
                  f"url:         {r.url}   [dim](from {r.url_source})[/dim]\n"
                  f"api key:     {key}   [dim](from {r.key_source})[/dim]", highlight=False)
        return
    try:
        current = read_config_file(path)
    except ValueError as e:
        current = {}
        err.print(f"[yellow]warning:[/yellow] {e}; it will be rewritten")
    url = (url or typer.prompt("Server URL", default=current.get("url") or resolve().url)).rstrip("/")
    if not urllib.parse.urlparse(url).scheme in ("http", "https") or not urllib.parse.urlparse(url).netloc:
        fail(f"{url!r} is not an http(s) URL", "use e.g. http://127.0.0.1:3000")
    api_key = api_key or typer.prompt("API key", hide_input=True)
    if check:
        async def verify():
            async with AsyncForkyard(url=url, api_key=api_key, timeout=10) as c:
                await c.list_templates()

        try:
            asyncio.run(verify())
        except ForkyardError as e:
            fail(f"not saved: {e.message}", e.hint if not isinstance(e, AuthError)
                 else "check the key (on the server host: cat /var/lib/forkyard/api_key), or --no-check")
    try:
        write_config_file(url, api_key, path)
    except OSError as e:
        fail(f"cannot write {path}: {e}", "set FORKYARD_CONFIG to a writable path")
    out.print(f"saved {url} and the API key to {path} (mode 0600)", highlight=False)
    env = ClientSettings()
    for var, value in (("FORKYARD_URL", env.url), ("E2B_API_URL", env.e2b_api_url), ("E2B_API_KEY", env.e2b_api_key)):
        if value:
            err.print(f"[yellow]note:[/yellow] {var} is set in your environment and overrides the file")


# -- doctor -------------------------------------------------------------------------------

def _check_runsc() -> tuple[str, str, str]:
    from forkyard.config import Settings

    runsc = Settings().runsc
    path = shutil.which(runsc)
    if not path:
        return "fail", f"runsc not found ({runsc!r})", "run ./deploy/up.sh (builds gVisor) or set FORKYARD_RUNSC"
    path = os.path.realpath(path)
    try:
        v = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20, check=False)
        first = (v.stdout or v.stderr).splitlines()[0] if (v.stdout or v.stderr) else ""
    except (OSError, subprocess.TimeoutExpired) as e:
        return "fail", f"{path} does not run: {e}", "reinstall gVisor with ./deploy/up.sh"
    if v.returncode != 0:
        return "fail", f"{path} --version exited {v.returncode}", "reinstall gVisor with ./deploy/up.sh"
    return "ok", f"{path} ({first})", ""


def _check_netns() -> tuple[str, str, str]:
    if not Path("/proc/self/ns/net").exists():
        return "fail", "kernel without network namespaces", "use a kernel with CONFIG_NET_NS (Debian 12's has it)"
    if not shutil.which("ip"):
        return "fail", "`ip` (iproute2) not installed", "apt-get install iproute2"
    if not shutil.which("iptables"):
        return "fail", "iptables not installed", "apt-get install iptables (./deploy/up.sh does it)"
    if os.geteuid() != 0:
        return "warn", "network namespaces present; not root, so creating them is not tested", \
            "the server must run as root"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        return "fail", f"`ip netns` fails: {r.stderr.strip()}", "check iproute2 and the kernel's netns support"
    return "ok", "network namespaces, ip, iptables", ""


def _check_overlay() -> tuple[str, str, str]:
    try:
        fss = Path("/proc/filesystems").read_text()
    except OSError:
        fss = ""
    if "overlay" in fss:
        return "ok", "overlay filesystem available", ""
    uname = os.uname().release
    if list(Path(f"/lib/modules/{uname}").glob("kernel/fs/overlayfs/overlay.ko*")):
        return "warn", "overlay module present but not loaded", "modprobe overlay"
    return "fail", "overlay filesystem missing", "use a kernel with CONFIG_OVERLAY_FS"


def _check_data_dir() -> tuple[str, str, str]:
    from forkyard.config import Settings

    d = Settings().data_dir
    probe = d
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        return "fail", f"{d} is not writable", "run the server as root or set FORKYARD_DATA_DIR to a writable dir"
    free = shutil.disk_usage(probe).free
    gib = free / (1 << 30)
    templates = d / "templates"
    note = "" if (templates / "base").exists() else "; template `base` not built yet (`forkyard serve` builds it)"
    if gib < 2:
        return "warn", f"{d}: only {gib:.1f} GiB free{note}", "free disk space: snapshots and forks need room"
    return "ok", f"{d} ({gib:.0f} GiB free){note}", ""


def _check_envd() -> tuple[str, str, str]:
    from forkyard.config import Settings

    p = Settings().envd_binary
    if not p.exists():
        return "fail", f"envd binary missing at {p}", "build it with `make -C envd` or ./deploy/up.sh, or set FORKYARD_ENVD"
    if not os.access(p, os.X_OK):
        return "fail", f"{p} is not executable", f"chmod +x {p}"
    return "ok", str(p), ""


async def _check_server() -> list[tuple[str, str, str, str]]:
    r = resolve()
    rows = []
    async with AsyncForkyard(timeout=10) as c:
        try:
            await c.health()
        except ServerUnreachable as e:
            return [("server", "fail", e.message, e.hint)]
        rows.append(("server", "ok", f"{r.url} answers (url from {r.url_source})", ""))
        if not r.api_key:
            rows.append(("api key", "fail", "no API key configured", "run `forkyard auth` or set E2B_API_KEY"))
            return rows
        try:
            templates = await c.list_templates()
            names = [t.template_id for t in templates]
            rows.append(("api key", "ok", f"accepted (from {r.key_source})", ""))
            if "base" in names:
                rows.append(("templates", "ok", ", ".join(names), ""))
            else:
                rows.append(("templates", "warn", ", ".join(names) or "none",
                             "restart the server without --no-build-base to build `base`"))
        except AuthError:
            hint = (f"fix or unset {r.key_source} (it comes before `forkyard auth`'s config file)"
                    if r.key_source in ("E2B_API_KEY", "FORKYARD_API_KEY")
                    else "run `forkyard auth` with the key the server printed")
            rows.append(("api key", "fail", f"rejected by the server (from {r.key_source})", hint))
        except ForkyardError as e:
            rows.append(("api key", "fail", e.message, e.hint))
    return rows


@commands.command()
def doctor(as_json: bool = JSON_OPT):
    """Check this host and the server, and say what to fix.

    Checks runsc, kernel features (netns, overlay), the data dir, the envd binary, server reachability and the API key. Exit code 1 when something fails."""
    r = resolve()
    local = urllib.parse.urlparse(r.url).hostname in ("127.0.0.1", "localhost", "::1", "0.0.0.0")
    rows: list[tuple[str, str, str, str]] = []
    for name, fn in (("runsc", _check_runsc), ("netns", _check_netns), ("overlay", _check_overlay),
                     ("data dir", _check_data_dir), ("envd", _check_envd)):
        try:
            status, detail, fix = fn()
        except Exception as e:  # noqa: BLE001 — a check must not crash the doctor
            status, detail, fix = "fail", f"check failed: {e}", ""
        if status == "fail" and not local:  # the server runs elsewhere: host checks are advisory
            status, fix = "warn", (fix + " — only needed on the host running `forkyard serve`").lstrip(" —")
        rows.append((name, status, detail, fix))
    rows += asyncio.run(_check_server())
    failed = any(s == "fail" for _, s, _, _ in rows)
    if as_json:
        print_json({"ok": not failed, "checks": [{"check": n, "status": s, "detail": d, "fix": f}
                                                  for n, s, d, f in rows]})
        raise typer.Exit(1 if failed else 0)
    t = Table(box=None, header_style="bold")
    for col in ("", "CHECK", "DETAIL", "FIX"):
        t.add_column(col)
    mark = {"ok": "[green]✔[/green]", "warn": "[yellow]![/yellow]", "fail": "[red]✘[/red]"}
    for n, s, d, f in rows:
        t.add_row(mark[s], n, d, f)
    out.print(t, highlight=False)
    out.print("[red]some checks failed[/red]" if failed else "[green]all good[/green]")
    raise typer.Exit(1 if failed else 0)


# -- templates ----------------------------------------------------------------------------

@template_app.command("ls", hidden=True)  # like `forkyard ls`, `snapshot ls`, `node ls`
@template_app.command("list")
def template_list(as_json: bool = JSON_OPT):
    """List templates sandboxes can be started from."""

    async def go(c: AsyncForkyard):
        items = await c.list_templates()
        if as_json:
            print_json([t.raw for t in items])
            return
        if not items:
            err.print("no templates")
            return
        t = Table(box=None, header_style="bold")
        for col in ("ID", "NAMES", "CPU", "MEM", "DISK", "STATUS"):
            t.add_column(col)
        for it in items:
            disk = it.raw.get("diskSizeMB")
            t.add_row(it.template_id, ",".join(it.names), str(it.cpu_count or "-"),
                      f"{it.memory_mb} MiB" if it.memory_mb else "-", f"{disk} MiB" if disk else "-",
                      it.build_status or "-")
        print_table(t, [it.template_id for it in items])

    run(go)


@template_app.command("rm")
def template_rm(template_ids: list[str] = typer.Argument(..., help="Template (or snapshot) ids."),
                as_json: bool = JSON_OPT):
    """Delete templates or snapshots (DELETE /templates/{id})."""

    async def go(c: AsyncForkyard) -> int:
        results, bad = [], 0
        for tid in template_ids:
            try:
                await c.delete_template(tid)
                results.append({"templateID": tid, "ok": True})
                if not as_json:
                    out.print(f"{tid} deleted", highlight=False)
            except ForkyardError as e:
                bad += 1
                msg = "not found" if isinstance(e, NotFound) else e.message
                results.append({"templateID": tid, "ok": False, "error": msg})
                if not as_json:
                    err.print(f"[red]error:[/red] cannot delete template {tid}: {msg}", highlight=False)
        if as_json:
            print_json(results)
        return 1 if bad else 0

    raise typer.Exit(run(go))


def _build(template, name: str, cpu: int | None, memory_mb: int | None, as_json: bool) -> None:
    """Build ``template`` (e2b ``TemplateBuilder``) on the server through the SDK's
    template build API (POST /v3/templates …); clear message when the server lacks it."""

    async def go(c: AsyncForkyard) -> int:
        from e2b import AsyncTemplate

        def on_log(entry) -> None:
            err.print(f"[dim]{getattr(entry, 'message', entry)}[/dim]", highlight=False, soft_wrap=True)

        try:
            info = await AsyncTemplate.build(template, name, cpu_count=cpu, memory_mb=memory_mb,
                                             on_build_logs=on_log, **c.sdk_params())
        except Exception as e:  # noqa: BLE001 — classified below
            status = getattr(e, "status_code", None)
            if status == 404 or str(e).startswith("404"):
                fail("template builds are not supported by this server (POST /v3/templates → 404)",
                     "start sandboxes from `base` or from a snapshot (`forkyard snapshot create`)")
            text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            fail(f"building template {name!r} failed: {text}")
        if as_json:
            print_json({"templateID": info.template_id, "buildID": info.build_id, "name": name})
        else:
            out.print(f"built template {name} ({info.template_id}); start it with `forkyard start {name}`",
                      highlight=False)
        return 0

    raise typer.Exit(run(go))


@template_app.command("build")
def template_build(
    name: str = typer.Argument(..., help="Template name (`name` or `name:tag`)."),
    dockerfile: Path = typer.Option(Path("Dockerfile"), "--dockerfile", "-f", exists=True, dir_okay=False,
                                    help="Dockerfile describing the template (FROM e2bdev/base or a template name)."),
    context: Path | None = typer.Option(None, "--context", "-c", exists=True, file_okay=False,
                                           help="Directory COPY reads from (default: the Dockerfile's)."),
    cpu: int | None = typer.Option(None, "--cpu", help="vCPUs of sandboxes from it."),
    memory_mb: int | None = typer.Option(None, "--memory-mb", help="Memory (MiB) of sandboxes from it."),
    as_json: bool = JSON_OPT,
):
    """Build a template from a Dockerfile on the server (needs its template build API)."""
    from e2b import Template

    ctx = (context or dockerfile.resolve().parent).resolve()
    template = Template(file_context_path=str(ctx)).from_dockerfile(dockerfile.read_text())
    _build(template, name, cpu, memory_mb, as_json)


@template_app.command("import")
def template_import(
    name: str = typer.Argument(..., help="Template name."),
    tarball: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True,
                                   help="Image tarball: `docker save IMAGE -o image.tar`, or a tar of an OCI "
                                        "image layout (gzip allowed)."),
    disk_mb: int | None = typer.Option(None, "--disk-mb", help="Disk size of its sandboxes in MiB "
                                       "(default: the server's FORKYARD_DISK_MB)."),
    as_json: bool = JSON_OPT,
):
    """Import a container image tarball as a template (needs the server's import API)."""
    size = tarball.stat().st_size

    async def go(c: AsyncForkyard):
        with progress_bar() as p:
            task = p.add_task(f"import {tarball.name}", total=size)
            t = await c.import_template(name, tarball, progress=lambda n: p.advance(task, n), disk_mb=disk_mb)
        if as_json:
            print_json(t.raw)
        else:
            out.print(f"imported {tarball} as template {t.template_id}; start it with `forkyard start {name}`",
                      highlight=False)

    run(go)


#: Templates ``forkyard template add`` knows how to build.
ADDABLE = ("code-interpreter",)


@template_app.command("add")
def template_add(
    which: str = typer.Argument(..., help="What to add: code-interpreter (template code-interpreter-v1, "
                                "the e2b-code-interpreter SDKs' default)."),
    name: str = typer.Option("code-interpreter-v1", "--name", help="Template name (`name` or `name:tag`)."),
    pip: list[str] | None = typer.Option(None, "--pip", help="More Python packages for the kernel (a pip "
                                         "requirement, repeatable; wheels only)."),
    cache_dir: Path | None = typer.Option(None, "--cache-dir", file_okay=False,
                                          help="Where the downloads are kept (default: ~/.cache/forkyard/NAME)."),
    cpu: int | None = typer.Option(None, "--cpu", help="vCPUs of sandboxes from it."),
    memory_mb: int | None = typer.Option(None, "--memory-mb", help="Memory (MiB) of sandboxes from it "
                                         "(default 1024)."),
    as_json: bool = JSON_OPT,
):
    """Build a ready-made template. code-interpreter: fetches the kernels' wheels (pip) and
    Deno (npm) on this host, then builds them on `base` offline (docs/templates.md)."""
    from forkyard.templates import code_interpreter as ci

    if which not in ADDABLE:
        fail(f"unknown template {which!r}", f"one of: {', '.join(ADDABLE)}")
    root = cache_dir or user_cache_dir() / which
    root.mkdir(parents=True, exist_ok=True)
    try:
        ci.prepare_context(root, list(pip or []), log=lambda m: err.print(f"[dim]{m}[/dim]", highlight=False))
    except ci.PrepareError as e:
        fail(str(e), "the host needs pip and npm and a reachable package registry")
    _build(ci.make_template(root), name, cpu, memory_mb or ci.MEMORY_MB, as_json)
