"""Structured logs: one JSON object per line, or a readable line on a terminal.

Every record carries ``time`` (RFC 3339, UTC), ``level``, ``component`` (node, gateway,
scheduler, cli), ``logger``, ``message`` and, when known, ``request_id`` (from the
``X-Request-Id`` header or generated; the gateway passes it on to nodes), ``sandbox_id``,
``operation`` and ``duration_ms`` (set per request by the middleware, or per call with
``log.info(..., extra={"operation": "pause", "duration_ms": 12.5})``).

``FORKYARD_LOG_FORMAT``: ``json``, ``text`` or ``auto`` (default: text when stderr is a
TTY, JSON otherwise).
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import sys
import time
from contextvars import ContextVar

from forkyard.config import ObsSettings

#: Request id of the request being served (ASGI middleware sets it per request).
request_id: ContextVar[str | None] = ContextVar("forkyard_request_id", default=None)
#: Sandbox the current request addresses, when its path or routing headers name one.
sandbox_id: ContextVar[str | None] = ContextVar("forkyard_sandbox_id", default=None)
#: Header carrying the request id, E2E: client → gateway → node (and echoed in replies).
REQUEST_ID_HEADER = "x-request-id"
_RID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
_FIELDS = ("request_id", "sandbox_id", "operation", "duration_ms", "status", "method", "path")
_component = "forkyard"


def new_request_id(offered: str | None = None) -> str:
    """``offered`` when it is a sane id (1-64 of ``[A-Za-z0-9._:-]``), else a new 16-hex id."""
    if offered and _RID.match(offered):
        return offered
    return secrets.token_hex(8)


def outgoing() -> dict[str, str]:
    """Headers passing the current request id (and, with tracing on, the W3C
    ``traceparent``) on to another component (``{}`` outside a request)."""
    from forkyard.obs import tracing

    rid = request_id.get()
    return {**({REQUEST_ID_HEADER: rid} if rid else {}), **tracing.outgoing()}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (keys: see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "component": _component,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid, sid = request_id.get(), sandbox_id.get()
        if rid:
            out["request_id"] = rid
        if sid:
            out["sandbox_id"] = sid
        for key in _FIELDS:
            val = getattr(record, key, None)
            if val is not None:
                out[key] = val
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``HH:MM:SS level logger: message  [key=value …]`` for people at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        extras = {k: getattr(record, k, None) for k in _FIELDS}
        extras["request_id"] = extras["request_id"] or request_id.get()
        extras["sandbox_id"] = extras["sandbox_id"] or sandbox_id.get()
        tail = " ".join(f"{k}={v}" for k, v in extras.items() if v is not None)
        line = f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {record.levelname:<7} {record.name}: " \
               f"{record.getMessage()}" + (f"  [{tail}]" if tail else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


#: Credentials a library may log at debug level (websockets logs every header of an
#: upgrade): node keys, and the value of a credential header (``name: value``,
#: ``'name': 'value'``, ``name=value``). Message text only: a traceback is not searched.
_CREDENTIAL = re.compile(r"fynk_[0-9a-f]{64}|((?:x-forkyard-cluster-secret|x-api-key|authorization|"
                         r"x-access-token)['\"]?\s*[:=]\s*)[^\r\n,}]+", re.IGNORECASE)


class _Redact(logging.Filter):
    """Replaces credentials (:data:`_CREDENTIAL`) in a record's message with ``***``."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 — a malformed call: the handler reports it as before
            return True
        if _CREDENTIAL.search(msg):
            record.msg, record.args = _CREDENTIAL.sub(lambda m: (m.group(1) or "") + "***", msg), None
        return True


def setup(component: str, level: str = "info", fmt: str | None = None) -> None:
    """Configure the root logger for ``component``: JSON lines or text (see the module
    docstring for ``fmt``/``FORKYARD_LOG_FORMAT``). uvicorn's own loggers go through it too.

    Raises:
        ValueError: unknown ``fmt``.
    """
    global _component
    _component = component
    fmt = (fmt or ObsSettings().log_format).lower()
    if fmt == "auto":
        fmt = "text" if sys.stderr.isatty() else "json"
    if fmt not in ("json", "text"):
        raise ValueError(f"FORKYARD_LOG_FORMAT must be json, text or auto, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(_Redact())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = []
        lg.propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("websockets").setLevel(logging.WARNING)  # (every upgrade's headers at debug)


#: uvicorn ``log_config`` that leaves logging as :func:`setup` made it.
UVICORN_LOG_CONFIG = {"version": 1, "disable_existing_loggers": False}
