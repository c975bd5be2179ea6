"""``forkyard`` console script."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import typer
from rich.console import Console

from forkyard.config import Settings

app = typer.Typer(help="forkyard: forkable gVisor sandboxes behind an E2B-compatible API.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
console = Console(stderr=True)


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


def _fail(msg: str, code: int = 1):
    console.print(f"[red]error:[/red] {msg}")
    raise typer.Exit(code)


def _preflight(settings: Settings) -> None:
    if shutil.which(settings.runsc) is None and not Path(settings.runsc).exists():
        _fail(f"runsc not found ({settings.runsc!r}); run deploy/install.sh or set FORKYARD_RUNSC")
    if not settings.envd_binary.exists():
        _fail(f"envd binary missing at {settings.envd_binary}; build it with `make -C envd` "
              "or run deploy/install.sh, or set FORKYARD_ENVD")


@app.command()
def serve(
    host: str = typer.Option(None, help="Bind address (default 127.0.0.1, FORKYARD_HOST)."),
    port: int = typer.Option(None, help="Bind port (default 3000, FORKYARD_PORT)."),
    data_dir: Path = typer.Option(None, help="State directory (default /var/lib/forkyard)."),
    build_base: bool = typer.Option(True, help="Build the default `base` template if missing."),
    log_level: str = typer.Option("info", help="Log level."),
):
    """Start the API server (REST + sandbox proxy) on HOST:PORT (one node, no cluster)."""
    _run_node(host, port, data_dir, build_base, log_level)


def _run_node(host: str | None, port: int | None, data_dir: Path | None, build_base: bool, log_level: str,
              cluster: dict | None = None) -> None:
    """Run a node: alone (``cluster`` None) or registered with a scheduler (``cluster``
    has ``scheduler``, ``secret``, ``node_id``, ``advertise_url``, ``max_sandboxes``)."""
    import uvicorn

    from forkyard.api.app import create_app
    from forkyard.repository.errors import RepositoryConfigError
    from forkyard.templates import registry

    try:
        settings = Settings()
    except ValueError as e:  # a malformed setting (the message names it), e.g. FORKYARD_POOL
        _fail(str(e))
    if host:
        settings.host = host
    if port:
        settings.port = port
    if data_dir:
        settings.data_dir = data_dir.resolve()
    settings.cluster = cluster is not None
    _logging(log_level)
    _preflight(settings)
    if build_base:
        from forkyard.templates.base import build_base as build

        if registry.resolve(settings, "base") is None:
            console.print("[bold]Building template `base`[/bold] (once; cached afterwards)…")
        try:  # cached: returns at once when an up-to-date build exists
            build(settings, progress=_BuildProgress())
        except Exception as e:  # noqa: BLE001 — report and exit, no traceback
            _fail(f"building template `base` failed: {e}")
    _lock_net_prefix(settings.net_prefix)
    from forkyard import fsperms

    fsperms.private_umask()  # from here on every file forkyard writes is 0600 (secrets at rest)
    fsperms.lock_down(settings.data_dir)  # and an older data dir is made private too
    try:
        application = create_app(settings)
    except ValueError as e:  # e.g. a malformed FORKYARD_NET_PREFIX / FORKYARD_OUTER_NET
        _fail(f"{e} (check FORKYARD_NET_PREFIX: 2-4 lower-case letters; FORKYARD_OUTER_NET: an IPv4 range)")
    except RepositoryConfigError as e:  # the message names the setting to fix
        _fail(f"snapshot repository: {e}")
    url = f"http://{settings.host}:{settings.port}"
    if cluster is not None:
        from forkyard.cluster.agent import NodeAgent

        advertise = cluster["advertise_url"] or url
        agent = NodeAgent(application, cluster["node_id"], advertise, cluster["scheduler"], cluster["secret"],
                          cluster["max_sandboxes"])
        application = agent.wrap(application)
        print(f"forkyard node {cluster['node_id']} on {url} (advertised as {advertise}), "
              f"scheduler {cluster['scheduler']}, up to {cluster['max_sandboxes']} sandboxes", flush=True)
    else:
        key_src = "FORKYARD_API_KEY" if _env_key() else str(settings.api_key_file)
        # Plain prints: rich would wrap the export line at 80 columns when logged to a file.
        print(f"forkyard API {url}   (API key: {key_src})", flush=True)
        key_expr = "$FORKYARD_API_KEY" if _env_key() else f"$(cat {settings.api_key_file})"
        print(f"  export E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY={key_expr}", flush=True)
    # Keep-alive longer than clients' pool expiry (httpx: 5 s, the e2b SDK's default):
    # with equal timeouts the server may close a connection the client is reusing.
    tls = {}
    if settings.tls_cert or settings.tls_key:
        if not (settings.tls_cert and settings.tls_key):
            _fail("set both FORKYARD_TLS_CERT and FORKYARD_TLS_KEY (or neither)")
        for what, path in (("FORKYARD_TLS_CERT", settings.tls_cert), ("FORKYARD_TLS_KEY", settings.tls_key)):
            if not Path(path).is_file():
                _fail(f"{what}: {path} is not a file")
        tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    from forkyard.api.limits import uvicorn_limits
    from forkyard.obs.logs import UVICORN_LOG_CONFIG

    # access_log off: forkyard.obs.middleware logs every request with its request id.
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=log_level.lower(),
                timeout_graceful_shutdown=2, timeout_keep_alive=75, access_log=False,
                log_config=UVICORN_LOG_CONFIG, **uvicorn_limits(zero_copy=True), **tls)


_NET_LOCK = None


def _lock_net_prefix(prefix: str) -> None:
    """Hold ``/run/forkyard/net-<prefix>.lock`` for the life of this process: a second
    node on the same host with the same ``FORKYARD_NET_PREFIX`` would remove the first
    one's network slots, so it is refused here."""
    import fcntl
    import os

    global _NET_LOCK
    os.makedirs("/run/forkyard", mode=0o700, exist_ok=True)
    fd = os.open(f"/run/forkyard/net-{prefix}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        _fail(f"another forkyard node on this host already uses network prefix {prefix!r}; give this one its own "
              "FORKYARD_NET_PREFIX (2-4 lower-case letters) and a FORKYARD_OUTER_NET that does not overlap")
    _NET_LOCK = fd


