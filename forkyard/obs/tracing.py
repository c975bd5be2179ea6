"""Optional OpenTelemetry tracing (``opentelemetry-sdk``), **off by default**.

``FORKYARD_TRACING=otlp`` turns it on: spans go to an OTLP/HTTP collector at the
standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
(default ``http://localhost:4318``), batched. Spans:

* one server span per REST request (``POST create``, ``POST pause``, …; attributes:
  method, path, status, ``forkyard.request_id``, ``forkyard.sandbox_id``), continuing
  an incoming W3C ``traceparent`` — the gateway sends its own on to the node, so one
  trace covers gateway → node;
* one span per lifecycle operation (``forkyard.create``, ``forkyard.fork``, …) and one
  per measured phase under it (``checkpoint``, ``commit``, ``children``, …: the
  ``Server-Timing`` phases).

Without the setting nothing is imported and every call here is a no-op.

Raises at :func:`setup`: ``RuntimeError`` when tracing is asked for but the packages are
missing (``pip install 'forkyard[otel]'``), or for an unknown ``FORKYARD_TRACING`` value.
"""

from __future__ import annotations

import contextlib
import time

from forkyard.config import ObsSettings

_tracer = None
_propagator = None


def enabled() -> bool:
    """Tracing was set up in this process."""
    return _tracer is not None


def setup(component: str) -> None:
    """Read ``FORKYARD_TRACING`` (``off`` or ``otlp``) and, for ``otlp``, install a tracer
    provider with service name ``forkyard-<component>`` and a batching OTLP/HTTP exporter."""
    global _tracer, _propagator
    mode = ObsSettings().tracing.strip().lower()
    if mode in ("", "off", "0", "false"):
        return
    if mode != "otlp":
        raise RuntimeError(f"FORKYARD_TRACING must be off or otlp, not {mode!r}")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as e:
        raise RuntimeError(f"FORKYARD_TRACING=otlp needs opentelemetry-sdk and opentelemetry-exporter-otlp-proto-http "
                           f"(pip install 'forkyard[otel]'): {e}") from e
    provider = TracerProvider(resource=Resource.create({"service.name": f"forkyard-{component}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), schedule_delay_millis=500))
    _tracer = provider.get_tracer("forkyard")
    _propagator = TraceContextTextMapPropagator()
    import atexit

    atexit.register(provider.shutdown)


@contextlib.contextmanager
def request_span(name: str, headers: dict[str, str], attrs: dict):
    """A server span for one request, child of the ``traceparent`` in ``headers``;
    yields a ``set(key, value)`` for attributes known at the end (no-op when off)."""
    if _tracer is None:
        yield lambda k, v: None
        return
    from opentelemetry.trace import SpanKind

    ctx = _propagator.extract(headers)
    with _tracer.start_as_current_span(name, context=ctx, kind=SpanKind.SERVER,
                                       attributes={k: v for k, v in attrs.items() if v is not None}) as span:
        yield lambda k, v: span.set_attribute(k, v) if v is not None else None


def outgoing() -> dict[str, str]:
    """``{"traceparent": …}`` for the current span (``{}`` when off or outside a span)."""
    if _tracer is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier


@contextlib.contextmanager
def operation(op: str):
    """A span ``forkyard.<op>`` around a lifecycle operation (no-op when off)."""
    if _tracer is None:
        yield
        return
    with _tracer.start_as_current_span(f"forkyard.{op}"):
        yield


def phase(op: str, name: str, seconds: float) -> None:
    """A finished span ``<op>.<name>`` that lasted ``seconds`` and ended now, under the
    current span (no-op when off)."""
    if _tracer is None:
        return
    end = time.time_ns()
    span = _tracer.start_span(f"{op}.{name}", start_time=end - int(seconds * 1e9))
    span.end(end_time=end)
