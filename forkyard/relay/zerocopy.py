"""ASGI zero-copy send for uvicorn: the proxy's response bodies go socket to socket.

uvicorn does not implement the ASGI ``http.response.zerocopysend`` extension
(asgi.readthedocs.io, "Extensions" → "Zero Copy Send"). :class:`ZeroCopyHttpToolsProtocol`
is uvicorn's own httptools protocol (pass it as ``uvicorn.run(..., http=…)``) whose
request cycles implement it, so :mod:`forkyard.relay.fastpath` can hand a sandbox's
``Content-Length`` response body from the upstream socket to the client socket with
``splice(2)`` — no copy through Python (issue 9 item 8: the proxy's throughput goal).

The message, as the extension defines it: ``{"type": "http.response.zerocopysend",
"file": <object with fileno()>, "count": int bytes, "offset": int | None,
"more_body": bool}``, sent after ``http.response.start`` with a ``content-length``. Here
``file`` may be a socket or pipe (spliced as it is read; ``offset`` must be None) or a
regular file (read from ``offset``). ``count`` is required. The send returns once all
``count`` bytes are written to the client socket, and raises:

* :class:`SourceEnded` when ``file`` reached its end (or failed) before ``count`` bytes
  — the response is then incomplete and the caller must abort it (raise);
* ``OSError`` when the client connection failed;
* ``RuntimeError`` for a message that breaks the response's framing (no
  ``content-length``, more bytes than announced) — as uvicorn does for its own messages.

The scope offers the extension (``scope["extensions"]["http.response.zerocopysend"]``)
only on plain TCP connections: on a TLS listener the bytes must go through the SSL
transport, so callers fall back to ``http.response.body``.

The protocol also records each request's header names as the client wrote them
(:data:`~forkyard.relay.headers.RAW_HEADER_NAMES` in the scope's extensions; ASGI
lowercases ``scope["headers"]``), so the relays pass on ``Host:`` and ``X-Custom:``
unchanged, as E2B's proxy does (:func:`~forkyard.relay.headers.client_headers`).

This module depends on uvicorn internals (``RequestResponseCycle``'s ``transport``,
``expected_content_length``, ``chunked_encoding``, ``response_started``, ``disconnected``,
``flow``), pinned by ``uvicorn[standard]`` in pyproject.toml and exercised by
tests/test_proxy_fastpath.py, which fails if they change.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import socket

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from forkyard.relay.headers import RAW_HEADER_NAMES

EXTENSION = "http.response.zerocopysend"
#: Pipe size asked for each splice (bytes; F_SETPIPE_SZ, at most
#: /proc/sys/fs/pipe-max-size = 1 MiB by default): fewer syscalls per MiB than the 64 KiB
#: default. A refusal keeps the default.
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031  # linux/fcntl.h (F_LINUX_SPECIFIC_BASE + 7)
#: Bytes a TCP source must hold before the loop wakes to splice them (SO_RCVLOWAT):
#: fewer, larger pieces than the sandbox's netstack delivers (measured with
#: bench/bench_proxy.py).
LOWAT_BYTES = 64 * 1024


class SourceEnded(Exception):
    """The zero-copy source ended or failed before ``count`` bytes were sent."""


async def wait_readable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Wait until ``fd`` is readable (or at its end)."""
    fut = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        await fut
    finally:
        loop.remove_reader(fd)


