"""The proxy's fast path (forkyard.relay.fastpath) and uvicorn's zero-copy send
(forkyard.relay.zerocopy), in process: a real uvicorn server with forkyard's protocol in
front of :class:`SandboxProxy`, relaying to a real HTTP/1.1 server on loopback whose
answers cover every framing (Content-Length, chunked, close-delimited, HEAD, 204,
HTTP/1.0, a body cut short). The same relay to real sandboxes is tested in
tests/test_fidelity.py (``test_proxy_large_get_never_truncated``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading

import httpx
import pytest
import uvicorn

from forkyard.api.limits import uvicorn_limits
from forkyard.api.proxy import SandboxProxy
from forkyard.relay import zerocopy

BIG = os.urandom(1 << 20)
SLOW_PIECES = 4096  # × 64 KiB: a response the client gives up on long before its end
HDRS = {"E2b-Sandbox-Id": "sbx", "E2b-Sandbox-Port": "8000"}


class Upstream:
    """A keep-alive HTTP/1.1 server with one answer per path; counts connections and
    records how each ended."""

    def __init__(self):
        self.connections = 0
        self.ended: list[str] = []
        self.hosts: list[str] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.ended.append("client closed")
                    return
                method, path, _ = head.split(b"\r\n")[0].decode().split(" ")
                self.hosts += [line.split(":", 1)[1].strip() for line in head.decode().split("\r\n")
                               if line.lower().startswith("host:")]
                if not await self._answer(method, path, writer):
                    return
        except (ConnectionError, OSError):
            self.ended.append("reset")
        finally:
            writer.close()

    async def _answer(self, method: str, path: str, writer: asyncio.StreamWriter) -> bool:
        """Write the answer; False when the connection must close after it."""
        def head(status: str, *lines: str) -> bytes:
            return ("HTTP/1.1 " + status + "\r\n" + "".join(x + "\r\n" for x in lines) + "\r\n").encode()

        if path == "/big":
            writer.write(head("200 OK", f"content-length: {len(BIG)}", "x-kind: big"))
            if method != "HEAD":
                writer.write(BIG)
        elif path == "/small":
            writer.write(head("200 OK", "content-length: 5") + b"small")
        elif path == "/chunked":
            writer.write(head("200 OK", "transfer-encoding: chunked"))
            for piece in (BIG[:100_000], BIG[100_000:300_000]):
                writer.write(b"%x\r\n" % len(piece) + piece + b"\r\n")
            writer.write(b"0\r\n\r\n")
        elif path == "/204":
            writer.write(head("204 No Content"))
        elif path == "/304":  # a 304 may carry the Content-Length its 200 would have (RFC 9110 §8.6)
            writer.write(head("304 Not Modified", f"content-length: {len(BIG)}"))
        elif path == "/close":  # no length: the body ends with the connection
            writer.write(head("200 OK", "connection: close") + BIG)
            await writer.drain()
            return False
        elif path == "/http10":
            writer.write(b"HTTP/1.0 200 OK\r\ncontent-length: %d\r\n\r\n" % len(BIG) + BIG)
            await writer.drain()
            return False
        elif path == "/extra":  # more bytes than announced, shaped as a next answer
            writer.write(head("200 OK", f"content-length: {len(BIG)}") + BIG +
                         head("200 OK", "content-length: 4") + b"evil")
        elif path == "/cut":  # announces 1 MiB, sends 200 KiB
            writer.write(head("200 OK", f"content-length: {len(BIG)}") + BIG[:200_000])
            await writer.drain()
            return False
        elif path == "/slow":  # 256 MiB, 64 KiB at a time
            writer.write(head("200 OK", f"content-length: {SLOW_PIECES << 16}"))
            for _ in range(SLOW_PIECES):
                writer.write(BIG[:1 << 16])
                await writer.drain()
                await asyncio.sleep(0.005)
        else:
            writer.write(head("404 Not Found", "content-length: 0"))
        await writer.drain()
        return True


class Seen:
    """ASGI middleware recording the message types the proxy sends."""

    def __init__(self, app):
        self.app, self.types = app, []

    async def __call__(self, scope, receive, send):
        async def record(msg):
            self.types.append(msg["type"])
            await send(msg)

        await self.app(scope, receive, record)


def _server(upstream_port: int, zero_copy: bool = True, ports: dict[int, int] | None = None):
    """(proxy, seen, uvicorn server): forkyard's protocol (guarded, with the zero-copy
    send when ``zero_copy``) in front of a SandboxProxy whose every sandbox is at
    ``upstream_port`` (or, by sandbox port, at ``ports[port]``)."""
    async def rest(scope, receive, send):  # the REST app: never reached here
        raise AssertionError("no REST request in these tests")

    proxy = SandboxProxy(rest, resolve=lambda sid, port: ("127.0.0.1", (ports or {}).get(port, upstream_port)))
    seen = Seen(proxy)
    limits = uvicorn_limits(zero_copy=zero_copy)
    config = uvicorn.Config(seen, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            http=limits["http"])
    return proxy, seen, uvicorn.Server(config)


async def _serve(upstream_port: int, zero_copy: bool = True, sock: socket.socket | None = None,
                 ports: dict[int, int] | None = None):
    """Start :func:`_server`'s server (on ``sock`` if given). Returns (proxy, seen,
    server, task, base URL); :func:`_stop` stops it."""
    proxy, seen, server = _server(upstream_port, zero_copy, ports)
    task = asyncio.create_task(server.serve(sockets=[sock] if sock else None))
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return proxy, seen, server, task, f"http://127.0.0.1:{port}"


async def _stop(proxy, server, task) -> None:
    await proxy.aclose()
    server.should_exit = True
    await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def serving(upstream_port: int, zero_copy: bool = True, ports: dict[int, int] | None = None):
    """:func:`_serve` … :func:`_stop` as a context. Yields (proxy, Seen, base URL)."""
    proxy, seen, server, task, url = await _serve(upstream_port, zero_copy, ports=ports)
    try:
        yield proxy, seen, url
    finally:
        await _stop(proxy, server, task)


async def _ended(up: Upstream) -> list[str]:
    """How the upstream's connections ended, once one has (waits ≤ 10 s)."""
    for _ in range(200):
        if up.ended:
            break
        await asyncio.sleep(0.05)
    return up.ended


