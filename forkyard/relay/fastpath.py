"""The relays' fast path: requests without a body, answered socket to socket.

A GET (HEAD, DELETE, OPTIONS … — any request with neither ``Content-Length`` nor
``Transfer-Encoding``, RFC 9112 §6.3) to a sandbox port goes out on a plain
non-blocking socket of :class:`FastConnections` (one per sandbox, kept alive between
requests when the sandbox's server allows it). h11 writes the request and parses the
response head; then:

* a body with a ``Content-Length`` of at least :data:`SPLICE_MIN_BYTES` goes from the
  upstream socket to the client socket with splice(2), through the server's
  ``http.response.zerocopysend`` (:mod:`forkyard.relay.zerocopy`): no byte passes through
  Python (issue 9 item 8, measured by bench/bench_proxy.py);
* any other body (chunked, ended by close, small, or a server without the extension:
  the TLS listener) is decoded by h11 and relayed as ASGI body messages.

Requests with a body, WebSocket upgrades and Connect streams keep the general relay
(:func:`forkyard.relay.http.relay_http`). A response that ends early is aborted
(:class:`~forkyard.relay.errors.UpstreamCut`), never passed off as complete.
"""

from __future__ import annotations

import asyncio
import re
import socket
import weakref

import h11

from forkyard.relay import zerocopy
from forkyard.relay.errors import UpstreamCut, connect_failed, send_error, unreachable
from forkyard.relay.headers import HOP_OUT_BYTES, target_path

#: Bodies shorter than this (bytes) are relayed through Python: a splice costs a pipe
#: and a few syscalls, more than copying a small body.
SPLICE_MIN_BYTES = 64 * 1024
#: Most bytes of a response's status line and headers (bytes); more is a 502.
MAX_HEAD_BYTES = 64 * 1024
#: One socket read (bytes).
READ_BYTES = 256 * 1024
#: Connect timeout (s), as the general relay's.
CONNECT_TIMEOUT_S = 5.0
#: Idle kept-alive connections per sandbox.
MAX_IDLE = 32


#: Methods sent again on a new connection when a kept-alive one turns out closed before
#: any answer (RFC 9110 §9.2.2: idempotent).
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"TRACE", b"PUT", b"DELETE"})
#: The blank line that ends a response head (RFC 9112 §2.2: a bare LF is accepted).
_HEAD_END = re.compile(rb"\n\r?\n")


class BadResponse(OSError):
    """The upstream's response head broke HTTP/1.1 (the message says how)."""


class NotEligible(Exception):
    """The request cannot take the fast path (h11 refuses to write it as it is); the
    caller relays it the general way. Raised before anything is sent."""


class RefusedError(OSError):
    """The sandbox port refused the connection (nothing listens there)."""


class StaleError(OSError):
    """A kept-alive connection was closed by the server before answering anything."""


class FastConnections:
    """Plain sockets to one sandbox: idle kept-alive ones for reuse, and every one it
    opened (weakly), so :meth:`close` ends them all — also those in use, whose relay
    then fails and aborts its response. After :meth:`close` a connect raises
    ``ConnectionError``."""

    def __init__(self):
        self._idle: dict[tuple[str, int], list[socket.socket]] = {}  # by (host, port)
        self._all: weakref.WeakSet = weakref.WeakSet()
        self.closed = False

    async def connect(self, host: str, port: int) -> socket.socket:
        """A new non-blocking TCP socket to ``host:port`` (IP literal). Raises
        :class:`RefusedError` when refused, ``TimeoutError`` after
        :data:`CONNECT_TIMEOUT_S`, ``OSError`` for other failures."""
        if self.closed:
            raise ConnectionError("the sandbox's connections were closed: it is gone")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        self._all.add(sock)
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                await asyncio.get_running_loop().sock_connect(sock, (host, port))
        except ConnectionRefusedError as e:
            sock.close()
            raise RefusedError(str(e)) from None
        except BaseException:
            sock.close()
            raise
        if self.closed:
            sock.close()
            raise ConnectionError("the sandbox's connections were closed: it is gone")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def take(self, host: str, port: int) -> socket.socket | None:
        """An idle kept-alive socket to ``host:port`` still fit for a request, or None.
        Only sockets to that port (one sandbox has many ports: a socket to another one
        must never serve this request). One that is readable while idle is closed
        instead: the server closed it (a bodyless POST sent there would fail, and is not
        sent again), or it holds bytes no request asked for — a body longer than its
        ``Content-Length``, an answer sent ahead — which would be read as the next
        request's response (httpcore drops such connections the same way:
        ``AsyncHTTP11Connection.has_expired``)."""
        idle = self._idle.get((host, port))
        while idle:
            sock = idle.pop()
            if sock.fileno() >= 0 and _quiet(sock):
                return sock
            sock.close()
        return None

    def put(self, sock: socket.socket, host: str, port: int) -> None:
        """Keep ``sock`` (connected to ``host:port``) for the next request to there
        (closed when :data:`MAX_IDLE` are kept already, or after :meth:`close`)."""
        if self.closed or sum(map(len, self._idle.values())) >= MAX_IDLE:
            sock.close()
        else:
            self._idle.setdefault((host, port), []).append(sock)

    def close(self) -> None:
        """End every socket this pool opened: idle ones are closed; ones in use are shut
        down (their next or pending read sees the end, so their relay aborts its response
        and closes them — closing an fd the event loop waits on would leave that wait
        hanging)."""
        self.closed = True
        idle = [sock for socks in self._idle.values() for sock in socks]
        self._idle = {}
        for sock in list(self._all):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected (yet, or any more)
        for sock in idle:
            sock.close()


