"""Cluster commands: ``forkyard node`` (run / drain / undrain / ls / which), ``forkyard scheduler``,
``forkyard gateway``. Settings: :mod:`forkyard.cluster.config`."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import typer

from forkyard.cli._common import fail, fitted_table, print_table
from forkyard.cli.serve import run_node, setup_logging
from forkyard.config import ClusterSettings

#: The scheduler and gateway commands; :mod:`forkyard.cli.main` adds them to the app.
commands = typer.Typer()
#: ``forkyard node`` (run, drain, undrain, ls, which), added by :mod:`forkyard.cli.main`.
node_app = typer.Typer(help="Run a node, or manage the cluster's nodes.", no_args_is_help=False,
                       invoke_without_command=True)
#: ``forkyard cluster`` (node-key), added by :mod:`forkyard.cli.main`.
cluster_app = typer.Typer(help="Control-plane credentials of a cluster.", no_args_is_help=True)

SCHEDULER_OPT = typer.Option(None, "--scheduler", help="Scheduler URL (FORKYARD_SCHEDULER_URL, "
                                                       "default http://127.0.0.1:9090; replicas comma-separated).")
REDIS_OPT = typer.Option(None, "--redis", help="Redis URL (FORKYARD_REDIS_URL, default redis://127.0.0.1:6379/0).")


def _secret() -> str:
    from forkyard.cluster.config import ClusterConfigError, load_secret

    try:
        return load_secret()
    except ClusterConfigError as e:
        fail(str(e))


def _node_key() -> str:
    from forkyard.cluster.config import ClusterConfigError, cluster_secret_given, load_node_key

    try:
        key = load_node_key()
    except ClusterConfigError as e:
        fail(str(e))
    if cluster_secret_given():
        print("warning: this node is given the cluster secret (FORKYARD_CLUSTER_SECRET(_FILE)); a node needs only "
              "its own key (FORKYARD_NODE_KEY_FILE): remove it from the node's settings", flush=True)
    return key


def _redis(url: str | None) -> str:
    """The Redis URL: ``--redis`` or the setting (with FORKYARD_REDIS_PASSWORD_FILE's password)."""
    from forkyard.cluster.config import ClusterConfigError, redis_url

    try:
        return redis_url(url=url)
    except ClusterConfigError as e:
        fail(str(e))


def _scheduler(url: str | None) -> str:
    """The scheduler URL(s), comma-separated (``--scheduler`` or the setting)."""
    from forkyard.cluster.config import ClusterConfigError, scheduler_url, scheduler_urls

    try:
        return ",".join(scheduler_urls(url)) if url else scheduler_url()
    except ClusterConfigError as e:
        fail(str(e))


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
        _need_shared_repo(env)
        sched = _scheduler(sched)
        try:
            max_sbx = default_max_sandboxes()
        except ValueError:
            fail("FORKYARD_NODE_MAX_SANDBOXES must be a whole number")
        cluster = {"scheduler": sched, "secret": _node_key(),
                   "node_id": node_id or env.node_id or socket.gethostname(),
                   "advertise_url": advertise_url or env.advertise_url,
                   "max_sandboxes": max_sbx}
        if host in ("0.0.0.0", "::") and not cluster["advertise_url"]:
            fail("listening on all addresses: give --advertise-url (FORKYARD_ADVERTISE_URL), the URL "
                 "gateways reach this node at")
    run_node(host, port, data_dir, build_base, log_level, cluster)


@node_app.command("drain")
def drain(node_id: str = typer.Argument(..., help="Node to drain."), scheduler: str = SCHEDULER_OPT,
          wait: bool = typer.Option(False, "--wait", help="Wait until the node has paused its sandboxes; "
                                                          "exit 1 if some still run there (their pause failed)."),
          timeout: float = typer.Option(600, help="With --wait: give up after this many seconds (exit 2).")):
    """Stop placing sandboxes on NODE_ID and pause its running sandboxes to the shared
    repository; they resume on other nodes when next connected."""
    _call(scheduler, "POST", f"/v1/nodes/{node_id}/drain")
    print(f"node {node_id} is draining: no new sandboxes; its running ones are being paused", flush=True)
    if wait:
        raise typer.Exit(_wait_drained(scheduler, node_id, timeout))


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

    rows = []
    for n in nodes:
        r = n["report"]
        status = n["status"] + (" (silent)" if n.get("silent") and n["status"] != "down" else "")
        rows.append([n["nodeID"], status, n["url"], f"{n['heartbeatAge']:.1f}s ago", str(r["running"]),
                     str(r["paused"]), str(r["max_sandboxes"]), f"{r['load1']:.2f}"])
    # as the other list commands: a table on a terminal (the node column shrinks first,
    # never the URL), one node id a line when piped
    t = fitted_table(["node", "status", "url", "heartbeat", "running", "paused", "max", "load1"], rows,
                     flexible=("node", "status"))
    print_table(t, [n["nodeID"] for n in nodes])


@node_app.command("which")
def which(sandbox_ids: list[str] = typer.Argument(..., help="Sandbox ids."), scheduler: str = SCHEDULER_OPT,
          as_json: bool = typer.Option(False, "--json", help="Print JSON.")):
    """Which node holds each sandbox (and its state there), from the cluster's bindings."""
    rows = []
    for sid in sandbox_ids:
        b = _call(scheduler, "GET", f"/v1/sandboxes/{sid}", missing_ok=True)
        rows.append({"sandboxID": sid, "nodeID": b["nodeID"] if b else None, "state": b["state"] if b else None})
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    for r in rows:
        print(f"{r['sandboxID']}  {r['nodeID'] or '-'}  {r['state'] or 'not bound to any node'}")
    if any(r["nodeID"] is None for r in rows):
        raise typer.Exit(1)


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
    from forkyard.cluster.config import redacted_url
    from forkyard.cluster.scheduler import MAX_BODY, create_scheduler_app
    from forkyard.cluster.store import ClusterStore

    setup_logging(log_level, "scheduler")
    os.umask(0o077)  # anything it writes is private (forkyard.fsperms)
    secret = _secret()
    url = _redis(redis)
    print(f"forkyard scheduler on http://{host}:{port}, state in {redacted_url(url)}", flush=True)
    # No access log: every node heartbeats every second.
    try:
        sched_app = create_scheduler_app(ClusterStore(url), secret)
    except ValueError as e:  # e.g. an unreadable FORKYARD_METRICS_TOKEN_FILE
        fail(str(e))
    # ws: uvicorn's sans-I/O websockets protocol for the nodes' heartbeat streams (about a
    # third less CPU a message than its legacy one here; cluster/beatstream.py), a message
    # bounded like a body, no compression (nodes send none)
    uvicorn.run(sched_app, host=host, port=port, ws="websockets-sansio", ws_max_size=MAX_BODY,
                ws_per_message_deflate=False,
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
    # Sandbox answers carry the gateway's domain, so the SDKs' get_host() comes here.
    domain = settings.domain or f"localhost:{port}"
    gw = Gateway(ClusterStore(_redis(redis)), _scheduler(scheduler), secret, key,
                 max_body_bytes=settings.max_upload_mb << 20, domain=domain)
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


def _need_shared_repo(env: ClusterSettings) -> None:
    """A cluster node needs the shared repository (FORKYARD_REPO): with a node-local one a
    paused sandbox resumes only on its own node, which E2B users do not expect. Refused
    unless FORKYARD_ALLOW_LOCAL_REPO=1."""
    if env.repo:
        return
    if env.allow_local_repo:
        print("warning: FORKYARD_REPO is unset: this node keeps snapshots in its own data dir, so its paused "
              "sandboxes resume only here and a drain or its death strands them", flush=True)
        return
    fail("a cluster node needs the snapshot repository all nodes share: set FORKYARD_REPO (s3://BUCKET/PREFIX "
         "with FORKYARD_S3_ENDPOINT, or a directory mounted at the same path on every node). "
         "FORKYARD_ALLOW_LOCAL_REPO=1 runs with a node-local one (paused sandboxes then resume only on this node).")


def _wait_drained(scheduler: str | None, node_id: str, timeout_s: float) -> int:
    """Poll the node list until ``node_id`` reports its drain done; print the outcome.
    Returns the exit code: 0 drained, 1 some still run there, 2 timed out."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        node = next((n for n in _call(scheduler, "GET", "/v1/nodes") if n["nodeID"] == node_id), None)
        r = node["report"] if node else {}
        if node is not None and node["status"] == "draining" and r.get("drain_done"):
            if r.get("running", 0) == 0:
                print(f"node {node_id} is drained: {r.get('paused', 0)} paused sandbox(es), none running", flush=True)
                return 0
            print(f"node {node_id} finished draining but {r['running']} sandbox(es) still run there (their pause "
                  "failed: see the node's log)", flush=True)
            return 1
        if time.monotonic() > deadline:
            print(f"node {node_id} has not finished draining after {timeout_s:.0f} s "
                  f"({r.get('running', '?')} still running)", flush=True)
            return 2
        time.sleep(0.5)


def _call(scheduler: str | None, method: str, path: str, missing_ok: bool = False):
    import httpx

    from forkyard.cluster.config import SECRET_HEADER

    bases = _scheduler(scheduler).split(",")
    for i, base in enumerate(bases):
        try:
            r = httpx.request(method, base + path, headers={SECRET_HEADER: _secret()}, timeout=10, trust_env=False)
            break
        except httpx.HTTPError as e:
            if i == len(bases) - 1:
                fail(f"scheduler at {_scheduler(scheduler)} is not reachable ({e}); is `forkyard scheduler` "
                     "running? (--scheduler / FORKYARD_SCHEDULER_URL)")
    if r.status_code == 404 and missing_ok:
        return None
    if r.status_code != 200:
        try:
            msg = r.json().get("message", r.text)
        except ValueError:
            msg = r.text
        fail(f"scheduler answered {r.status_code}: {msg}")
    return r.json()


@cluster_app.command("node-key")
def node_key(node_id: str = typer.Argument(..., help="The node's FORKYARD_NODE_ID."),
             url: str = typer.Option(..., "--url", help="The node's FORKYARD_ADVERTISE_URL (where gateways reach it)."),
             out: Path = typer.Option(..., "--out", help="File to write the key to (mode 0600, replaced "
                                                         "atomically); `-` writes it to stdout, e.g. into ssh.")):
    """Mint NODE_ID's own key, bound to URL, from the cluster secret (run it where the
    secret is: a scheduler or gateway host). The node gets only this key
    (FORKYARD_NODE_KEY_FILE): it cannot act as another node or at another URL."""
    from forkyard.cluster.nodekeys import node_key as derive
    from forkyard.cluster.nodekeys import normal_url
    if not node_id or len(node_id) > 253 or any(c in node_id for c in "/?#%") or not node_id.isprintable() \
            or node_id != node_id.strip():
        fail(f"node id {node_id!r}: at most 253 printable characters without '/', '?', '#', '%' or spaces")
    if not url.startswith(("http://", "https://")):
        fail(f"--url {url!r} must start with http:// or https://")
    key = derive(_secret(), node_id, normal_url(url))
    if str(out) == "-":
        print(key)
        return
    tmp = out.with_name(f".{out.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    print(f"wrote node {node_id}'s key for {normal_url(url)} to {out} (0600); on that node set "
          f"FORKYARD_NODE_ID={node_id} FORKYARD_ADVERTISE_URL={normal_url(url)} FORKYARD_NODE_KEY_FILE=PATH", flush=True)