@pytest.fixture
async def upstream():
    up = Upstream()
    await up.start()
    yield up
    up.server.close()


@pytest.mark.parametrize("zero_copy", [True, False])
async def test_every_framing_over_one_connection(upstream, zero_copy):
    """Bodies of every framing arrive whole and in order over one client connection and
    one kept-alive upstream connection; the 1 MiB bodies go through the zero-copy send
    when the server offers it (and only then)."""
    async with serving(upstream.port, zero_copy) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            for _ in range(3):
                r = await c.get("/big")
                assert r.status_code == 200 and r.content == BIG and r.headers["x-kind"] == "big"
            r = await c.get("/small")
            assert r.content == b"small"
            r = await c.head("/big")
            assert r.status_code == 200 and r.headers["content-length"] == str(len(BIG)) and r.content == b""
            r = await c.get("/chunked")
            assert r.content == BIG[:300_000]
            r = await c.get("/204")
            assert r.status_code == 204 and r.content == b""
            for extra in ({}, {"content-length": "0"}):  # fast path, general relay
                r = await c.get("/304", headers=extra)
                assert r.status_code == 304 and r.content == b""
            r = await c.request("OPTIONS", "/big")
            assert r.content == BIG
        # Every answer above keeps its connection: one of the fast path, one of the
        # general relay (the "content-length: 0" request).
        assert upstream.connections == 2
        assert upstream.hosts and all(h.startswith("127.0.0.1:") for h in upstream.hosts)  # the client's Host
        assert (zerocopy.EXTENSION in seen.types) == zero_copy
        assert seen.types.count(zerocopy.EXTENSION) == (4 if zero_copy else 0)


async def test_kept_alive_connections_serve_only_their_own_port(upstream):
    """Two ports of one sandbox, both keep-alive servers: requests alternating between
    them are each answered by their own port's server (a kept-alive connection to one
    port once answered a request for another: envd's 401 for a user port)."""
    other = Upstream()
    await other.start()
    other.hosts = []
    try:
        async with serving(upstream.port, ports={8000: upstream.port, 9000: other.port}) as (proxy, seen, url):
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                for i in range(3):
                    for port, server in ((8000, upstream), (9000, other)):
                        r = await c.get("/small", headers={"E2b-Sandbox-Id": "sbx", "E2b-Sandbox-Port": str(port)})
                        assert r.content == b"small"
                        assert len(server.hosts) == i + 1, (port, i)
        assert upstream.connections == 1 and other.connections == 1
    finally:
        other.server.close()


