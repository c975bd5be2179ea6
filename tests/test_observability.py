"""Observability: Prometheus ``/metrics`` scraped by a real Prometheus server, who may
scrape, request ids end to end (gateway → node) in JSON logs, and the Grafana dashboard
querying only metrics a real scrape has.

Prometheus is Debian's ``prometheus`` (deploy/test.sh installs it, no service started);
each test starts its own on a free port with a temporary config and stops it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from conftest import TEST_ROOT, free_port

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy" / "grafana" / "forkyard.json"


class Prometheus:
    """A real ``prometheus`` process scraping ``targets`` (``{job: (host:port, bearer)}``)
    every second, with its data in a temporary directory."""

    def __init__(self, targets: dict[str, tuple[str, str | None]]):
        self.dir = Path(tempfile.mkdtemp(prefix="fy-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        jobs = []
        for job, (target, token) in targets.items():
            auth = ""
            if token:
                tok = self.dir / f"{job}.token"
                tok.write_text(token)
                tok.chmod(0o600)
                auth = f"    authorization:\n      credentials_file: {tok}\n"
            jobs.append(f"  - job_name: {job}\n    scrape_interval: 1s\n{auth}"
                        f"    static_configs:\n      - targets: ['{target}']\n")
        (self.dir / "prometheus.yml").write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n" + "".join(jobs))
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Prometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus is not installed; deploy/test.sh installs it (apt-get install prometheus)")
        self.log = open(self.dir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, (self.dir / "prometheus.log").read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["data"]["result"]

    def wait(self, expr: str, timeout_s: float = 60) -> list[dict]:
        """Poll ``expr`` until it returns at least one series."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            res = self.query(expr)
            if res:
                return res
            time.sleep(0.5)
        targets = httpx.get(f"{self.url}/api/v1/targets", timeout=10).json()
        raise AssertionError(f"no series for {expr!r}; targets: {json.dumps(targets)[:1500]}")


def _value(res: list[dict]) -> float:
    return sum(float(s["value"][1]) for s in res)


def test_prometheus_scrapes_node(server, sandbox):
    """A real Prometheus scrapes a running node (loopback, no token) and answers queries
    for sandboxes by state/template, lifecycle latency with phases, and proxy traffic."""
    assert sandbox.commands.run("echo hi").stdout.strip() == "hi"  # proxied sandbox traffic
    sandbox.create_snapshot()  # a snapshot: checkpoint + commit phases
    host = server.url.removeprefix("http://")
    with Prometheus({"node": (host, None)}) as prom:
        up = prom.wait('up{job="node"} == 1')
        assert up
        running = prom.wait('forkyard_sandboxes{state="running",template="base"} >= 1')
        assert _value(running) >= 1
        created = prom.wait('forkyard_lifecycle_duration_seconds_count{op="create",outcome="ok"}')
        assert _value(created) >= 1
        phases = prom.wait('forkyard_lifecycle_phase_seconds_count{op="snapshot",phase=~"checkpoint|commit"}')
        assert {s["metric"]["phase"] for s in phases} == {"checkpoint", "commit"}
        starts = prom.wait('forkyard_lifecycle_phase_seconds_count{op="create"}')
        # Every start's slot, runtime, envd; the runtime's own (disk, runsc) and a
        # restore's image when the sandbox came from a snapshot (docs/observability.md).
        got = {s["metric"]["phase"] for s in starts}
        assert {"slot", "runtime", "envd"} <= got <= {"slot", "runtime", "envd", "disk", "runsc", "image", "rearm"}, got
        p95 = prom.wait('histogram_quantile(0.95, sum by (le) (rate(forkyard_lifecycle_duration_seconds_bucket'
                        '{op="create"}[5m])))')
        assert p95
        traffic = prom.wait('forkyard_http_requests_total{kind="sandbox",code="2xx"} > 0')
        assert _value(traffic) >= 1
        assert _value(prom.wait('forkyard_proxy_bytes_total{direction="out"} > 0')) > 0
        prom.wait('forkyard_repository_chunks_written_total')
        prom.wait('forkyard_cache_chunk_hits_total')
        # No sandbox id in any label anywhere.
        series = httpx.get(f"{prom.url}/api/v1/series", params={"match[]": '{job="node"}'}, timeout=10).json()["data"]
        assert series and sandbox.sandbox_id not in json.dumps(series)


