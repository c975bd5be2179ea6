"""Running a node in this process: ``forkyard serve`` and what ``forkyard node`` shares
with it (:func:`run_node`), plus the logging set-up of every server command
(:func:`setup_logging`: node, scheduler, gateway)."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from forkyard.cli._common import err, fail
from forkyard.config import Settings

#: This module's commands; :mod:`forkyard.cli.main` adds them to the ``forkyard`` app.
commands = typer.Typer()


def _preflight(settings: Settings) -> None:
    if shutil.which(settings.runsc) is None and not Path(settings.runsc).exists():
        fail(f"runsc not found ({settings.runsc!r}); run deploy/install.sh or set FORKYARD_RUNSC")
    if not settings.envd_binary.exists():
        fail(f"envd binary missing at {settings.envd_binary}; build it with `make -C envd` "
             "or run deploy/install.sh, or set FORKYARD_ENVD")


@commands.command()
def serve(
    host: str = typer.Option(None, help="Bind address (default 127.0.0.1, FORKYARD_HOST)."),
    port: int = typer.Option(None, help="Bind port (default 3000, FORKYARD_PORT)."),
    data_dir: Path = typer.Option(None, help="State directory (default /var/lib/forkyard)."),
    build_base: bool = typer.Option(True, help="Build the default `base` template if missing."),
    log_level: str = typer.Option("info", help="Log level."),
):
    """Start the API server (REST + sandbox proxy) on HOST:PORT (one node, no cluster)."""
    run_node(host, port, data_dir, build_base, log_level)


def run_node(host: str | None, port: int | None, data_dir: Path | None, build_base: bool, log_level: str,
             cluster: dict | None = None) -> None:
    """Run a node until it is stopped: alone (``cluster`` None) or registered with a
    scheduler (``cluster`` has ``scheduler``, ``secret``, ``node_id``, ``advertise_url``,
    ``max_sandboxes``). Exits (``typer.Exit``, code 1) with a message on a bad setting,
    a missing runsc/envd, a failed ``base`` build or a taken network prefix."""
    import uvicorn

    from forkyard.node import build_node
    from forkyard.repository.errors import RepositoryConfigError
    from forkyard.orchestrator import images

    try:
        settings = Settings()
    except ValueError as e:  # a malformed setting (the message names it), e.g. FORKYARD_POOL
        fail(str(e))
    if host:
        settings.host = host
    if port:
        settings.port = port
    if data_dir:
        settings.data_dir = data_dir.resolve()
    settings.cluster = cluster is not None
    setup_logging(log_level)
    _preflight(settings)
    # Before anything touches the data dir or the host's network: a second server on the
    # same data dir would adopt and remove the first one's sandboxes and disks.
    lock_data_dir(settings.data_dir)
    check_port_free(settings.host, settings.port)
    if build_base:
        from forkyard.templates.base import build_base as build

        if images.resolve(settings, "base") is None:
            err.print("[bold]Building template `base`[/bold] (once; cached afterwards)…")
        try:  # cached: returns at once when an up-to-date build exists
            build(settings, progress=_BuildProgress())
        except Exception as e:  # noqa: BLE001 — report and exit, no traceback
            fail(f"building template `base` failed: {e}")
    lock_net_prefix(settings.net_prefix)
    from forkyard import fsperms

    fsperms.private_umask()  # from here on every file forkyard writes is 0600 (secrets at rest)
    fsperms.lock_down(settings.data_dir)  # and an older data dir is made private too
    try:
        node = build_node(settings)
    except ValueError as e:  # e.g. a malformed FORKYARD_NET_PREFIX / FORKYARD_OUTER_NET
        fail(f"{e} (check FORKYARD_NET_PREFIX: 2-4 lower-case letters; FORKYARD_OUTER_NET: an IPv4 range)")
    except RepositoryConfigError as e:  # the message names the setting to fix
        fail(f"snapshot repository: {e}")
    try:
        node.preflight()
    except ValueError as e:  # the message names the route and the setting
        fail(str(e))
    application = node.app
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
        key_src = "FORKYARD_API_KEY" if settings.api_key else str(settings.api_key_file)
        # Plain prints: rich would wrap the export line at 80 columns when logged to a file.
        print(f"forkyard API {url}   (API key: {key_src})", flush=True)
        key_expr = "$FORKYARD_API_KEY" if settings.api_key else f"$(cat {settings.api_key_file})"
        print(f"  export E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY={key_expr}", flush=True)
    # Keep-alive longer than clients' pool expiry (httpx: 5 s, the e2b SDK's default):
    # with equal timeouts the server may close a connection the client is reusing.
    tls = {}
    if settings.tls_cert or settings.tls_key:
        if not (settings.tls_cert and settings.tls_key):
            fail("set both FORKYARD_TLS_CERT and FORKYARD_TLS_KEY (or neither)")
        for what, path in (("FORKYARD_TLS_CERT", settings.tls_cert), ("FORKYARD_TLS_KEY", settings.tls_key)):
            if not Path(path).is_file():
                fail(f"{what}: {path} is not a file")
        tls = {"ssl_certfile": str(settings.tls_cert), "ssl_keyfile": str(settings.tls_key)}
    from forkyard.api.limits import uvicorn_limits
    from forkyard.obs.logs import UVICORN_LOG_CONFIG

    # access_log off: forkyard.obs.middleware logs every request with its request id.
    uvicorn.run(application, host=settings.host, port=settings.port, log_level=log_level.lower(),
                timeout_graceful_shutdown=2, timeout_keep_alive=75, access_log=False,
                log_config=UVICORN_LOG_CONFIG, **uvicorn_limits(zero_copy=True), **tls)


_NET_LOCK = None
_DATA_LOCK = None
#: The data dir's lock file (holds the pid of the server that has it).
DATA_LOCK_NAME = "server.lock"


def lock_data_dir(data_dir: Path) -> None:
    """Hold ``<data_dir>/server.lock`` (``flock``, with this process's pid in it) for
    the life of this process: one server per data dir. A second one would adopt the
    first one's sandboxes, remove its warm pool and spare disks as orphans and then fail
    to bind its port (seen), so it is refused here, before it changes anything (exit 1
    with a message naming the holder's pid). The lock ends with the process, however it
    ends (``kill -9`` included): a restart after a crash is not refused."""
    import fcntl
    import os

    global _DATA_LOCK
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = data_dir / DATA_LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        fail(f"another forkyard server (pid {holder}) already uses data dir {data_dir}: it is running (stop it "
             "first, e.g. `kill -TERM PID`), or give this one its own data dir (FORKYARD_DATA_DIR or --data-dir)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _DATA_LOCK = fd


def check_port_free(host: str, port: int) -> None:
    """Exit 1 with a message when ``host:port`` cannot be listened on (in use, or an
    address this host does not have) — checked before the node starts, since uvicorn
    binds only after the node's start-up (adopting sandboxes, network slots) is done."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        fail(f"cannot listen on {host}:{port}: {e} (check FORKYARD_HOST / --host)")
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME-WAIT is no conflict
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                fail(f"port {port} on {host} is already in use (another forkyard server? `ss -ltnp 'sport = :{port}'` "
                     "shows which process): stop it, or give this one another port (FORKYARD_PORT or --port)")
            fail(f"cannot listen on {host}:{port}: {e} (check FORKYARD_HOST / --host)")


def lock_net_prefix(prefix: str) -> None:
    """Hold ``/run/forkyard/net-<prefix>.lock`` for the life of this process: a second
    node on the same host with the same ``FORKYARD_NET_PREFIX`` would remove the first
    one's network slots, so it is refused here (exit 1 with a message)."""
    import fcntl
    import os

    global _NET_LOCK
    os.makedirs("/run/forkyard", mode=0o700, exist_ok=True)
    path = f"/run/forkyard/net-{prefix}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        held = "; ".join(_holders(path)) or "a process this one cannot see"
        fail(f"another forkyard node on this host already uses network prefix {prefix!r} (held by {held}); give "
             "this one its own FORKYARD_NET_PREFIX (2-4 lower-case letters) and a FORKYARD_OUTER_NET that does not "
             "overlap")
    _NET_LOCK = fd


def _holders(path: str) -> list[str]:
    """``["pid 123 (forkyard node ...)", ...]``: the processes with ``path`` open (from
    ``/proc/<pid>/fd``), for the message that names who holds a network prefix."""
    import os

    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd")):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                found.append(f"pid {pid} ({cmd[:120]})")
        except OSError:
            continue  # gone, or not ours to read
    return found


def setup_logging(log_level: str, component: str = "node") -> None:
    """Structured logs for ``component`` (JSON lines, text on a TTY; ``FORKYARD_LOG_FORMAT``)
    and, with ``FORKYARD_TRACING=otlp``, OpenTelemetry tracing (:mod:`forkyard.obs.tracing`).
    Exits 1 with a message on a bad setting."""
    from forkyard.obs import logs, tracing

    try:
        logs.setup(component, log_level)
        tracing.setup(component)
    except (ValueError, RuntimeError) as e:
        fail(str(e))


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
        err.print(f"  [dim]{line}[/dim]", highlight=False, soft_wrap=True)
