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

from forkyard.api.proxy import SandboxConnections, SandboxProxy, sandbox_client


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
    proxy._clients["sbx"] = (sandbox_client(conns), conns)
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