def test_metrics_access_and_no_secrets(server, sandbox):
    """``/metrics``: a loopback scrape without credentials works while no metrics token is
    set; wrong credentials are refused (401 JSON); the API key as bearer works; the text
    holds no sandbox id, API key or envd token."""
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "forkyard_sandboxes{" in r.text
    bad = httpx.get(f"{server.url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert bad.status_code == 401 and bad.json()["code"] == 401
    ok = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10)
    assert ok.status_code == 200
    for secret in (sandbox.sandbox_id, server.api_key):
        assert secret not in ok.text
    assert httpx.post(f"{server.url}/metrics", timeout=10).status_code == 405


def test_request_id_in_json_logs(server, sandbox):
    """A client's ``X-Request-Id`` is echoed and lands in the node's JSON log lines with
    the sandbox id, operation and duration; a request without one gets a fresh id."""
    rid = f"test-{os.getpid()}-{time.time_ns()}"
    with server.api() as c:
        r = c.post(f"/sandboxes/{sandbox.sandbox_id}/timeout", json={"timeout": 200}, headers={"X-Request-Id": rid})
        assert r.status_code == 204, r.text
        assert r.headers["x-request-id"] == rid
        fresh = c.get("/v2/sandboxes").headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{16}", fresh)
        evil = c.get("/v2/sandboxes", headers={"X-Request-Id": "has space/and;semicolon" + "x" * 80}).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{16}", evil)
    deadline = time.time() + 30
    while time.time() < deadline:
        lines = [json.loads(l) for l in server.log.read_text().splitlines() if l.startswith("{") and rid in l]
        if lines:
            break
        time.sleep(0.2)
    assert lines, "no JSON log line carries the request id"
    line = lines[-1]
    assert line["component"] == "node" and line["level"] == "info"
    assert line["sandbox_id"] == sandbox.sandbox_id and line["operation"] == "set_timeout"
    assert line["status"] == 204 and line["duration_ms"] >= 0 and line["time"].endswith("Z")
    # the lifecycle line of the sandbox's create names it, its operation and duration
    created = [json.loads(l) for l in server.log.read_text().splitlines()
               if l.startswith("{") and sandbox.sandbox_id in l and '"logger": "forkyard.lifecycle"' in l]
    assert any(c["operation"] == "create" and c["sandbox_id"] == sandbox.sandbox_id and c["duration_ms"] > 0
               for c in created), created


@pytest.fixture(scope="module")
def cluster(base_template):
    """Redis + scheduler + gateway + one node (real processes), cleaned up afterwards."""
    from _cluster import Cluster

    c = Cluster(TEST_ROOT / f"cluster-obs-{os.getpid()}", nodes=1)
    token = c.root / "metrics_token"  # the gateway alone gets a metrics token
    token.write_text(secrets.token_hex(16))
    token.chmod(0o600)
    c.metrics_token = token.read_text()
    c.gateway.env = dict(c.gateway.env, FORKYARD_METRICS_TOKEN_FILE=str(token))
    with c.running():
        yield c


def test_cluster_metrics_and_request_id(cluster):
    """Gateway and scheduler serve ``/metrics`` with per-node heartbeat age and Redis
    reachability (scraped by a real Prometheus with the metrics token / cluster secret as
    bearer), and the gateway passes a request id on to the node it forwards to."""
    c = cluster
    gw = c.gateway_url.removeprefix("http://")
    sched = c.scheduler_url.removeprefix("http://")
    # With a metrics token set (gateway) a loopback scrape needs a credential; the token
    # and the API key both work. Without one (scheduler) loopback may scrape as it is.
    assert httpx.get(f"{c.gateway_url}/metrics", timeout=10).status_code == 401
    assert httpx.get(f"{c.scheduler_url}/metrics", timeout=10).status_code == 200
    assert httpx.get(f"{c.gateway_url}/metrics", headers={"X-API-Key": c.api_key}, timeout=10).status_code == 200
    with Prometheus({"gateway": (gw, c.metrics_token), "scheduler": (sched, c.secret)}) as prom:
        age = prom.wait('forkyard_node_heartbeat_age_seconds{job="scheduler",node="node0"}')
        assert 0 <= _value(age) < 10
        prom.wait('forkyard_redis_up{job="gateway"} == 1')
        prom.wait('forkyard_node_status{job="gateway",node="node0",status="up"} == 1')
        prom.wait('forkyard_node_max_sandboxes{job="scheduler",node="node0"} > 0')
    rid = f"gw-{time.time_ns()}"
    with c.api() as api:
        r = api.get("/templates", headers={"X-Request-Id": rid})  # forwarded to a node
    assert r.status_code == 200 and r.headers["x-request-id"] == rid
    # Access lines are written once a reply has gone out: wait for both.
    node_log, gw_log = c.nodes[0].log, c.gateway.log
    deadline = time.time() + 30
    while not (rid in node_log.read_text() and rid in gw_log.read_text()) and time.time() < deadline:
        time.sleep(0.2)
    hits = [json.loads(l) for l in node_log.read_text().splitlines() if l.startswith("{") and rid in l]
    assert hits and hits[-1]["component"] == "node" and hits[-1]["path"] == "/templates", hits
    gw_hits = [json.loads(l) for l in gw_log.read_text().splitlines() if l.startswith("{") and rid in l]
    assert gw_hits and gw_hits[-1]["component"] == "gateway", gw_hits


