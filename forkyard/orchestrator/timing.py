"""Per-request phase durations for the ``Server-Timing`` response header (W3C Server
Timing: ``name;dur=<ms>``), so clients and ``bench/`` can see, for example, how long a
snapshot stopped its source sandbox without instrumenting the server."""

from __future__ import annotations

from contextvars import ContextVar

from forkyard.obs import metrics

_current: ContextVar[list[tuple[str, float]] | None] = ContextVar("forkyard_timings", default=None)


def start() -> list[tuple[str, float]]:
    """Begin collecting for the current request; returns the list phases are appended to."""
    phases: list[tuple[str, float]] = []
    _current.set(phases)
    return phases


def record(name: str, ms: float) -> None:
    """Add phase ``name`` lasting ``ms`` milliseconds (no-op outside a collecting request);
    also observed in ``forkyard_lifecycle_phase_seconds`` under the running operation."""
    metrics.observe_phase(name, ms / 1000)
    phases = _current.get()
    if phases is not None:
        phases.append((name, ms))


def header(phases: list[tuple[str, float]]) -> dict[str, str]:
    """``{"Server-Timing": "checkpoint;dur=54.1, …"}`` or ``{}`` when nothing was recorded."""
    if not phases:
        return {}
    return {"Server-Timing": ", ".join(f"{n};dur={ms:.1f}" for n, ms in phases)}


def add(name: str, ms: float) -> None:
    """Add phase ``name`` to the current request's header only (for phases already
    observed in Prometheus elsewhere); no-op outside a collecting request."""
    phases = _current.get()
    if phases is not None:
        phases.append((name, ms))
