"""Which sandbox and port a request is addressed to: E2B's two forms, the
``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers (the SDKs' form when the sandbox URL is
the API's) and the ``PORT-ID.DOMAIN`` host. Read by the node's proxy, the gateway, the
cluster agent and the metrics middleware alike; it imports nothing of forkyard above the
settings, so every layer may use it."""

from __future__ import annotations

import re

from forkyard.config import ENVD_PORT

#: ``PORT-ID.`` at the start of the Host. The id part is not bounded here: a longer one
#: is routed and answered like any unknown sandbox.
_HOST_RE = re.compile(r"^(\d{1,5})-([a-z0-9]+)\.")


def route_of(scope) -> tuple[str, int] | None:
    """``(sandbox_id, port)`` a request (an ASGI scope) is addressed to, or None for the
    REST API. Without ``E2b-Sandbox-Port`` the port is envd's (:data:`ENVD_PORT`).

    Raises:
        ValueError: routing header present but the port is not a number in 1 … 65535,
            or the request target is not a path (``*``, ``http://…``).
    """
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    sid = headers.get("e2b-sandbox-id")
    if sid:
        raw = headers.get("e2b-sandbox-port", str(ENVD_PORT))
        if not raw.isdigit() or not 0 < int(raw) < 65536:
            raise ValueError(f"invalid E2b-Sandbox-Port {raw!r}")
        sid, port = sid.strip(), int(raw)
    else:
        m = _HOST_RE.match(headers.get("host", ""))
        if not (m and 0 < int(m.group(1)) < 65536):
            return None
        sid, port = m.group(2), int(m.group(1))
    if not scope.get("path", "").startswith("/"):  # `OPTIONS *`, absolute-form targets
        raise ValueError(f"request target {scope.get('path')!r} cannot be sent to a sandbox: use an origin-form path")
    return sid, port
