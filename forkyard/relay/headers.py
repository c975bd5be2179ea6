"""Headers a relay does not pass on, and the request target it forwards."""

from __future__ import annotations

#: Hop-by-hop headers (RFC 9110 §7.6.1) plus routing headers the relays consume.
HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "transfer-encoding", "upgrade", "host", "content-length",
    "x-forkyard-cluster-secret",  # never into a sandbox (forkyard.api.auth)
})
#: Also dropped from upstream responses: the server adds its own.
HOP_OUT = HOP | {"date", "server"}
HOP_OUT_BYTES = frozenset(name.encode() for name in HOP_OUT)
#: Not passed on to a WebSocket upstream: the WebSocket client makes its own handshake.
WS_SKIP = HOP | {"sec-websocket-key", "sec-websocket-version", "sec-websocket-extensions",
                 "sec-websocket-accept", "sec-websocket-protocol"}


#: ASGI scope extension that :class:`forkyard.relay.zerocopy.ZeroCopyHttpToolsProtocol`
#: sets: the request's header names as the client wrote them (bytes, in the order of
#: ``scope["headers"]``, which ASGI lowercases).
RAW_HEADER_NAMES = "forkyard.raw_header_names"


def client_headers(scope) -> list[tuple[bytes, bytes]]:
    """The request's headers with their names in the case the client sent them
    (``Host:``, ``X-Custom-Header:``), as E2B's proxy passes them on and servers that
    read raw header lines see them; lowercase when the server did not record them.
    Compare names with ``.lower()``."""
    headers = scope["headers"]
    raw = scope.get("extensions", {}).get(RAW_HEADER_NAMES)
    if not raw or len(raw) != len(headers):
        return list(headers)
    return [(name, value) for name, (_, value) in zip(raw, headers)]


def target_path(scope) -> str:
    """The request's raw path and query string, as received (an ASGI scope's
    ``raw_path``, else its ``path``)."""
    url = scope.get("raw_path", scope["path"].encode()).decode("latin-1").split("?")[0]
    qs = scope.get("query_string", b"")
    return url + ("?" + qs.decode("latin-1") if qs else "")
