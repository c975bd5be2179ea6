"""A node's heartbeats over one WebSocket to the scheduler (issue 26: heartbeat CPU).

Every node sends a heartbeat every second; as an HTTP request each costs a scheduler
replica 0.3-0.43 ms of CPU in the web server alone (a bare uvicorn answering a constant
to 300 nodes, bench_control_plane ``--bare-http``: 9-13 % of a core before any heartbeat
work). Over a WebSocket the same body
costs a message: ``bench/bench_control_plane.py --beat-stream`` gives the figures
(docs/architecture.md). ``FORKYARD_BEAT_STREAM=on`` (default off: HTTP, as before)
makes the node open ``ws(s)://<replica>/v1/nodes/{id}/beats`` with the same credential
headers as its HTTP calls (its own key and URL, checked by the scheduler before the
upgrade), send each heartbeat body as one text message and read the answer — the
heartbeat route's JSON answer, or ``{"code", "message"}`` for what the route would have
answered with that status.

When the stream cannot be opened or the beat cannot be sent on it (a replica gone, a
connection the scheduler closed), the stream is aborted and that heartbeat goes over
HTTP (with the client's failover) in the time left; a beat sent whose answer does not
come fails as an HTTP call past its timeout would (sent once: the scheduler may be
working on it). Either way the stream is tried again after :data:`FAILED_S` — after
:data:`RETRY_S` when a replica refused the upgrade (any HTTP status: an older scheduler
without the route answers 403). A redirect is refused, not followed: the upgrade carries
the node's key, which must reach no other host (HTTP calls do not follow redirects).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from forkyard.cluster.schedclient import SchedulerClient

log = logging.getLogger("forkyard.cluster")

#: After a replica refused the upgrade, heartbeats go over HTTP this long (s).
RETRY_S = 60.0
#: After the stream failed otherwise, heartbeats go over HTTP this long (s).
FAILED_S = 10.0
#: Longest a heartbeat waits on the stream (connect, send, answer; s), at most half the
#: call's own bound: the rest is left for HTTP.
STREAM_S = 1.0
#: Largest answer read (bytes): the scheduler's bound on a body (``scheduler.MAX_BODY``,
#: not imported: the node does not load the scheduler's app).
MAX_ANSWER = 8 << 20


def stream_path(node_id: str) -> str:
    """The heartbeat stream route of ``node_id``."""
    return f"/v1/nodes/{node_id}/beats"


class BeatRefused(RuntimeError):
    """The scheduler answered a heartbeat on the stream with an error ``status`` (4xx/5xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"scheduler answered {status} to a heartbeat: {message[:300]}")
        self.status = status


class _NoRedirect(connect):
    """websockets' ``connect`` that follows no redirect (module docstring)."""

    def process_redirect(self, exc: Exception) -> Exception:
        return exc


class StreamLost(RuntimeError):
    """A heartbeat was sent on the stream and no answer came (the stream is aborted)."""


class BeatStream:
    """One node's heartbeat stream to the replica ``client`` used last.

    Args:
        client: the node's scheduler client (its URLs, credential headers and the
            replica that answered last).
        node_id: the node's id (the route).
    """

    def __init__(self, client: SchedulerClient, node_id: str):
        self.client, self.node_id = client, node_id
        self._ws: ClientConnection | None = None
        self._ws_url = ""
        self._refused_until = 0.0

    @property
    def open(self) -> bool:
        """Whether a stream is open now."""
        return self._ws is not None

    async def call(self, body: dict, timeout_s: float) -> dict | None:
        """Send heartbeat ``body`` on the stream (opened first when none is, within
        ``min(STREAM_S, timeout_s / 2)``) and return the scheduler's answer, read within
        ``timeout_s`` of the call. None when the beat was not sent (no stream could be
        opened, or sending failed): the caller sends it over HTTP. A beat sent is sent
        once: when its answer does not come (slow, connection lost) the stream is aborted
        and the call fails, as an HTTP call past its timeout would — the scheduler may
        still be working on it. Any exit without an answer read (a cancel included)
        aborts the stream, so no answer is ever read for a later beat.

        Raises:
            BeatRefused: the scheduler answered the heartbeat with an error status.
            StreamLost: the beat was sent and no answer came.
        """
        if self._ws is None and time.monotonic() < self._refused_until:
            return None
        t0 = time.monotonic()
        sent = False
        try:
            async with asyncio.timeout(min(STREAM_S, timeout_s / 2)):
                if self._ws is None:
                    await self._open()
                await self._ws.send(json.dumps(body, separators=(",", ":")))
            sent = True
            async with asyncio.timeout(max(0.0, timeout_s - (time.monotonic() - t0))):
                out = json.loads(await self._ws.recv())
            if not isinstance(out, dict):
                raise ValueError(f"an answer that is no JSON object: {type(out).__name__}")
        except BaseException as e:  # any failure or cancel: the stream goes (module docstring)
            self.abort()
            if not isinstance(e, Exception):
                raise
            refused = isinstance(e, InvalidStatus)
            self._refused_until = time.monotonic() + (RETRY_S if refused else FAILED_S)
            log.warning("heartbeat stream to %s failed (%s); heartbeats go over HTTP for %.0f s",
                        self._ws_url or self.client.url,
                        f"HTTP {e.response.status_code}" if refused else f"{type(e).__name__}: {e}",
                        RETRY_S if refused else FAILED_S)
            if sent:
                raise StreamLost(f"no answer to a heartbeat on the stream to {self._ws_url}: "
                                 f"{type(e).__name__}: {e}") from e
            return None
        if "code" in out and "status" not in out:
            raise BeatRefused(int(out.get("code") or 500), str(out.get("message", "")))
        return out

    async def beat(self, body: dict, timeout_s: float, post) -> tuple[dict, bool]:
        """Heartbeat ``body`` on the stream (:meth:`call`), or — when there is none now —
        through ``post(left_s)`` (an awaitable factory: the node's HTTP heartbeat call,
        given what is left of ``timeout_s``, at least half of it), so the whole beat takes
        about ``timeout_s`` at most. Returns ``(answer, whether it came over the stream)``.

        Raises:
            BeatRefused: the scheduler answered on the stream with an error status.
            StreamLost: the beat was sent on the stream and no answer came.
            whatever ``post()`` raises.
        """
        t0 = time.monotonic()
        out = await self.call(body, timeout_s)
        if out is not None:
            return out, True
        return await post(max(timeout_s / 2, timeout_s - (time.monotonic() - t0))), False

    async def _open(self) -> None:
        url = "ws" + self.client.url.removeprefix("http") + stream_path(self.node_id)
        self._ws_url = url
        # wss: the same CA trust as the node's HTTP calls (httpx's default context, certifi)
        tls = {"ssl": httpx.create_ssl_context()} if url.startswith("wss:") else {}
        self._ws = await _NoRedirect(url, additional_headers=self.client.headers, compression=None,
                                     max_size=MAX_ANSWER, open_timeout=None, ping_interval=None, proxy=None, **tls)

    def abort(self) -> None:
        """Drop the stream at once (no closing handshake)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            ws.transport.abort()

    async def close(self) -> None:
        """Close the stream (if open); the next :meth:`call` opens one."""
        ws, self._ws = self._ws, None
        if ws is not None:
            try:
                await asyncio.wait_for(ws.close(), 1.0)
            except Exception:  # noqa: BLE001 — it is gone either way
                pass
