"""Prometheus metrics shared by node, gateway and scheduler (``prometheus-client``).

Process-wide instruments live in :data:`REGISTRY`; each component adds its point-in-time
gauges at scrape time through a ``collect`` callable (see
:class:`forkyard.obs.middleware.ObsMiddleware`). Label values are bounded: operation and
phase names are fixed sets, templates are capped at :data:`MAX_TEMPLATES` (the rest count
as ``other``), node ids are the fleet's; sandbox ids, keys and tokens never appear.

Names follow Prometheus conventions (``_seconds``, ``_bytes``, ``_total``); every metric
is prefixed ``forkyard_``.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import time
from contextvars import ContextVar
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily

from forkyard.config import ObsSettings
from forkyard.obs import tracing

#: Process-wide registry: lifecycle histograms, proxy and HTTP counters, process stats.
REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)

#: Lifecycle latency buckets (s): a fork child restores in ~0.2-2 s, a pause commit of a
#: big image in tens of seconds.
LIFECYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Operations timed by :func:`timed` (the ``op`` label).
OPERATIONS = ("create", "pause", "resume", "snapshot", "fork", "fork_export", "fork_children", "kill")
#: Most distinct ``template`` label values exported; the rest are summed as ``other``.
MAX_TEMPLATES = 50

LIFECYCLE = Histogram(
    "forkyard_lifecycle_duration_seconds",
    "Duration of sandbox lifecycle operations on this node (op: create, pause, resume, snapshot, fork, "
    "fork_export, fork_children, kill; outcome: ok or error).",
    ["op", "outcome"], buckets=LIFECYCLE_BUCKETS, registry=REGISTRY)
PHASE = Histogram(
    "forkyard_lifecycle_phase_seconds",
    "Duration of one phase of a lifecycle operation: the phases the Server-Timing header reports "
    "(checkpoint, commit, children, slot-max, runtime-max, envd-max; freeze, export and boot of a "
    "filesystem-only pause, snapshot or resume) and each sandbox start's "
    "slot, runtime and envd (create, resume, every fork child).",
    ["op", "phase"], buckets=LIFECYCLE_BUCKETS, registry=REGISTRY)
HTTP_REQUESTS = Counter(
    "forkyard_http_requests_total",
    "HTTP requests answered (kind: api for the REST API, sandbox for traffic proxied to a sandbox; "
    "code: status class 2xx/3xx/4xx/5xx).",
    ["kind", "code"], registry=REGISTRY)
BEAT_STREAM_MESSAGES = Counter(
    "forkyard_heartbeat_stream_messages_total",
    "Heartbeats a scheduler replica read from nodes' heartbeat streams (WebSocket, "
    "FORKYARD_BEAT_STREAM=on; not counted in forkyard_http_requests_total).",
    registry=REGISTRY)
PROXY_BYTES = Counter(
    "forkyard_proxy_bytes_total",
    "Body bytes of sandbox traffic through this process (direction: in = client to sandbox, out = back).",
    ["direction"], registry=REGISTRY)
PROXY_SPLICED = Counter(
    "forkyard_proxy_spliced_bytes_total",
    "Response body bytes of sandbox traffic moved socket to socket (splice, no copy through the "
    "process: forkyard.relay.fastpath); also counted in forkyard_proxy_bytes_total.",
    registry=REGISTRY)
PROXY_ERRORS = Counter(
    "forkyard_proxy_errors_total",
    "Sandbox traffic that failed here (reason: not_found = unknown sandbox, unreachable = 502, "
    "bad_request, exception).", ["reason"], registry=REGISTRY)
PROXY_OPEN = Gauge(
    "forkyard_proxy_open_streams",
    "Sandbox requests and WebSocket sessions in progress (kind: http, websocket).",
    ["kind"], registry=REGISTRY)
ADMISSION_REFUSALS = Counter(
    "forkyard_admission_refusals_total",
    "Sandbox placements or starts refused for lack of capacity (reason: a fixed word, e.g. no_capacity).",
    ["reason"], registry=REGISTRY)
FS_IMAGE_BYTES = Histogram(
    "forkyard_fs_image_bytes",
    "Size of each filesystem-only image (pause or snapshot with memory: false) as exported, "
    "before the repository's deduplication and compression.",
    buckets=(1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28, 1 << 30, 1 << 32), registry=REGISTRY)
SANDBOX_DEATHS = Counter(
    "forkyard_sandbox_deaths_total",
    "Running sandboxes whose runtime stopped without being asked to (cause: oom = the host's OOM "
    "killer ended it at its memory limit, exited = its runtime stopped otherwise).",
    ["cause"], registry=REGISTRY)
#: Pre-bound children (``labels()`` costs a locked lookup; bytes count once per body chunk).
BYTES_IN, BYTES_OUT = PROXY_BYTES.labels("in"), PROXY_BYTES.labels("out")
OPEN_HTTP, OPEN_WS = PROXY_OPEN.labels("http"), PROXY_OPEN.labels("websocket")

_op: ContextVar[str | None] = ContextVar("forkyard_metrics_op", default=None)
_log = logging.getLogger("forkyard.lifecycle")


def admission_refused(reason: str) -> None:
    """Count one refused placement/start; ``reason`` must be a fixed word (bounded label)."""
    ADMISSION_REFUSALS.labels(reason).inc()


def observe_phase(name: str, seconds: float) -> None:
    """Record phase ``name`` of the operation running in this context (no-op outside one)."""
    op = _op.get()
    if op is not None:
        PHASE.labels(op, name).observe(seconds)
        tracing.phase(op, name, seconds)


def timed(op: str):
    """Decorator for an ``async`` orchestrator method: observes its duration (s) in
    :data:`LIFECYCLE` under ``op`` with ``outcome`` ok/error, lets
    :func:`forkyard.orchestrator.timing.record` phases inside it count under ``op``, and
    logs one line (``forkyard.lifecycle``, INFO) with operation, sandbox id and duration
    — also for operations no request asked for (TTL pause/kill)."""
    assert op in OPERATIONS, op
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        async def inner(*args, **kwargs):
            token = _op.set(op)
            t0 = time.perf_counter()
            outcome, out, err = "error", None, None
            try:
                with tracing.operation(op):
                    out = await fn(*args, **kwargs)
                outcome = "ok"
                return out
            except BaseException as e:
                err = e
                raise
            finally:
                seconds = time.perf_counter() - t0
                LIFECYCLE.labels(op, outcome).observe(seconds)
                _op.reset(token)
                # the sandbox id it was called with; a create's first argument is its
                # template, so there the record it returned names the sandbox
                if op != "create" and len(args) > 1 and isinstance(args[1], str):
                    sid = args[1]
                else:
                    sid = getattr(out, "id", None)
                _log.info("%s %s in %.1f ms%s", op, outcome, seconds * 1000, f": {err}" if err else "",
                          extra={"operation": op, "duration_ms": round(seconds * 1000, 1),
                                 "sandbox_id": sid if op not in ("fork_children",) else None})
        return inner
    return wrap


# ---- scrape-time families ------------------------------------------------------------------

def gauge(name: str, doc: str, value: float | None = None, labels: dict[str, list] | None = None) -> GaugeMetricFamily:
    """A :class:`GaugeMetricFamily` with one unlabelled ``value`` or, with ``labels``
    (``{"label names": [...], "samples": [(values, v), ...]}``), several samples."""
    if labels is None:
        return GaugeMetricFamily(name, doc, value=value)
    fam = GaugeMetricFamily(name, doc, labels=labels["names"])
    for values, v in labels["samples"]:
        fam.add_metric(list(values), v)
    return fam


def counter(name: str, doc: str, value: float):
    """A counter family read from a running total kept elsewhere (``name`` without ``_total``)."""
    from prometheus_client.core import CounterMetricFamily

    return CounterMetricFamily(name, doc, value=value)


def capped(counts: dict[tuple[str, str], int]) -> list[tuple[tuple[str, str], int]]:
    """``{(state, template): n}`` with at most :data:`MAX_TEMPLATES` templates kept by
    total count; the others' counts are summed under template ``other``."""
    totals: dict[str, int] = {}
    for (_, tpl), n in counts.items():
        totals[tpl] = totals.get(tpl, 0) + n
    keep = set(sorted(totals, key=lambda t: -totals[t])[:MAX_TEMPLATES])
    out: dict[tuple[str, str], int] = {}
    for (state, tpl), n in counts.items():
        key = (state, tpl if tpl in keep else "other")
        out[key] = out.get(key, 0) + n
    return sorted(out.items())


