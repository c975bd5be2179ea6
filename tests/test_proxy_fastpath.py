"""The proxy's fast path (forkyard.api.fastpath) and uvicorn's zero-copy send
(forkyard.api.zerocopy), in process: a real uvicorn server with forkyard's protocol in
front of :class:`SandboxProxy`, relaying to a real HTTP/1.1 server on loopback whose
answers cover every framing (Content-Length, chunked, close-delimited, HEAD, 204,
HTTP/1.0, a body cut short). The same relay to real sandboxes is tested in
tests/test_fidelity.py (``test_proxy_large_get_never_truncated``)."""

from __future__ import annotations

import asyncio
import contextlib
import os

import httpx
import pytest
import uvicorn

from forkyard.api import zerocopy
from forkyard.api.limits import uvicorn_limits
from forkyard.api.proxy import SandboxProxy

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


@contextlib.asynccontextmanager
async def serving(upstream_port: int, zero_copy: bool = True, ports: dict[int, int] | None = None):
    """A uvicorn server (forkyard's protocol: guarded, with the zero-copy send when
    ``zero_copy``) in front of a SandboxProxy whose every sandbox is at
    ``upstream_port`` (or, by sandbox port, at ``ports[port]``). Yields (proxy, Seen,
    base URL)."""
    async def rest(scope, receive, send):  # the REST app: never reached here
        raise AssertionError("no REST request in these tests")

    proxy = SandboxProxy(rest, resolve=lambda sid, port: ("127.0.0.1", (ports or {}).get(port, upstream_port)))
    seen = Seen(proxy)
    limits = uvicorn_limits(zero_copy=zero_copy)
    config = uvicorn.Config(seen, host="127.0.0.1", port=0, log_level="warning", lifespan="off",
                            http=limits["http"])
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield proxy, seen, f"http://127.0.0.1:{port}"
    finally:
        await proxy.aclose()
        server.should_exit = True
        await asyncio.wait_for(task, 10)


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
        assert r.json()["message"].startswith("The sandbox is running but port is not open")
        assert r.json()["sandboxId"] == "sbx"