class _Watch:
    """Readiness of one fd for reading or writing, registered with the event loop once
    for a whole transfer (not once per wait: that costs two epoll_ctl calls per piece).

    The loop polls level-triggered: a registered fd that is ready calls back on every
    loop turn until it is not. So a callback that comes while nobody waits on this fd
    (the transfer waits on its other side: a client that stops reading while the
    sandbox has more to send) unregisters it, to be registered again by the next
    :meth:`wait` — else the loop would spin at full CPU for as long as that lasts."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, write: bool):
        self._loop, self._fd, self._write = loop, fd, write
        self._waiter: asyncio.Future | None = None
        self._on = False

    def _ready(self) -> None:
        if self._waiter is None:
            self.close()
        elif not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        """Wait until the fd is ready."""
        self._waiter = self._loop.create_future()
        if not self._on:
            (self._loop.add_writer if self._write else self._loop.add_reader)(self._fd, self._ready)
            self._on = True
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        """Unregister the fd."""
        if self._on:
            (self._loop.remove_writer if self._write else self._loop.remove_reader)(self._fd)
            self._on = False


async def splice_to(loop: asyncio.AbstractEventLoop, source, dst: int, count: int,
                    offset: int | None = None) -> None:
    """Move ``count`` bytes from ``source`` (an object with ``fileno()``: socket, pipe or
    file, read from ``offset``) to fd ``dst`` (a non-blocking socket) with splice(2)
    through a pipe, waiting on the event loop when either side would block. A TCP
    socket source wakes the loop only once :data:`LOWAT_BYTES` (or the rest of the
    body) are there (``SO_RCVLOWAT``; restored after). Raises :class:`SourceEnded` when
    ``source`` ends or fails first, ``OSError`` when ``dst`` fails."""
    src = source.fileno()
    sock = source if isinstance(source, socket.socket) and source.type == socket.SOCK_STREAM else None
    lowat = 1
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    readable, writable = _Watch(loop, src, write=False), _Watch(loop, dst, write=True)
    try:
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass
        flags = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
        left, in_pipe = count, 0
        while left or in_pipe:
            if left:
                try:
                    n = os.splice(src, w, min(left, PIPE_BYTES), offset, None, flags)
                except BlockingIOError:
                    n = -1
                except OSError as e:
                    raise SourceEnded(f"reading the body failed: {e}") from e
                if n == 0:
                    raise SourceEnded(f"the body ended {left} bytes early")
                if n > 0:
                    if offset is not None:
                        offset += n
                    left -= n
                    in_pipe += n
                elif not in_pipe:
                    if sock is not None:  # wake once this much is there (or at the end)
                        want = min(left, LOWAT_BYTES)
                        if want != lowat:
                            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                            lowat = want
                    await readable.wait()
                    continue
            try:
                in_pipe -= os.splice(r, dst, in_pipe, None, None, flags)
            except BlockingIOError:
                await writable.wait()
    finally:
        readable.close()
        writable.close()
        os.close(r)
        os.close(w)
        if sock is not None and lowat != 1 and sock.fileno() >= 0:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)  # a kept-alive socket reads heads
            except OSError:
                pass


class ZeroCopyCycle(RequestResponseCycle):
    """uvicorn's request cycle plus ``http.response.zerocopysend`` (see the module doc)."""

    async def send(self, message) -> None:  # noqa: D401 — ASGI send
        if message.get("type") != EXTENSION:
            return await super().send(message)
        if not self.response_started or self.chunked_encoding is not False:
            raise RuntimeError(f"'{EXTENSION}' needs a started response with a content-length")
        count = int(message["count"])
        if count < 0 or count > self.expected_content_length:
            raise RuntimeError("Response content longer than Content-Length")
        if self.disconnected:
            raise OSError("the client disconnected")
        loop = asyncio.get_running_loop()
        # What uvicorn has buffered (the status line and headers) goes out first. With
        # the transport's high-water mark at 0 its protocol stays paused until that
        # buffer is empty, and uvicorn's flow control wakes this wait then (or when the
        # connection is lost) — no polling: a client that stops reading must not keep
        # the loop busy.
        if self.transport.get_write_buffer_size():
            low, high = self.transport.get_write_buffer_limits()
            self.transport.set_write_buffer_limits(high=0, low=0)
            try:
                await self.flow.drain()
            finally:
                if not self.transport.is_closing():
                    self.transport.set_write_buffer_limits(high=high, low=low)
        if self.disconnected or self.transport.is_closing():
            raise OSError("the client connection is closing")
        sock = self.transport.get_extra_info("socket")
        dst = os.dup(sock.fileno())  # the transport keeps its own fd (and its poll) untouched
        try:
            await splice_to(loop, message["file"], dst, count, message.get("offset"))
        finally:
            os.close(dst)
        self.expected_content_length -= count
        # uvicorn's own bookkeeping for the end of the body (keep-alive, next request).
        await super().send({"type": "http.response.body", "body": b"",
                            "more_body": bool(message.get("more_body", False))})


class ZeroCopyHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose requests on plain TCP connections offer
    ``http.response.zerocopysend`` (see the module doc)."""

    def on_message_begin(self) -> None:
        """uvicorn's, and a new request's header names start empty."""
        super().on_message_begin()
        self._raw_names: list[bytes] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        """uvicorn's (it lowercases ``name``), and ``name`` kept as the client wrote it."""
        self._raw_names.append(bytes(name))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        """uvicorn's header handling; then the new cycle becomes a :class:`ZeroCopyCycle`
        (same state, one more message type) and the scope offers the extension. The
        cycle's task has been created but has not run yet, so the app sees both."""
        cycle = self.cycle
        super().on_headers_complete()
        self.scope.setdefault("extensions", {})[RAW_HEADER_NAMES] = self._raw_names
        if self.cycle is cycle or type(self.cycle) is not RequestResponseCycle:
            return  # an upgrade (no new cycle) or an unknown uvicorn: leave it alone
        if self.transport.get_extra_info("sslcontext") is not None or self.transport.get_extra_info("socket") is None:
            return
        self.cycle.__class__ = ZeroCopyCycle
        self.scope.setdefault("extensions", {})[EXTENSION] = {}
