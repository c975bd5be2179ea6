"""Cluster commands: ``forkyard node`` (run / drain / ls), ``forkyard scheduler``,
``forkyard gateway``. Settings: :mod:`forkyard.cluster.config`."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import typer

from forkyard.cli._common import fail
from forkyard.cli.serve import run_node, setup_logging
from forkyard.config import ClusterSettings

#: The scheduler and gateway commands; :mod:`forkyard.cli.main` adds them to the app.
commands = typer.Typer()
#: ``forkyard node`` (run, drain, undrain, ls), added by :mod:`forkyard.cli.main`.
node_app = typer.Typer(help="Run a node, or manage the cluster's nodes.", no_args_is_help=False,
                       invoke_without_command=True)

SCHEDULER_OPT = typer.Option(None, "--scheduler", help="Scheduler URL (FORKYARD_SCHEDULER_URL, "
                                                       "default http://127.0.0.1:9090).")
REDIS_OPT = typer.Option(None, "--redis", help="Redis URL (FORKYARD_REDIS_URL, default redis://127.0.0.1:6379/0).")


def _secret() -> str:
    from forkyard.cluster.config import ClusterConfigError, load_secret

    try:
        return load_secret()
    except ClusterConfigError as e:
        fail(str(e))


def _scheduler(url: str | None) -> str:
    from forkyard.cluster.config import scheduler_url

    return (url or scheduler_url()).rstrip("/")


@node_app.callback(invoke_without_command=True)
def node(
    ctx: typer.Context,
    host: str = typer.Option(None, help="Bind address (default 127.0.0.1, FORKYARD_HOST)."),
    port: int = typer.Option(None, help="Bind port (default 3000, FORKYARD_PORT)."),
    data_dir: Path = typer.Option(None, help="State directory (default /var/lib/forkyard)."),
    scheduler: str = typer.Option(None, help="Join the cluster of this scheduler (FORKYARD_SCHEDULER_URL); "
                                             "without it the node runs alone, as `forkyard serve`."),
    node_id: str = typer.Option(None, help="This node's name (FORKYARD_NODE_ID, default the host name)."),
    advertise_url: str = typer.Option(None, help="URL gateways reach this node at (FORKYARD_ADVERTISE_URL, "
                                                 "default http://HOST:PORT)."),
    build_base: bool = typer.Option(True, help="Build the default `base` template if missing."),
    log_level: str = typer.Option("info", help="Log level."),
):
    """Run this host's node (REST + sandbox proxy). With a scheduler it registers,
    heartbeats and mirrors its sandboxes to the cluster; alone it is `forkyard serve`."""
    if ctx.invoked_subcommand is not None:
        return
    from forkyard.cluster.agent import default_max_sandboxes

    env = ClusterSettings()
    sched = scheduler or env.scheduler_url
    cluster = None
    if sched:
        try:
            max_sbx = default_max_sandboxes()
        except ValueError:
            fail("FORKYARD_NODE_MAX_SANDBOXES must be a whole number")
        cluster = {"scheduler": sched.rstrip("/"), "secret": _secret(),
                   "node_id": node_id or env.node_id or socket.gethostname(),
                   "advertise_url": advertise_url or env.advertise_url,
                   "max_sandboxes": max_sbx}
        if host in ("0.0.0.0", "::") and not cluster["advertise_url"]:
            fail("listening on all addresses: give --advertise-url (FORKYARD_ADVERTISE_URL), the URL "
                 "gateways reach this node at")
    run_node(host, port, data_dir, build_base, log_level, cluster)


@node_app.command("drain")
def drain(node_id: str = typer.Argument(..., help="Node to drain."), scheduler: str = SCHEDULER_OPT):
    """Stop placing sandboxes on NODE_ID and pause its running sandboxes to the shared
    repository; they resume on other nodes when next connected."""
    _call(scheduler, "POST", f"/v1/nodes/{node_id}/drain")
    print(f"node {node_id} is draining: no new sandboxes; its running ones are being paused")


@node_app.command("undrain")
def undrain(node_id: str = typer.Argument(..., help="Node to put back in service."),
            scheduler: str = SCHEDULER_OPT):
    """Let the scheduler place sandboxes on NODE_ID again."""
    _call(scheduler, "POST", f"/v1/nodes/{node_id}/undrain")
    print(f"node {node_id} is up")


@node_app.command("ls")
def ls(scheduler: str = SCHEDULER_OPT, as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """The cluster's nodes: status, heartbeat age, sandboxes and capacity."""
    nodes = _call(scheduler, "GET", "/v1/nodes")
    if as_json:
        print(json.dumps(nodes, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table("node", "status", "url", "heartbeat", "running", "paused", "max", "load1")
    for n in nodes:
        r = n["report"]
        t.add_row(n["nodeID"], n["status"], n["url"], f"{n['heartbeatAge']:.1f}s ago", str(r["running"]),
                  str(r["paused"]), str(r["max_sandboxes"]), f"{r['load1']:.2f}")
    Console().print(t)


@commands.command()
def scheduler(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(9090, help="Bind port."),
    redis: str = REDIS_OPT,
    log_level: str = typer.Option("info", help="Log level."),
):
    """Run the cluster scheduler: node registry, placement, sandbox → node bindings
    (state in Redis; several replicas may run at once)."""
    import uvicorn

    from forkyard.obs.logs import UVICORN_LOG_CONFIG
    from forkyard.cluster.config import redis_url
    from forkyard.cluster.scheduler import create_scheduler_app
    from forkyard.cluster.store import ClusterStore

    setup_logging(log_level, "scheduler")
    os.umask(0o077)  # anything it writes is private (forkyard.fsperms)
    secret = _secret()
    url = redis or redis_url()
    print(f"forkyard scheduler on http://{host}:{port}, state in {_redacted(url)}", flush=True)
    # No access log: every node heartbeats every second.
    try:
        sched_app = create_scheduler_app(ClusterStore(url), secret)
    except ValueError as e:  # e.g. an unreadable FORKYARD_METRICS_TOKEN_FILE
        fail(str(e))
    uvicorn.run(sched_app, host=host, port=port,
                log_level=log_level.lower(), timeout_keep_alive=75, access_log=False,
                log_config=UVICORN_LOG_CONFIG)


@commands.command()
def gateway(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8080, help="Bind port."),
    scheduler: str = SCHEDULER_OPT,
    redis: str = REDIS_OPT,
    data_dir: Path = typer.Option(None, help="Where the API key file lives when FORKYARD_API_KEY(_FILE) "
                                             "is unset (default /var/lib/forkyard)."),
    log_level: str = typer.Option("info", help="Log level."),
):
    """Run the cluster's public E2B-compatible endpoint (REST + sandbox traffic)."""
    import uvicorn

    from forkyard.api.auth import load_or_create_key
    from forkyard.obs.logs import UVICORN_LOG_CONFIG
    from forkyard.cluster.config import redis_url
    from forkyard.cluster.gateway import Gateway
    from forkyard.cluster.store import ClusterStore
    from forkyard.config import Settings

    setup_logging(log_level, "gateway")
    os.umask(0o077)  # the API key file it may create is private (forkyard.fsperms)
    secret = _secret()
    settings = Settings()
    if data_dir:
        settings.data_dir = data_dir.resolve()
    key = load_or_create_key(settings.api_key_file)
    gw = Gateway(ClusterStore(redis or redis_url()), _scheduler(scheduler), secret, key,
                 max_body_bytes=settings.max_upload_mb << 20)
    url = f"http://{host}:{port}"
    print(f"forkyard gateway {url}, scheduler {_scheduler(scheduler)}", flush=True)
    print(f"  export E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY=<the cluster's API key>", flush=True)
    from forkyard.api.limits import uvicorn_limits
    from forkyard.obs.collect import cluster_families
    from forkyard.obs.middleware import ObsMiddleware

    try:
        app = ObsMiddleware(gw, "gateway", collect=lambda: cluster_families(gw.store), keys=lambda: [key],
                            console=True)
    except ValueError as e:  # e.g. an unreadable FORKYARD_METRICS_TOKEN_FILE
        fail(str(e))
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower(), timeout_keep_alive=75,
                timeout_graceful_shutdown=2, access_log=False, log_config=UVICORN_LOG_CONFIG,
                **uvicorn_limits(zero_copy=True))


def _redacted(url: str) -> str:
    """``url`` without a password (``redis://:secret@host`` → ``redis://:***@host``)."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


def _call(scheduler: str | None, method: str, path: str):
    import httpx

    from forkyard.cluster.config import SECRET_HEADER

    base = _scheduler(scheduler)
    try:
        r = httpx.request(method, base + path, headers={SECRET_HEADER: _secret()}, timeout=10, trust_env=False)
    except httpx.HTTPError as e:
        fail(f"scheduler at {base} is not reachable ({e}); is `forkyard scheduler` running? "
              "(--scheduler / FORKYARD_SCHEDULER_URL)")
    if r.status_code != 200:
        try:
            msg = r.json().get("message", r.text)
        except ValueError:
            msg = r.text
        fail(f"scheduler answered {r.status_code}: {msg}")
    return r.json()
