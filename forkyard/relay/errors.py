"""What the relays answer when the upstream fails, and how a response that ended early
is aborted (:class:`UpstreamCut`).

Wording of E2B's proxy where the SDKs read it (e2b 2.63 ``e2b/exceptions.py``): a port
that refuses the connection is 502 "The sandbox is running but port is not open".
"""

from __future__ import annotations

import asyncio
import json
import logging

log = logging.getLogger("forkyard.proxy")


class UpstreamCut(Exception):
    """A relayed response ended early (the sandbox was killed, paused or forked
    mid-transfer) where no clean end can be sent. Raised after the response started so
    the server aborts the connection: the client sees fewer bytes than announced (or an
    unterminated chunked body) and reports an incomplete body, never a shorter body
    passed off as complete."""


class TooLarge(Exception):
    """A request body grew past the relay's bound while it was streamed (413)."""


class _QuietCuts(logging.Filter):
    """Drop uvicorn's "Exception in ASGI application" traceback for :class:`UpstreamCut`
    (an expected event, logged by the relay as one line) and for the CancelledError of
    requests uvicorn cancels when its graceful shutdown ends (a relayed stream that was
    still open: it logs that as "Cancel N running task(s)")."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, (UpstreamCut, asyncio.CancelledError))


logging.getLogger("uvicorn.error").addFilter(_QuietCuts())


async def send_json(send, status: int, message: str, **extra) -> None:
    """Answer an ASGI http request with ``{"code": status, "message": message, **extra}``."""
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def connect_failed(send, what: str, e: BaseException, refused: bool, gone=None,
                         sandbox_id: str | None = None) -> None:
    """The 502 of both relays when connecting to the upstream failed: the caller's own
    "not found" message when ``gone()`` (a str) says the target is gone, E2B's "The
    sandbox is running but port is not open" when the port ``refused``, else "``what``
    is not reachable". The exception (it names the sandbox's internal address) goes to
    the log only, never into the body (issue 23)."""
    if sandbox_id is not None and gone is not None and (msg := gone()) is not None:
        return await send_json(send, 502, msg, sandboxId=sandbox_id)
    log.info("connecting to %s failed: %r", what, e)
    if refused:
        extra = {"sandboxId": sandbox_id} if sandbox_id else {}
        return await send_json(send, 502, "The sandbox is running but port is not open", **extra)
    await send_json(send, 502, f"{what} is not reachable")
