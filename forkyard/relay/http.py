"""The general relay: one HTTP request to an upstream and its answer, bodies streamed
both ways chunk by chunk through httpx/h11 (so Connect server-streaming works over
HTTP/1.1), with E2B's answers when the upstream fails and a Connect end-of-stream error
when it goes away mid-stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx

from forkyard.relay.errors import TooLarge, UpstreamCut, connect_failed, send_json, unreachable
from forkyard.relay.headers import HOP_OUT, target_path

log = logging.getLogger("forkyard.proxy")

#: Headers httpx adds to every request unless told otherwise.
HTTPX_DEFAULTS = ("accept", "accept-encoding", "user-agent")


class ConnectFrames:
    """Tracks Connect envelope boundaries (1 flag byte + 4-byte big-endian length +
    payload; connectrpc.com/docs/protocol "Streaming") in a relayed byte stream, so an
    end-of-stream message can be appended only between two messages."""

    def __init__(self):
        self._need = 5          # bytes until the current header/payload is complete
        self._header = b""
        self._in_header = True

    def feed(self, data: bytes) -> None:
        while data:
            take = min(self._need, len(data))
            if self._in_header:
                self._header += data[:take]
            self._need -= take
            data = data[take:]
            if self._need == 0:
                if self._in_header:
                    self._need = int.from_bytes(self._header[1:5], "big")
                    self._in_header = self._need == 0
                    self._header = b""
                    if self._in_header:
                        self._need = 5
                else:
                    self._in_header, self._need = True, 5

    @property
    def at_boundary(self) -> bool:
        return self._in_header and self._need == 5


def stream_cut_message(what: str, gone=None) -> str:
    """The ``unavailable`` message that ends a Connect stream whose upstream went away:
    "the connection to ``what`` ended before the stream completed", with the cause in
    brackets when ``gone()`` says the sandbox is gone (its text after "…was not found: ",
    e.g. "out of memory (limit 512 MiB)"). Never the proxy's "was not found" / "port is
    not open" phrases: as with E2B's proxy, the SDKs (e2b 2.63 ``envd/rpc.py``) then probe
    the sandbox and report it "killed or reached its end of life while the request was in
    flight" (issue 23 item 1)."""
    message = f"the connection to {what} ended before the stream completed"
    why = gone() if gone is not None else None
    if why is None:
        return message
    cause = why.split(": ", 1)[1] if ": " in why else "the sandbox is not running"
    if "was not found" in cause or "port is not open" in cause:
        cause = "the sandbox is not running"
    return f"{message} ({cause})"


def connect_end_error(code: str, message: str) -> bytes:
    """A Connect end-of-stream message (flag 0x02) carrying error ``code`` (a Connect
    code name such as ``"unavailable"``) and ``message``."""
    payload = json.dumps({"error": {"code": code, "message": message}}).encode()
    return b"\x02" + len(payload).to_bytes(4, "big") + payload