def _logging(log_level: str, component: str = "node") -> None:
    """Structured logs for ``component`` (JSON lines, text on a TTY; ``FORKYARD_LOG_FORMAT``)
    and, with ``FORKYARD_TRACING=otlp``, OpenTelemetry tracing (:mod:`forkyard.obs.tracing`)."""
    from forkyard.obs import logs

    from forkyard.obs import tracing

    try:
        logs.setup(component, log_level)
        tracing.setup(component)
    except (ValueError, RuntimeError) as e:
        _fail(str(e))


class _BuildProgress:
    """Progress sink for the template build: debootstrap's per-package lines
    (Retrieving/Validating/Extracting/Unpacking/Configuring …) are counted, not printed,
    except every 50th; every other line is printed as it comes."""

    _CHATTY = ("I: Retrieving", "I: Validating", "I: Extracting", "I: Unpacking", "I: Configuring")

    def __init__(self) -> None:
        self.quiet = 0

    def __call__(self, line: str) -> None:
        if line.startswith(self._CHATTY):
            self.quiet += 1
            if self.quiet % 50:
                return
            line = f"{line}   ({self.quiet} package steps so far)"
        console.print(f"  [dim]{line}[/dim]", highlight=False, soft_wrap=True)


def _env_key() -> bool:
    import os

    return bool(os.environ.get("FORKYARD_API_KEY"))


from forkyard.cli import admin as _admin  # noqa: E402
from forkyard.cli import cluster as _cluster  # noqa: E402
from forkyard.cli import sandboxes as _sandboxes  # noqa: E402
from forkyard.cli import top as _top  # noqa: E402

_sandboxes.register(app)
_admin.register(app)
_cluster.register(app)
_top.register(app)


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
