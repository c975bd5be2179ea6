"""Raw-socket helpers for the security tests: requests no HTTP client would send."""

from __future__ import annotations

import socket


def read_head(s: socket.socket, timeout: float) -> bytes:
    """Bytes received on ``s`` until the end of a response head (``\\r\\n\\r\\n``), the
    peer closing, or ``timeout`` s of silence (whatever came so far)."""
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    return data