async def relay_http(client: httpx.AsyncClient, scope, receive, send, base: str, headers: list,
                     max_body_bytes: int, what: str, gone=None, sandbox_id: str | None = None,
                     closed=None, watch_disconnect: bool = False) -> None:
    """Stream one HTTP request to ``base`` + the request's path (``headers`` as given:
    the caller has filtered hop-by-hop ones) and stream the answer back — bodies in both
    directions chunk by chunk, so Connect server-streaming works over HTTP/1.1.

    A request without ``Content-Length`` and ``Transfer-Encoding`` has no body (RFC 9112
    §6.3) and goes out without one; a declared length goes out as declared (never
    re-chunked). A body over ``max_body_bytes`` gets 413; an upstream refusing the
    connection gets 502 "... port is not open" (E2B's wording), other failures 502
    naming ``what``. When the upstream goes away mid-response: a Connect stream gets an
    ``unavailable`` end-of-stream error (message from ``gone()`` — str when the sandbox
    is gone, None when it still runs — else a "connection lost" one); any other
    response is aborted (:class:`UpstreamCut`), so the client sees the truncation.
    ``closed()`` (optional) is True once the client's connections were closed (the
    sandbox is gone): a body that ends with its connection then did not end by itself.
    An upstream status outside 100 … 599 gets 502 (an ASGI server has no status line for
    it). ``watch_disconnect``: ``receive`` is the client's own (not a replay), so once the
    request body has been read a client that goes away mid-response ends the relay and
    closes the upstream connection at once (uvicorn drops writes to a gone client without
    an error, so otherwise a streaming answer — a code interpreter's cell, a command —
    would be relayed to nobody until it ends by itself).
    """
    url = base + target_path(scope)
    req_headers = {k.lower(): v for k, v in scope["headers"]}
    declared = req_headers.get(b"content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_body_bytes):
        if not declared.isdigit():
            return await send_json(send, 400, "invalid Content-Length")
        return await send_json(send, 413, f"request body over the {max_body_bytes} byte limit")
    has_body = declared is not None or b"transfer-encoding" in req_headers
    sent = 0
    body_read = not has_body

    async def body():
        nonlocal sent, body_read
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            if chunk:
                sent += len(chunk)
                if sent > max_body_bytes:
                    raise TooLarge()
                yield chunk
            if not msg.get("more_body"):
                body_read = True
                return

    if declared is not None:
        headers = [*headers, (b"content-length", declared)]
    req = client.build_request(scope["method"], url, headers=headers, content=body() if has_body else None)
    # httpx adds its defaults (Accept-Encoding: gzip, deflate, …) even when a client's
    # headers are emptied; forward only what the client sent, so envd never gzips a
    # body the client did not ask to be compressed.
    sent_names = {k.lower() if isinstance(k, bytes) else k.lower().encode() for k, _ in headers}
    for name in HTTPX_DEFAULTS:
        if name.encode() not in sent_names:
            req.headers.pop(name, None)
    try:
        resp = await client.send(req, stream=True)
    except TooLarge:
        return await send_json(send, 413, f"request body over the {max_body_bytes} byte limit")
    except httpx.ConnectError as e:
        return await connect_failed(send, what, e, refused=True, gone=gone, sandbox_id=sandbox_id, scope=scope,
                                    port=httpx.URL(base).port)
    except httpx.HTTPError as e:
        return await unreachable(send, scope, what, e)
    if resp.status_code >= 600:
        await resp.aclose()
        return await send_json(send, 502, f"{what} answered status {resp.status_code}, not an HTTP status code")
    ctype = resp.headers.get("content-type", "")
    frames = ConnectFrames() if ctype.startswith("application/connect+") else None
    try:
        out_headers = [(k.encode("latin-1"), v.encode("latin-1"))
                       for k, v in resp.headers.multi_items() if k.lower() not in HOP_OUT]
        length = resp.headers.get("content-length")
        chunked = "transfer-encoding" in resp.headers  # (it wins over a Content-Length, RFC 9112 §6.3)
        # Raw (undecoded) bytes are relayed, so the length stays exact. Not on a 204/304:
        # no body follows, but an ASGI server would wait for that many bytes.
        if length is not None and not chunked and resp.status_code not in (204, 304):
            out_headers.append((b"content-length", length.encode()))
        await send({"type": "http.response.start", "status": resp.status_code, "headers": out_headers})

        async def pump() -> None:
            async for chunk in resp.aiter_raw():
                if frames is not None:
                    frames.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        if not (watch_disconnect and body_read):
            await pump()
        elif not await _pump_unless_client_leaves(pump(), receive):
            log.info("the client of %s went away mid-response; closing the upstream connection", what)
            return
        if (closed is not None and closed() and length is None and not chunked
                and scope["method"] != "HEAD" and resp.status_code not in (204, 304)):
            raise OSError("the connection was closed under a body that ends with it")
        await send({"type": "http.response.body", "body": b""})
    except (httpx.HTTPError, OSError) as e:
        # The sandbox went away mid-stream (killed, paused, forked: gVisor resets
        # connections on checkpoint).
        log.info("response from %s ended early: %r", what, e)
        if frames is None or not frames.at_boundary or "content-length" in resp.headers:
            raise UpstreamCut(f"{what} ended the response early: {e!r}") from None  # the connection closes
        await send({"type": "http.response.body",
                    "body": connect_end_error("unavailable", stream_cut_message(what, gone))})
    finally:
        await resp.aclose()


async def _pump_unless_client_leaves(pump, receive) -> bool:
    """Run ``pump`` until it ends (True; its exception is raised) or ``receive`` says
    ``http.disconnect`` first (``pump`` is cancelled: False)."""
    async def client_left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping, watching = asyncio.ensure_future(pump), asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (pumping, watching):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if pumping.cancelled():
        return False
    pumping.result()
    return True
