"""What the relays answer when the upstream fails, and how a response that ended early
is aborted (:class:`UpstreamCut`).

Wording of E2B's proxy where the SDKs read it (e2b 2.63 ``e2b/exceptions.py``): a port
that refuses the connection is 502 "The sandbox is running but port is not open"
(``{"sandboxId", "port"}`` beside it), a sandbox that is not running 502 "The sandbox
was not found" (forkyard adds why, when it knows: paused, or the cause of a death).
A browser — a User-Agent that names one, the rule of E2B's proxy
(``packages/shared/pkg/proxy/template``) — gets the same as a small HTML page.
"""

from __future__ import annotations

import asyncio
import html
import json
import logging
import re

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


#: User-Agents answered with an HTML page (E2B's proxy: the same words, case-insensitive).
BROWSER = re.compile(rb"mozilla|chrome|safari|firefox|edge|opera|msie", re.IGNORECASE)
#: Page titles by the message they show.
_TITLES = {"was not found": "Sandbox Not Found", "port is not open": "Closed Port Error"}


def is_browser(scope) -> bool:
    """Whether the request's User-Agent names a browser (:data:`BROWSER`)."""
    ua = next((v for k, v in scope.get("headers", ()) if k.lower() == b"user-agent"), b"")
    return bool(BROWSER.search(ua))


def error_page(status: int, message: str, sandbox_id: str | None = None, port: int | None = None) -> bytes:
    """A minimal HTML page saying ``message`` (escaped) about ``sandbox_id``/``port``."""
    title = next((t for phrase, t in _TITLES.items() if phrase in message), f"Error {status}")
    facts = "".join(f"<dt>{name}</dt><dd><code>{html.escape(str(value))}</code></dd>"
                    for name, value in (("Sandbox", sandbox_id), ("Port", port)) if value is not None)
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{title}</title>"
            f"<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"></head>"
            f"<body style=\"font-family:sans-serif;max-width:40rem;margin:3rem auto;padding:0 1rem\">"
            f"<h1>{title}</h1><p>{html.escape(message)}</p><dl>{facts}</dl></body></html>").encode()


async def send_error(send, scope, status: int, message: str, **extra) -> None:
    """:func:`send_json`, or :func:`error_page` when the client is a browser
    (:func:`is_browser`; ``extra``'s ``sandboxId`` and ``port`` shown)."""
    if scope is None or not is_browser(scope):
        return await send_json(send, status, message, **extra)
    body = error_page(status, message, extra.get("sandboxId"), extra.get("port"))
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, message: str, **extra) -> None:
    """Answer an ASGI http request with ``{"code": status, "message": message, **extra}``."""
    body = json.dumps({"code": status, "message": message, **extra}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def connect_failed(send, what: str, e: BaseException, refused: bool, gone=None,
                         sandbox_id: str | None = None, scope=None, port: int | None = None) -> None:
    """The 502 of both relays when connecting to the upstream failed: the caller's own
    "not found" message when ``gone()`` (a str) says the target is gone, E2B's "The
    sandbox is running but port is not open" when the port ``refused``, else "``what``
    is not reachable". The exception (it names the sandbox's internal address) goes to
    the log only, never into the body (issue 23). A browser (``scope``) gets a page
    (:func:`send_error`); ``port`` is the sandbox port asked for."""
    if sandbox_id is not None and gone is not None and (msg := gone()) is not None:
        return await send_error(send, scope, 502, msg, sandboxId=sandbox_id)
    log.info("connecting to %s failed: %r", what, e)
    if refused:
        extra = {"sandboxId": sandbox_id, "port": port} if sandbox_id else {}
        return await send_error(send, scope, 502, "The sandbox is running but port is not open",
                                **{k: v for k, v in extra.items() if v is not None})
    await send_error(send, scope, 502, f"{what} is not reachable")


async def unreachable(send, scope, what: str, e: BaseException) -> None:
    """502 "``what`` is not reachable (ExceptionType)" for a failure other than a refused
    connect; the exception's text (addresses) goes to the log only."""
    log.info("relaying to %s failed: %r", what, e)
    await send_error(send, scope, 502, f"{what} is not reachable ({type(e).__name__})")