def test_top_on_gateway(cluster):
    """``forkyard top --once`` against the gateway lists the cluster's nodes."""
    import sys

    env = {**os.environ, "FORKYARD_URL": cluster.gateway_url, "E2B_API_KEY": cluster.api_key}
    p = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "top", "--once"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    row = next(line for line in p.stdout.splitlines() if line.strip().startswith("node0"))
    assert "up" in row and "0/40" in row, p.stdout


def _scrape_names(text: str) -> set[str]:
    """Every metric name a scrape exposes: families (``# TYPE``) with their sample
    suffixes, and sample names."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            names |= {f"{name}_{s}" for s in {"histogram": ("bucket", "count", "sum"),
                                              "counter": ("total",), "summary": ("count", "sum")}.get(kind, ())}
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_grafana_dashboard_queries_existing_metrics(cluster):
    """Every ``forkyard_*`` metric the dashboard in deploy/grafana queries is in a real
    scrape of the cluster's node, gateway or scheduler."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8, "dashboard has too few queries"
    wanted = set()
    for e in exprs:
        wanted |= set(re.findall(r"\b(forkyard_[a-z0-9_]+)", e))
    have: set[str] = set()
    deadline = time.time() + 15  # the repository's stored size appears once its first listing ends
    while True:
        for url, token in ((cluster.node_urls[0], cluster.api_key), (cluster.gateway_url, cluster.api_key),
                           (cluster.scheduler_url, cluster.secret)):
            r = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert r.status_code == 200, r.text
            have |= _scrape_names(r.text)
        missing = sorted(wanted - have)
        if not missing or time.time() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"dashboard queries metrics no scrape has: {missing}"


def test_unknown_tracing_or_log_format_is_refused():
    """A setting that is not understood stops the component with a one-line error."""
    import sys

    for env in ({"FORKYARD_TRACING": "jaeger"}, {"FORKYARD_LOG_FORMAT": "xml"},
                {"FORKYARD_METRICS_TOKEN_FILE": "/nonexistent/token", "FORKYARD_CLUSTER_SECRET": "s" * 32}):
        p = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "scheduler", "--port", str(free_port())],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
        assert next(iter(env)) in p.stderr, p.stderr


def test_log_formats_carry_request_context():
    """JSON and text formatters put the request's id and sandbox id, and a record's
    operation and duration, on every line (the context the middleware sets)."""
    import io
    import logging

    from forkyard.obs import logs

    lines = {}
    for fmt in ("json", "text"):
        buf = io.StringIO()
        handler = logging.StreamHandler(buf)
        handler.setFormatter(logs.JsonFormatter() if fmt == "json" else logs.TextFormatter())
        lg = logging.getLogger(f"forkyard.test.{fmt}")
        lg.addHandler(handler)
        lg.propagate = False
        t1, t2 = logs.request_id.set("rid-1"), logs.sandbox_id.set("sbx1")
        try:
            lg.warning("paused %s", "it", extra={"operation": "pause", "duration_ms": 12.5})
        finally:
            logs.request_id.reset(t1), logs.sandbox_id.reset(t2)
            lg.removeHandler(handler)
        lines[fmt] = buf.getvalue().strip()
    rec = json.loads(lines["json"])
    assert rec["message"] == "paused it" and rec["level"] == "warning" and rec["request_id"] == "rid-1"
    assert rec["sandbox_id"] == "sbx1" and rec["operation"] == "pause" and rec["duration_ms"] == 12.5
    assert "paused it" in lines["text"] and "request_id=rid-1" in lines["text"] and "duration_ms=12.5" in lines["text"]
    assert not lines["text"].startswith("{")
