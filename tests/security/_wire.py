"""Raw-socket helpers for the security tests: requests no HTTP client would send."""

from __future__ import annotations

import socket
import urllib.parse


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


def request(url: str, method: str, target: str, headers: dict[str, str] | None = None,
            body: bytes = b"") -> tuple[int, bytes]:
    """Send one request to ``url``'s host with ``target`` written verbatim (no client
    library cleans it first); returns (status, response head + body; 0 when no
    status line came)."""
    u = urllib.parse.urlsplit(url)
    headers = dict(headers or {})
    if not any(k.lower() == "host" for k in headers):
        headers["Host"] = u.netloc
    lines = [f"{method} {target} HTTP/1.1", "Connection: close"] + [f"{k}: {v}" for k, v in headers.items()]
    if body or method in ("POST", "PUT"):
        lines.append(f"Content-Length: {len(body)}")
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        data = read_head(s, 30)
        s.settimeout(5)
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (socket.timeout, ConnectionResetError):
            pass
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0
    return status, data