def _quiet(sock: socket.socket) -> bool:
    """True when the connected non-blocking ``sock`` has nothing to read: no byte and
    no end (looked at with MSG_PEEK, nothing is consumed)."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # b"" (closed) or stray bytes
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def has_no_body(scope) -> bool:
    """True for a plain HTTP request that carries no body (RFC 9112 §6.3)."""
    for k, _ in scope["headers"]:
        k = k.lower()
        if k in (b"content-length", b"transfer-encoding", b"upgrade"):
            return False
    return True


def _keeps_alive(resp: h11.Response) -> bool:
    """True when the server keeps the connection open after this response (RFC 9112
    §9.3: HTTP/1.1 without ``Connection: close``)."""
    if resp.http_version != b"1.1":
        return False
    return not any(k == b"connection" and b"close" in v.lower() for k, v in resp.headers)


def _request(method: bytes, target: bytes, headers: list) -> tuple[h11.Connection, bytes]:
    """A new h11 client state and the bytes of the request (head only: no body)."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD_BYTES)
    data = conn.send(h11.Request(method=method, target=target, headers=headers))
    return conn, data + (conn.send(h11.EndOfMessage()) or b"")


async def _exchange(loop, sock: socket.socket, conn: h11.Connection,
                    request: bytes) -> tuple[h11.Response, bytes]:
    """Send ``request`` on ``sock``; read until the final response head is complete
    (1xx heads are skipped: ASGI cannot relay them). Returns (the response, body bytes
    already read). Raises :class:`StaleError` when the connection ended before any
    byte, ``OSError`` / ``h11.RemoteProtocolError`` otherwise."""
    await loop.sock_sendall(sock, request)
    buf = b""
    got_any = False
    while True:
        m = _HEAD_END.search(buf)
        if m is None:
            if len(buf) > MAX_HEAD_BYTES:
                raise h11.RemoteProtocolError("response head over 64 KiB")
            data = await _read_head(loop, sock)
            if not data:
                if not got_any:
                    raise StaleError("the connection closed before an answer")
                raise h11.RemoteProtocolError("the connection closed in the response head")
            got_any = True
            buf += data
            continue
        conn.receive_data(buf[:m.end()])
        buf = buf[m.end():]
        event = conn.next_event()
        if isinstance(event, h11.InformationalResponse):
            continue
        if not isinstance(event, h11.Response):
            raise h11.RemoteProtocolError(f"unexpected response head ({type(event).__name__})")
        if event.status_code >= 600:  # h11 takes any 3 digits; ASGI servers only know 1xx … 5xx
            raise h11.RemoteProtocolError(f"response status {event.status_code} is not an HTTP status code")
        return event, buf


async def _read_head(loop, sock: socket.socket) -> bytes:
    """The next bytes of a response head: what the socket holds up to the end of the
    head when that is in view (looked at with MSG_PEEK, so the body stays in the socket
    for splice), else all it holds (at most :data:`MAX_HEAD_BYTES` + 1). ``b""`` at
    the end."""
    while True:
        try:
            peek = sock.recv(MAX_HEAD_BYTES + 1, socket.MSG_PEEK)
        except BlockingIOError:
            await zerocopy.wait_readable(loop, sock.fileno())
            continue
        if not peek:
            return b""
        # (A head end split over two reads is not seen here: then all is read, and the
        # caller finds the end in what it joined — correct, only without the splice.)
        m = _HEAD_END.search(peek)
        take = m.end() if m is not None else len(peek)
        return sock.recv(take)