def render(families) -> bytes:
    """Prometheus text exposition (format 0.0.4) of :data:`REGISTRY` plus ``families``."""
    from prometheus_client import generate_latest

    class _Static:
        def collect(self):
            return families

    extra = CollectorRegistry(auto_describe=False)
    extra.register(_Static())
    return generate_latest(REGISTRY) + generate_latest(extra)


# ---- who may scrape ---------------------------------------------------------------------------

def metrics_token() -> str | None:
    """The scrape token: ``FORKYARD_METRICS_TOKEN`` or the content of the file named by
    ``FORKYARD_METRICS_TOKEN_FILE`` (Prometheus: ``authorization: {credentials_file: …}``).

    Raises:
        ValueError: the file cannot be read or is empty.
    """
    settings = ObsSettings()
    value = settings.metrics_token.strip()
    if value:
        return value
    path = settings.metrics_token_file.strip()
    if path:
        try:
            value = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"cannot read FORKYARD_METRICS_TOKEN_FILE {path}: {e}") from e
        if not value:
            raise ValueError(f"FORKYARD_METRICS_TOKEN_FILE {path} is empty")
        return value
    return None


#: Headers a reverse proxy or TLS terminator adds (RFC 7239 ``Forwarded``, the
#: de-facto ``X-Forwarded-*``/``X-Real-IP``, RFC 9110 ``Via``): their presence means the
#: loopback peer is a proxy. One that adds none of them (a TCP-level terminator) needs
#: ``FORKYARD_METRICS_TOKEN`` set.
PROXY_HEADERS = ("forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip", "via")


def _loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def scrape_allowed(headers: dict[str, str], client_host: str | None, token: str | None, api_key: str | None) -> bool:
    """May this request read ``/metrics``? (E2B has no such endpoint; our choice.)

    Allowed with ``Authorization: Bearer <token>`` where the token is the metrics token
    or the API key, or with ``X-API-Key: <API key>``. Without any credentials it is
    allowed only from a loopback address, only while no metrics token is set (a
    Prometheus on the same host), and only for a request no proxy relayed: one with a
    forwarding header (:data:`PROXY_HEADERS`) came through a TLS terminator or proxy on
    the same host, from anywhere (issue 25, item 7). Metrics hold no ids, keys or
    tokens either way.
    """
    if any(h in headers for h in PROXY_HEADERS):
        client_host = None  # relayed: the loopback peer is the proxy, not the client
    offered = []
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        offered.append(auth[7:].strip())
    if headers.get("x-api-key"):
        offered.append(headers["x-api-key"].strip())
    for want in (token, api_key):
        if want and any(hmac.compare_digest(o.encode(), want.encode()) for o in offered):
            return True
    return token is None and not offered and _loopback(client_host)
