"""Issue 11 item 10: inputs that gave 5xx or unfaithful bytes — deeply nested JSON on
template-build routes, a ``*`` request target with a sandbox header, gzip the client
never asked for, and proxied bodies cut mid-way."""

from __future__ import annotations

import socket
import time

import httpx
from e2b import Sandbox

from _wire import read_head


def _raw(server, request: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(request)
        return read_head(s, timeout)


def test_nested_json_on_build_routes_is_400(server):
    deep = "[" * 100_000 + "]" * 100_000
    deep_obj = '{"a":' * 50_000 + "1" + "}" * 50_000
    with server.api() as c:
        for path in ("/v3/templates", "/v2/templates/x/builds/y", "/sandboxes", "/sandboxes/x/fork"):
            for body in (deep, deep_obj):
                r = c.post(path, content=body, headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, r.status_code, r.text[:200])
                assert r.json()["code"] == 400


def test_star_target_with_sandbox_header_is_4xx(server, sandbox):
    for extra in (f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\n", f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\n"
                  "E2b-Sandbox-Port: 8000\r\n"):
        head = _raw(server, f"OPTIONS * HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
        assert head.startswith(b"HTTP/1.1 4"), head[:200]
    head = _raw(server, f"OPTIONS * HTTP/1.1\r\nHost: 49983-{sandbox.sandbox_id}.localhost\r\n\r\n".encode())
    assert head.startswith(b"HTTP/1.1 4"), head[:200]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_no_gzip_unless_the_client_asks(server, sandbox):
    with server.api() as c:
        token = c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["envdAccessToken"]
    sandbox.files.write("/home/user/t.txt", "abc " * 5000)
    req = (f"GET /files?path=/home/user/t.txt HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sandbox.sandbox_id}\r\n"
           f"X-Access-Token: {token}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(req)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-encoding" not in head.lower()
    assert body == b"abc " * 5000
    # Asked for gzip: gets it (the client's header goes through).
    r = httpx.get(f"{server.url}/files", params={"path": "/home/user/t.txt"},
                  headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": token, "Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.content == b"abc " * 5000


def test_body_cut_midway_closes_cleanly(server):
    sbx = Sandbox.create("base", timeout=120)
    with server.api() as c:
        token = c.get(f"/sandboxes/{sbx.sandbox_id}").json()["envdAccessToken"]
    size = 96 << 20
    sbx.commands.run(f"head -c {size} /dev/zero > /home/user/big.bin")
    log_mark = server.log.stat().st_size
    got = 0
    error = None
    with httpx.Client(timeout=30) as c:
        with c.stream("GET", f"{server.url}/files", params={"path": "/home/user/big.bin"},
                      headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": token,
                               "Accept-Encoding": "identity"}) as r:
            assert r.status_code == 200 and int(r.headers["content-length"]) == size
            try:
                for chunk in r.iter_raw(1 << 16):
                    got += len(chunk)
                    if got >= (1 << 20) and error is None and got < size:
                        sbx.kill()
                        error = "killed"
                        time.sleep(0.5)
            except httpx.HTTPError as e:
                error = e
    assert got < size, "the download finished before the kill; make the file larger"
    assert isinstance(error, httpx.HTTPError), f"a cut body must surface as an error, got {error!r}"
    time.sleep(0.5)
    tail = server.log.read_bytes()[log_mark:].decode(errors="replace")
    assert "shorter than Content-Length" not in tail and "Exception in ASGI application" not in tail, tail[-2000:]
    assert httpx.get(f"{server.url}/health").status_code == 200