async def relay(conns: FastConnections, scope, send, host: str, port: int, headers: list,
                target: str, out_filter, what: str) -> None:
    """Relay one bodyless request (see the module doc). ``headers`` are the request
    headers to send (bytes pairs, already filtered); ``out_filter`` the response header
    names (lowercase bytes) not to pass back. Raises :class:`RefusedError` /
    ``TimeoutError`` / ``OSError`` before anything was sent to the client (the caller
    answers 502), :class:`~forkyard.relay.errors.UpstreamCut` after, :class:`NotEligible`
    when the request must take the general relay."""
    loop = asyncio.get_running_loop()
    method = scope["method"].encode("latin-1")
    if method == b"CONNECT":
        # A 2xx answer switches the connection to a tunnel (h11 then only says PAUSED):
        # not a response this relay can frame.
        raise NotEligible("CONNECT")
    if not any(k.lower() == b"host" for k, _ in headers):
        headers = [(b"Host", f"{host}:{port}".encode()), *headers]
    try:
        conn, request = _request(method, target.encode("latin-1"), headers)
    except h11.LocalProtocolError as e:
        raise NotEligible(str(e)) from None
    sock = conns.take(host, port)
    reused = sock is not None
    if sock is None:
        sock = await conns.connect(host, port)
    try:
        try:
            resp, rest = await _exchange(loop, sock, conn, request)
        except (StaleError, ConnectionResetError, BrokenPipeError):
            if not reused or method not in _IDEMPOTENT:
                raise
            sock.close()  # the server closed an idle connection: once more on a new one
            sock = await conns.connect(host, port)
            conn, request = _request(method, target.encode("latin-1"), headers)
            resp, rest = await _exchange(loop, sock, conn, request)
    except h11.RemoteProtocolError as e:
        sock.close()
        raise BadResponse(f"bad response from {what}: {e}") from None
    except BaseException:
        sock.close()
        raise
    out = [(k, v) for k, v in resp.headers if k not in out_filter]
    length = next((int(v) for k, v in resp.headers if k == b"content-length"), None)
    chunked = any(k == b"transfer-encoding" for k, _ in resp.headers)
    bodyless = method == b"HEAD" or resp.status_code in (204, 304)
    if length is not None and not chunked and resp.status_code not in (204, 304):
        # (A 304 may carry its representation's length, RFC 9110 §8.6; an ASGI server
        # would wait for that many body bytes: only a HEAD answer keeps it.)
        out.append((b"content-length", str(length).encode()))
    zero_copy = (zerocopy.EXTENSION in scope.get("extensions", {}) and not bodyless and not chunked
                 and length is not None and length - len(rest) >= SPLICE_MIN_BYTES)
    reusable = False
    try:
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out})
        if zero_copy:
            if rest:
                await send({"type": "http.response.body", "body": rest, "more_body": True})
            try:
                await send({"type": zerocopy.EXTENSION, "file": sock, "count": length - len(rest), "more_body": False})
            except zerocopy.SourceEnded as e:
                raise UpstreamCut(f"{what} ended the response early: {e}") from None
            except OSError as e:
                raise UpstreamCut(f"the client of {what} went away: {e!r}") from None
            reusable = _keeps_alive(resp)
        else:
            reusable = await _relay_decoded(loop, sock, conn, rest, send, what, conns)
    finally:
        if reusable:
            conns.put(sock, host, port)
        else:
            sock.close()


async def _relay_decoded(loop, sock: socket.socket, conn: h11.Connection, rest: bytes, send, what: str,
                         conns: FastConnections) -> bool:
    """Relay the body h11 decodes (chunked, close-delimited, small) as ASGI messages.
    Returns True when the connection may be reused. Raises UpstreamCut when the body
    ends early — also a close-delimited body whose end came from ``conns`` being closed
    (the sandbox was killed or paused: that end is not the server's)."""
    if rest:
        conn.receive_data(rest)  # (b"" would tell h11 the connection closed)
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise UpstreamCut(f"{what} ended the response early: {e}") from None
        if event is h11.NEED_DATA:
            try:
                data = await loop.sock_recv(sock, READ_BYTES)
            except OSError as e:
                raise UpstreamCut(f"{what} ended the response early: {e!r}") from None
            if not data and conns.closed:
                raise UpstreamCut(f"{what} went away during the response")
            conn.receive_data(data)  # b"" = the server closed: h11 decides if that ends the body
            continue
        if isinstance(event, h11.Data):
            await send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
        elif isinstance(event, h11.EndOfMessage):
            await send({"type": "http.response.body", "body": b""})
            return conn.our_state is h11.DONE and conn.their_state is h11.DONE and not conn.trailing_data[0]
        elif isinstance(event, h11.ConnectionClosed):
            raise UpstreamCut(f"{what} closed the connection in the response")
        else:  # (PAUSED: a protocol switch; CONNECT and Upgrade never come here)
            raise UpstreamCut(f"{what} answered with {event!r}, which cannot be relayed")


async def relay_bodyless(fast: FastConnections, scope, send, host: str, port: int, headers: list,
                         what: str, gone=None, sandbox_id: str | None = None) -> bool:
    """Relay a request without a body (:func:`has_no_body`) on the fast path to
    ``host:port`` (``headers`` as given: the caller has filtered hop-by-hop ones).
    Returns False, having sent nothing, when the request must take
    :func:`forkyard.relay.http.relay_http` instead. Answers like the general relay: a
    refused connection is 502 "The sandbox is running but port is not open" (or
    ``gone()``'s message when the sandbox is gone), other failures before the answer 502
    naming ``what``; a response that ends early is aborted (:class:`UpstreamCut`)."""
    try:
        await relay(fast, scope, send, host, port, headers, target_path(scope), HOP_OUT_BYTES, what)
    except NotEligible:
        return False
    except (RefusedError, ConnectionError) as e:
        await connect_failed(send, what, e, refused=isinstance(e, RefusedError), gone=gone,
                             sandbox_id=sandbox_id, scope=scope, port=port)
    except BadResponse as e:  # what the sandbox's server sent wrong: nothing of ours in it
        await send_error(send, scope, 502, str(e))
    except (TimeoutError, OSError) as e:
        await unreachable(send, scope, what, e)
    return True