async def test_bytes_beyond_an_answer_never_answer_the_next_request(upstream):
    """An upstream that sends more than its Content-Length, shaped as a second answer:
    the fast path does not reuse that connection, so the next request gets its own
    answer. (The general relay does: httpcore keeps the extra bytes h11 buffered for the
    next response on that connection — only a sandbox's own clients see it, and the
    sandbox chooses its answers anyway; see docs/architecture.md.)"""
    async with serving(upstream.port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            r = await c.get("/extra")
            assert r.content == BIG
            await asyncio.sleep(0.2)
            assert (await c.get("/small")).content == b"small"


async def test_connection_ending_bodies(upstream):
    """Close-delimited and HTTP/1.0 answers are relayed whole and their upstream
    connections are not reused."""
    async with serving(upstream.port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            for path in ("/close", "/http10", "/http10", "/big"):
                r = await c.get(path)
                assert r.status_code == 200 and r.content == BIG, path
        assert upstream.connections == 4


async def test_a_cut_body_is_never_passed_off_as_complete(upstream):
    """An upstream that closes before its announced length: the client's read fails at
    once (the proxy aborts the connection; it does not leave it open until the
    keep-alive timeout), and the proxy serves the next request."""
    async with serving(upstream.port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await asyncio.wait_for(c.get("/cut"), 2)  # uvicorn's keep-alive timeout is 5 s
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            assert (await c.get("/big")).content == BIG


async def test_client_going_away_closes_the_upstream_connection(upstream):
    """A client that leaves in the middle of a long spliced body: the proxy closes its
    upstream connection (the server sees a reset), it does not drain 256 MiB."""
    async with serving(upstream.port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            async with c.stream("GET", "/slow") as r:
                got = 0
                async for piece in r.aiter_raw():
                    got += len(piece)
                    if got > 1 << 20:
                        break
        assert await _ended(upstream) == ["reset"]
        assert zerocopy.EXTENSION in seen.types


async def test_forget_ends_a_spliced_body(upstream):
    """A sandbox killed mid-body (``forget``): the client's body ends incomplete and the
    upstream connection is closed."""
    async with serving(upstream.port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                async with c.stream("GET", "/slow") as r:
                    got = 0
                    async for piece in r.aiter_raw():
                        got += len(piece)
                        if got > 1 << 20 and not upstream.ended:
                            await proxy.forget("sbx")
        assert await _ended(upstream) == ["reset"]


async def test_a_port_nothing_listens_on_is_e2bs_502():
    """Nothing listening: 502 "The sandbox is running but port is not open" (E2B's
    wording, the SDKs read it), as the general relay answers."""
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with serving(port) as (proxy, seen, url):
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            r = await c.get("/big")
        assert r.status_code == 502
        # exactly E2B's message: nothing internal (the upstream's address, an exception)
        assert r.json()["message"] == "The sandbox is running but port is not open", r.text
        assert r.json()["sandboxId"] == "sbx" and r.json()["port"] == port
        assert "127.0.0.1" not in r.text and "Error" not in r.text, r.text
        # A browser gets a page, as from E2B's proxy (its User-Agent rule).
        async with httpx.AsyncClient(base_url=url, headers={**HDRS, "User-Agent": "Mozilla/5.0 (X11) Firefox/120"},
                                     timeout=30) as c:
            for method in ("GET", "POST"):  # fast path and general relay
                r = await c.request(method, "/big", content=b"x" if method == "POST" else None)
                assert r.status_code == 502 and r.headers["content-type"].startswith("text/html"), r.text
                assert "Closed Port Error" in r.text and "sbx" in r.text and str(port) in r.text
                assert "127.0.0.1" not in r.text


# --- A sandbox is untrusted: its server may answer anything. -------------------------

#: Sends a request through the general relay instead (a declared empty body).
GENERAL = b"content-length: 0\r\n"
SMUGGLED = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nSMUGGLED"


class Scripted:
    """A TCP server that runs ``script(reader, writer)`` on every connection: it answers
    whatever a test makes it answer, as a sandbox's server may. Counts connections."""

    def __init__(self, script):
        self.script = script
        self.connections = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> "Scripted":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.script(reader, writer)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()


def _req(path: str, method: str = "GET", extra: bytes = b"") -> bytes:
    """A raw request for the test sandbox (``extra``: more header lines)."""
    return (f"{method} {path} HTTP/1.1\r\nhost: t\r\ne2b-sandbox-id: sbx\r\ne2b-sandbox-port: 8000\r\n".encode()
            + extra + b"\r\n")


async def _raw(url: str, data: bytes, until: bytes, timeout_s: float = 5.0) -> bytes:
    """Send ``data`` on a new connection to ``url``; what comes back until ``until`` has
    been read, the server closes, or ``timeout_s``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    got = b""
    try:
        writer.write(data)
        async with asyncio.timeout(timeout_s):
            while until not in got:
                piece = await reader.read(1 << 16)
                if not piece:
                    break
                got += piece
    except TimeoutError:
        pass
    finally:
        writer.close()
    return got


@pytest.mark.parametrize("method,path", [("GET", "/big"), ("GET", "/small"), ("HEAD", "/small")])
async def test_bytes_after_a_body_never_answer_the_next_request(method, path):
    """A sandbox that writes a whole response more after a body (spliced, relayed or
    HEAD's): the kept-alive upstream connection is not reused — the next request gets
    its own answer, never those bytes."""
    async def script(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if b" /next " in head:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nhonest")
                continue
            body = BIG if b" /big " in head else b"small"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body))
            if not head.startswith(b"HEAD"):
                writer.write(body)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(SMUGGLED)

    up = await Scripted(script).start()
    proxy, seen, server, task, url = await _serve(up.port)
    try:
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            r = await c.request(method, path)
            assert r.status_code == 200
            await asyncio.sleep(0.3)
            r = await c.get("/next")
            assert r.content == b"honest"
        assert up.connections == 2
    finally:
        await _stop(proxy, server, task)
        up.close()


async def test_a_bodyless_post_after_the_sandbox_closed_an_idle_connection():
    """A server that closes idle connections soon (Node's keepAliveTimeout is 5 s): a
    bodyless POST afterwards is answered on a new connection — not a 502 for a kept-alive
    one found closed (a POST is not sent twice)."""
    async def script(reader, writer):
        while True:
            try:
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.1)
            except TimeoutError:
                return  # idle: close
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    up = await Scripted(script).start()
    proxy, seen, server, task, url = await _serve(up.port)
    try:
        assert (await _raw(url, _req("/a"), b"\r\n\r\nok")).startswith(b"HTTP/1.1 200 ")
        await asyncio.sleep(0.5)
        got = await _raw(url, _req("/b", "POST"), b"\r\n\r\nok")
        assert got.startswith(b"HTTP/1.1 200 "), got
    finally:
        await _stop(proxy, server, task)
        up.close()


async def test_connect_answered_by_a_tunnel_does_not_freeze_the_server():
    """``CONNECT`` answered 200 (h11 then switches the connection to a tunnel and only
    says PAUSED): the fast path used to loop on that forever, the event loop frozen for
    every client. It goes through the general relay. (The proxy runs on a loop of its
    own here, so a frozen one fails this test instead of hanging it.)"""
    async def script(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\n\r\ntunnel bytes")
        await writer.drain()
        await asyncio.sleep(2)

    up = await Scripted(script).start()
    proxy, seen, server = _server(up.port)
    started = threading.Event()

    def run():
        async def main():
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)
            started.set()
            await task
            await proxy.aclose()

        asyncio.run(main())

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        assert started.wait(10)
        url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
        got = await _raw(url, _req("/x", "CONNECT"), b"0\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 ") and got.endswith(b"0\r\n\r\n"), got
        got = await _raw(url, _req("/x"), b"\r\n\r\n")  # the server still serves
        assert got.startswith(b"HTTP/1.1 "), got
    finally:
        server.should_exit = True
        await asyncio.to_thread(thread.join, 10)  # (the sandbox runs on this loop)
        up.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("stall", ["head", "source"])
async def test_a_client_that_stops_reading_leaves_the_loop_idle(stall):
    """A client that stops reading a spliced body must cost no CPU: the loop sleeps
    until a socket is ready (the general relay waits on uvicorn's flow control the same
    way). ``head``: the response head is still in uvicorn's buffer when the splice
    starts (it used to be polled every 0.5 ms); ``source``: the sandbox has more to send
    while the client is full (its level-triggered readiness used to wake the loop on
    every turn)."""
    async def script(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            if b" /mid " in head:  # relayed (under 64 KiB): fills the client's socket
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 60000\r\n\r\n" + BIG[:60000])
            else:
                big = BIG * 8
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big))
                await writer.drain()
                await asyncio.sleep(0.3)  # the splice waits for the body first
                writer.write(big)
            await writer.drain()

    up = await Scripted(script).start()
    listen = socket.socket()
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # (accepted sockets inherit it)
    listen.bind(("127.0.0.1", 0))
    proxy, seen, server, task, url = await _serve(up.port, sock=listen)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        client.connect(listen.getsockname())
        client.sendall((_req("/mid") if stall == "head" else b"") + _req("/big"))  # and reads nothing
        for _ in range(100):
            if zerocopy.EXTENSION in seen.types:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        selector = asyncio.get_running_loop()._selector  # noqa: SLF001 — counts loop turns
        turns, select = 0, selector.select

        def counted(timeout=None):
            nonlocal turns
            turns += 1
            return select(timeout)

        selector.select = counted
        try:
            await asyncio.sleep(1)
        finally:
            selector.select = select
        assert zerocopy.EXTENSION in seen.types
        assert turns < 200, f"{turns} loop turns in 1 s with one stalled client"
    finally:
        client.close()
        await _stop(proxy, server, task)
        up.close()


def _answers(script_answer: bytes):
    """A script answering ``/odd`` with ``script_answer`` and ``/after`` with "after"."""
    async def script(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            writer.write(script_answer if b" /odd " in head else b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nafter")
            await writer.drain()
    return script


@pytest.mark.parametrize("relay", ["fast", "general"])
@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 304 Not Modified\r\netag: x\r\ncontent-length: 100\r\n\r\n",  # RFC 9110 §8.6 allows it
    b"HTTP/1.1 204 No Content\r\ncontent-length: 100\r\n\r\n",
    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
], ids=["304+length", "204+length", "length+chunked"])
async def test_answers_with_a_length_and_no_such_body(relay, answer):
    """A Content-Length no body follows as such (a 304's or 204's; one beside chunked
    framing, which wins): passed on without it — uvicorn would wait for that many bytes
    and fail ("Exception in ASGI application", the client's connection dropped) — and the
    client's next pipelined request is answered."""
    up = await Scripted(_answers(answer)).start()
    proxy, seen, server, task, url = await _serve(up.port)
    extra = GENERAL if relay == "general" else b""
    try:
        got = await _raw(url, _req("/odd", extra=extra) + _req("/after", extra=extra), b"\r\n\r\nafter")
        assert got.startswith(answer[:12]) and got.endswith(b"\r\n\r\nafter"), got
        first = got[:got.rindex(b"HTTP/1.1 200 OK\r\n")]
        assert b"content-length" not in first, first
        if b"chunked" in answer:
            assert first.endswith(b"\r\n\r\n2\r\nok\r\n0\r\n\r\n"), first
    finally:
        await _stop(proxy, server, task)
        up.close()


@pytest.mark.parametrize("relay", ["fast", "general"])
async def test_a_status_over_599_is_a_502(relay):
    """h11 reads any three digits as a status; uvicorn has no status line beyond 599
    (its KeyError dropped the connection unanswered): 502."""
    up = await Scripted(_answers(b"HTTP/1.1 999 Odd\r\ncontent-length: 2\r\n\r\nok")).start()
    proxy, seen, server, task, url = await _serve(up.port)
    try:
        got = await _raw(url, _req("/odd", extra=GENERAL if relay == "general" else b""), b"}")
        assert got.startswith(b"HTTP/1.1 502 ") and b"999" in got, got
    finally:
        await _stop(proxy, server, task)
        up.close()


@pytest.mark.parametrize("relay", ["fast", "general"])
async def test_forget_under_a_body_that_ends_with_its_connection(relay):
    """A body without length (it ends when the sandbox closes) whose sandbox is killed
    mid-way (``forget`` closes the proxy's connections): the client's body ends
    incomplete — that end was the proxy's, not the sandbox's."""
    async def script(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
        for _ in range(400):
            writer.write(b"x" * 1000)
            await writer.drain()
            await asyncio.sleep(0.01)

    up = await Scripted(script).start()
    proxy, seen, server, task, url = await _serve(up.port)
    extra = {"content-length": "0"} if relay == "general" else {}
    try:
        async with httpx.AsyncClient(base_url=url, headers=HDRS, timeout=30) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                async with c.stream("GET", "/", headers=extra) as r:
                    got = 0
                    async for piece in r.aiter_raw():
                        got += len(piece)
                        if got > 50_000 and "sbx" in proxy._clients:  # noqa: SLF001
                            await proxy.forget("sbx")
    finally:
        await _stop(proxy, server, task)
        up.close()
