"""The relays' upstream sockets: an httpcore network backend on plain asyncio transports,
and the per-upstream connection set and httpx client built on it.

httpcore's default backend (anyio) costs the relay most of its CPU on a 1 MiB GET
(measured with cProfile, bench/bench_proxy.py): a thread-pool ``getaddrinfo`` for every
connect (also for IP literals, which are all the proxy connects to), a cancel scope, a
``resume_reading``/``pause_reading`` pair and at most one 64 KiB piece per read
(httpcore asks for ``READ_NUM_BYTES`` = 64 KiB). This backend connects with
``loop.create_connection`` (uvloop's, under ``forkyard serve``), keeps what the socket
delivers in a buffer bounded by :data:`READ_BUFFER_BYTES` (reading is paused above it, so
a slow client never makes the proxy hold more than that per connection) and hands all of
it to one ``read`` — up to :data:`READ_BUFFER_BYTES`, whatever ``max_bytes`` httpcore
asks for (h11 buffers what it does not need yet). A read returns as soon as any byte is
there, so streamed responses (Connect server-streaming) are relayed at once.

HTTP framing stays h11's (httpcore): this module moves bytes only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import typing
import weakref

import httpcore
import httpx

#: Most bytes buffered from one upstream connection before reading from it pauses, and
#: the most one ``read`` returns (bytes): about what one uvloop ``recv`` delivers at most
#: (``UV_STREAM_RECV_BUF_SIZE`` = 256 000 bytes), so a read seldom has to join pieces.
READ_BUFFER_BYTES = 256 * 1024

log = logging.getLogger("forkyard.proxy")


class _Reader(asyncio.Protocol):
    """Buffers what the socket delivers; wakes a waiting ``read``."""

    def __init__(self):
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.eof = False
        self.error: BaseException | None = None
        self.waiter: asyncio.Future | None = None
        self.paused = False
        self.write_paused = False
        self.drained: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size >= READ_BUFFER_BYTES and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self):
        self.eof = True
        self._wake()
        return True  # half-closed: sending may go on (an early answer during an upload)

    def connection_lost(self, exc) -> None:
        self.eof = True
        self.error = exc
        self._wake()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One upstream TCP connection (see the module doc). Errors are httpcore's:
    ``ReadError``/``WriteError`` when the connection failed or was reset, ``ReadTimeout``
    /``WriteTimeout`` past ``timeout`` seconds (None: no limit)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Reader):
        self._transport = transport
        self._p = protocol

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        """Every buffered byte up to ``max(max_bytes, READ_BUFFER_BYTES)``, waiting for
        the first one; ``b""`` at the end of the stream."""
        p = self._p
        if not p.chunks:
            if p.eof:
                if p.error is not None:
                    raise httpcore.ReadError(repr(p.error))
                return b""
            p.waiter = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await p.waiter
            except TimeoutError:
                raise httpcore.ReadTimeout(f"no data in {timeout} s") from None
            finally:
                p.waiter = None
            if not p.chunks:
                if p.error is not None:
                    raise httpcore.ReadError(repr(p.error))
                return b""
        limit = max(max_bytes, READ_BUFFER_BYTES)
        if len(p.chunks) == 1 and p.size <= limit:
            data = p.chunks[0]
            p.chunks = []
        else:
            data = b"".join(p.chunks)
            p.chunks = [data[limit:]] if len(data) > limit else []
            data = data[:limit]
        p.size -= len(data)
        if p.paused and p.size < READ_BUFFER_BYTES and not self._transport.is_closing():
            p.paused = False
            self._transport.resume_reading()
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        """Send ``buffer``, waiting while the transport's write buffer is over its
        high-water mark."""
        p = self._p
        if p.eof and p.error is not None or self._transport.is_closing():
            raise httpcore.WriteError("the connection is closed")
        if not buffer:
            return
        self._transport.write(buffer)
        if p.write_paused:
            p.drained = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(timeout):
                    await p.drained
            except TimeoutError:
                raise httpcore.WriteTimeout(f"could not send in {timeout} s") from None
            finally:
                p.drained = None
            if self._transport.is_closing():
                raise httpcore.WriteError("the connection closed while sending")

    async def aclose(self) -> None:
        """Close the socket now (what is not yet sent is dropped: the peer may be gone)."""
        self._transport.abort()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        raise httpcore.ConnectError("TLS to a sandbox is not supported")

    def get_extra_info(self, info: str) -> typing.Any:
        """``is_readable`` (httpcore asks it of an idle kept-alive connection: True means
        the server closed it or sent something unasked), else the transport's."""
        if info == "is_readable":
            return bool(self._p.chunks) or self._p.eof
        if info == "client_addr":
            return self._transport.get_extra_info("sockname")
        if info == "server_addr":
            return self._transport.get_extra_info("peername")
        return self._transport.get_extra_info(info)


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """httpcore network backend making :class:`AsyncioStream` connections (TCP only)."""

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: typing.Iterable | None = None) -> AsyncioStream:
        """Connect to ``host:port`` within ``timeout`` seconds (None: no limit). Raises
        ``httpcore.ConnectTimeout`` / ``httpcore.ConnectError``."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                transport, protocol = await loop.create_connection(
                    _Reader, host, port, local_addr=(local_address, 0) if local_address else None)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"connecting to {host}:{port} took over {timeout} s") from None
        except OSError as e:
            raise httpcore.ConnectError(str(e)) from e
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for option in socket_options or ():
                sock.setsockopt(*option)
        return AsyncioStream(transport, protocol)

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("sandbox traffic goes over TCP only")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class SandboxConnections(httpcore.AsyncNetworkBackend):
    """The network backend of one sandbox's connection pool: it knows every connection it
    opened, so :meth:`aclose` closes them all — including one that was still connecting
    when the pool was closed. httpcore's ``AsyncConnectionPool.aclose`` only closes the
    connections it lists, and a connection whose TCP connect completes after that is
    used for its request and then kept open (idle, out of every list): ESTABLISHED to a
    sandbox that is gone, for the server's lifetime (found by bench/soak.py: 3 sockets
    after 200 cycles with sandboxes killed mid-request). After :meth:`aclose` every new
    connection is closed at once and raises ``httpcore.ConnectError`` (httpx: 502).
    ``backend`` makes the connections; by default
    :class:`AsyncioBackend` (plain asyncio sockets: the relay's CPU cost, see the
    module doc).
    """

    def __init__(self, backend: httpcore.AsyncNetworkBackend | None = None):
        self._backend = backend or AsyncioBackend()
        self._streams: weakref.WeakSet = weakref.WeakSet()
        self.closed = False

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        """Connect like the wrapped backend, and remember the stream (weakly)."""
        stream = await self._backend.connect_tcp(host, port, timeout=timeout, local_address=local_address,
                                                 socket_options=socket_options)
        if self.closed:
            await stream.aclose()
            raise httpcore.ConnectError("the sandbox's connections were closed: it is gone")
        self._streams.add(stream)
        return stream

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore.ConnectError("sandbox traffic goes over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)

    @property
    def open_streams(self) -> int:
        """Connections opened and not yet collected (closed ones may still count)."""
        return len(self._streams)

    async def aclose(self) -> None:
        """Close every connection this backend opened, and any it opens from now on."""
        self.closed = True
        for stream in list(self._streams):
            try:
                await stream.aclose()
            except Exception as e:  # noqa: BLE001 — closing what is already broken
                log.debug("closing a sandbox connection failed: %r", e)
        self._streams = weakref.WeakSet()


def sandbox_client(connections: SandboxConnections) -> httpx.AsyncClient:
    """An httpx client for one sandbox's traffic whose pool connects through
    ``connections`` (httpx takes no network backend, so its transport's pool is
    replaced by an equal one that does: no proxies from the environment, no timeouts
    but a 5 s connect, at most 32 idle connections)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    transport = httpx.AsyncHTTPTransport(trust_env=False, limits=limits)
    transport._pool = httpcore.AsyncConnectionPool(  # noqa: SLF001 — see the docstring
        max_connections=limits.max_connections, max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry, network_backend=connections)
    client = httpx.AsyncClient(trust_env=False, transport=transport,
                               timeout=httpx.Timeout(connect=5.0, read=None, write=None, pool=None))
    # Forward only what the client sent (see forkyard.relay.http.relay_http: httpx re-adds
    # its defaults on this setter, relay_http removes them per request).
    client.headers = httpx.Headers()
    return client
