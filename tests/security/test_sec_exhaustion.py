"""Issue 11 item 5: exhaustion without a key. Keyless bodies are refused from the
headers (the server's memory does not grow), bodies are capped per route, and
unfinished request heads, stalled bodies and connection floods are bounded."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx

from _wire import read_head


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _connect(server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return s


def _status_of(s: socket.socket, timeout: float) -> bytes:
    return read_head(s, timeout)


def test_keyless_huge_body_is_refused_from_headers(server):
    pid = server.proc.pid
    before = _rss_mb(pid)
    for path in ("/sandboxes", "/v3/templates", "/templates/import?name=x", "/v2/templates/t/builds/b"):
        s = _connect(server)
        t0 = time.time()
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {400 << 20}\r\n\r\n".encode())
        sent = 0
        chunk = b"[" * (1 << 20)
        try:
            while sent < (400 << 20):  # the server answers and closes long before the end
                s.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        head = _status_of(s, 10)
        s.close()
        assert head.startswith(b"HTTP/1.1 401"), (path, head[:200])
        assert sent < (400 << 20), f"{path}: the server read the whole keyless body"
        assert time.time() - t0 < 30
    # Chunked (no Content-Length), no key: refused too.
    r = httpx.post(f"{server.url}/sandboxes", content=iter([b"{" * 65536] * 64))
    assert r.status_code == 401 and r.json()["code"] == 401
    assert _rss_mb(pid) - before < 60, (before, _rss_mb(pid))


def test_body_caps_per_route(server):
    with server.api() as c:
        r = c.post("/sandboxes", content=b"{" + b" " * (2 << 20) + b"}", headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["message"]
        # Without Content-Length (chunked), the cap holds while reading.
        r = c.post("/sandboxes/x/timeout", content=iter([b" " * 65536] * 40),
                   headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["code"] == 413
        # A small body still works.
        assert c.post("/sandboxes/nope/timeout", json={"timeout": 5}).status_code == 404


def test_slow_heads_stalled_bodies_and_floods_are_closed(server):
    # 50 slow-loris connections: a partial head, then nothing.
    loris = []
    for _ in range(50):
        s = _connect(server)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        loris.append(s)
    idle = [_connect(server) for _ in range(20)]  # nothing sent at all
    # A keyed request whose body stops arriving.
    stalled = _connect(server)
    stalled.sendall(f"POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-Key: {server.api_key}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"templ".encode())
    # A head larger than the bound.
    big = _connect(server)
    try:
        big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"a" * (100 << 10) + b"\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert _status_of(big, 10).startswith(b"HTTP/1.1 431")
    big.close()
    # The server keeps answering meanwhile.
    assert httpx.get(f"{server.url}/health").status_code == 200
    deadline = time.time() + 60
    for s in loris + idle:
        s.settimeout(max(1.0, deadline - time.time()))
        try:
            assert s.recv(1024) == b"", "a connection without a complete head got an answer"
        except ConnectionResetError:
            pass
        s.close()
    head = _status_of(stalled, max(1.0, deadline - time.time()))
    stalled.close()
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert time.time() < deadline


def test_one_client_cannot_hold_every_connection(server):
    socks, refused = [], 0
    try:
        for _ in range(1100):
            s = _connect(server)
            socks.append(s)
        for s in socks[1024:]:
            head = _status_of(s, 5)
            refused += head.startswith(b"HTTP/1.1 503")
        assert refused >= 1100 - 1024 - 5, refused  # a few may race a slot freed meanwhile
    finally:
        for s in socks:
            s.close()
    time.sleep(0.5)
    assert httpx.get(f"{server.url}/health").status_code == 200
