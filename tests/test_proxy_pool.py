"""The sandbox proxy's connection pools close every connection to a sandbox that goes
away — also one still connecting when the sandbox was killed (httpcore's pool then no
longer lists it and kept it open, ESTABLISHED to a vanished sandbox: bench/soak.py).
A real TCP server and the proxy's real pool; only the connect is held at a gate, to
make the race happen every time."""

from __future__ import annotations

import asyncio

import httpcore
import httpx
import pytest

from forkyard.api.proxy import SandboxProxy
from forkyard.relay.fastpath import FastConnections
from forkyard.relay.upstream import SandboxConnections, sandbox_client


class _GatedConnect(httpcore.AnyIOBackend):
    """A real connect that starts only once ``gate`` is set."""

    def __init__(self, gate: asyncio.Event):
        self.gate = gate
        self.started = asyncio.Event()

    async def connect_tcp(self, *args, **kwargs):
        self.started.set()
        await self.gate.wait()
        return await super().connect_tcp(*args, **kwargs)


async def test_a_connection_still_connecting_when_the_sandbox_goes_is_closed():
    closed = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if await reader.read(65536):  # a request came: answer it, then wait for the close
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(65536), 10)
            except asyncio.TimeoutError:
                return
        closed.set()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    gate = asyncio.Event()
    backend = _GatedConnect(gate)
    proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
    conns = SandboxConnections(backend)
    proxy._clients["sbx"] = (sandbox_client(conns), conns, FastConnections())
    client = proxy._client("sbx")
    try:
        request = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/"))
        await asyncio.wait_for(backend.started.wait(), 5)
        await proxy.forget("sbx")  # the sandbox was killed while the proxy connected to it
        gate.set()
        with pytest.raises(httpx.ConnectError):
            await request
        await asyncio.wait_for(closed.wait(), 3)  # the server saw the connection closed
        assert "sbx" not in proxy._clients
    finally:
        gate.set()
        server.close()
        await server.wait_closed()
        await proxy.aclose()


async def test_pools_of_running_sandboxes_keep_serving():
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(65536):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
    try:
        client = proxy._client("sbx")
        for _ in range(3):  # one kept-alive connection, reused
            assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        assert proxy._clients["sbx"][1].open_streams == 1
    finally:
        server.close()
        await server.wait_closed()
        await proxy.aclose()


# The upstream sockets (forkyard.relay.upstream): plain asyncio transports under the pool.

async def _serve(handler):
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_a_streamed_response_is_passed_on_piece_by_piece():
    """A read returns what has arrived (Connect server-streaming depends on it): the
    server sends its second piece only after the client got the first."""
    got_first = asyncio.Event()

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await writer.drain()
        await asyncio.wait_for(got_first.wait(), 5)
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await writer.drain()
        writer.close()

    server, port = await _serve(serve)
    proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
    try:
        pieces = []
        async with proxy._client("sbx").stream("GET", f"http://127.0.0.1:{port}/") as r:
            async for piece in r.aiter_raw():
                pieces.append(piece)
                got_first.set()
        assert pieces == [b"first", b"second"]
    finally:
        server.close()
        await proxy.aclose()


async def test_a_slow_client_holds_at_most_the_read_buffer():
    """Reading from the sandbox pauses while READ_BUFFER_BYTES wait to be relayed, so a
    client that reads slowly never makes the proxy buffer the whole response."""
    from forkyard.relay.upstream import READ_BUFFER_BYTES

    size = 16 << 20

    async def serve(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size >> 20):
            writer.write(b"x" * (1 << 20))
            await writer.drain()
        writer.close()

    server, port = await _serve(serve)
    proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
    try:
        async with proxy._client("sbx").stream("GET", f"http://127.0.0.1:{port}/") as r:
            total = 0
            async for piece in r.aiter_raw():
                if total == 0:
                    await asyncio.sleep(0.5)  # the server has long filled every buffer
                    (stream,) = list(proxy._clients["sbx"][1]._streams)
                    # one recv (≤ 256 KiB) may land after the pause threshold was reached
                    assert stream._p.size <= READ_BUFFER_BYTES + (256 << 10)
                assert len(piece) <= READ_BUFFER_BYTES
                total += len(piece)
        assert total == size
    finally:
        server.close()
        await proxy.aclose()


async def test_a_kept_alive_connection_the_sandbox_closed_is_not_reused():
    """After the server closes an idle kept-alive connection, the next request opens a
    new one (the stream reports itself readable at EOF) instead of failing on it."""
    served = 0

    async def serve(reader, writer):
        nonlocal served
        await reader.readuntil(b"\r\n\r\n")
        served += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # no Connection: close header: the client thinks it is kept alive

    server, port = await _serve(serve)
    proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
    try:
        client = proxy._client("sbx")
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        await asyncio.sleep(0.2)  # the FIN arrives
        assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        assert served == 2
    finally:
        server.close()
        await proxy.aclose()


async def test_connect_errors_are_httpx_connect_errors():
    """A closed port is an httpx.ConnectError (relay_http answers E2B's "port is not
    open" 502 from it)."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        proxy = SandboxProxy(app=None, resolve=lambda sid, port: ("127.0.0.1", port))
        try:
            with pytest.raises(httpx.ConnectError):
                await proxy._client("sbx").get(f"http://127.0.0.1:{port}/")
        finally:
            await proxy.aclose()
