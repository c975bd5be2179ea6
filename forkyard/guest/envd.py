"""The host side of a sandbox's envd: every call the node makes to it, at the sandbox's
outer address (never through the sandbox proxy).

Protocol source: E2B envd. Plain HTTP: ``GET /health`` (204 when ready), ``POST /init``
(JSON ``envVars``, ``accessToken``, ``defaultUser``, ``defaultWorkdir``, ``timestamp``;
header ``X-Access-Token`` proves the token envd already holds), ``GET /metrics``,
``POST /files`` (octet-stream). Connect RPC for ``process.Process/Start`` with the JSON
codec (``application/connect+json``; connectrpc.com/docs/protocol "Streaming": each
message is enveloped as 1 flag byte, a 4-byte big-endian length and the payload; flag
``0x02`` marks the end-of-stream message). The user of a request is chosen the way the
E2B SDK does it: ``Authorization: Basic base64("<user>:")``.

Callers: the orchestrator (health, ``/init`` on every start and hand-out, ``/metrics``)
and template builds (commands, uploads, the final ``/init``).

Why the Connect envelope is framed here and not by ``connectrpc`` (which the e2b SDK
brings): that client runs on pyqwest, a second HTTP stack with its own tokio threads
that abort CPython 3.11 at interpreter exit (curioswitch/pyqwest#164; see
``forkyard.cli.main.main``). The node server stays on httpx, and one message loop here
bounds what a build step may send (:data:`MAX_MESSAGE_BYTES`, :data:`MAX_LINE_BYTES`).
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
import time
from collections.abc import AsyncIterable, Callable
from datetime import UTC, datetime

import httpx

from forkyard.config import ENVD_PORT

#: ``(stream, line)``: ``stream`` is ``"stdout"`` or ``"stderr"``.
LineSink = Callable[[str, str], None]


class EnvdError(Exception):
    """envd answered with an error or the connection failed."""


def envd_url(host: str, port: int = ENVD_PORT) -> str:
    """Base URL of envd for a slot's outer address ``host``."""
    return f"http://{host}:{port}"


# --------------------------------------------------------------------------- readiness

#: Poll interval (s) while a just-started envd is expected any moment, for the first
#: :data:`FAST_POLL_S`; then :data:`POLL_S`. A restored envd answers ~5-15 ms after
#: ``runsc restore`` returns (measured), so polling every 10 ms from the start cost
#: ~4 ms per resume on average; the fast phase is short so that many starts at once
#: (a fork of 100) do not spend the host's CPU on refused connects.
FAST_POLL_INTERVAL_S = 0.002
FAST_POLL_S = 0.1
POLL_S = 0.01


def _poll_interval(started: float) -> float:
    return FAST_POLL_INTERVAL_S if time.monotonic() - started < FAST_POLL_S else POLL_S


async def wait_healthy(client: httpx.AsyncClient, host: str, timeout_s: float) -> None:
    """Poll ``/health`` until it answers 2xx: every 2 ms for the first 100 ms, then
    every 10 ms.

    Raises:
        TimeoutError: envd did not answer within ``timeout_s`` seconds; the message
            carries the last connection error.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last: Exception | str = "no answer"
    while time.monotonic() < deadline:
        try:
            r = await client.get(f"{envd_url(host)}/health", timeout=1.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = e
        await asyncio.sleep(_poll_interval(started))
    raise TimeoutError(f"envd did not become healthy in {timeout_s:.0f} s: {last!r}")


# --------------------------------------------------------------------------- plain HTTP


async def init(
    client: httpx.AsyncClient,
    host: str,
    *,
    env_vars: dict[str, str] | None = None,
    access_token: str | None = None,
    current_token: str | None = None,
    default_user: str | None = None,
    default_workdir: str | None = None,
    wait_s: float = 0.0,
    timeout_s: float = 5.0,
    port: int = ENVD_PORT,
) -> None:
    """Send ``POST /init``: merge ``env_vars`` into the sandbox's environment, set the
    access token later requests must carry (``access_token``), and the user and working
    directory of requests that name none (``default_user``, ``default_workdir``); each
    left out of the body when None.

    ``current_token`` is the token envd already holds (a restored checkpoint keeps its
    source's token; envd only accepts a new one from a caller that knows the old one).
    With ``wait_s`` > 0 a refused connection (envd not listening yet) is retried (as
    :func:`wait_healthy` polls) for up to ``wait_s`` seconds, so a just-started sandbox
    needs no separate ``/health`` poll; the request is never sent twice once a
    connection was made. ``timeout_s``: of the request itself.

    Raises:
        EnvdError: connection failure or non-2xx answer.
        TimeoutError: envd refused connections for ``wait_s`` seconds.
    """
    body: dict = {"timestamp": datetime.now(UTC).isoformat()}
    if env_vars is not None:
        body["envVars"] = env_vars
    if default_user:
        body["defaultUser"] = default_user
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    if access_token:
        body["accessToken"] = access_token
    headers = {"X-Access-Token": current_token} if current_token else {}
    started = time.monotonic()
    deadline = started + wait_s
    while True:
        try:
            r = await client.post(f"{envd_url(host, port)}/init", json=body, headers=headers, timeout=timeout_s)
            break
        except httpx.ConnectError as e:
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    raise TimeoutError(f"envd did not accept connections in {wait_s:.0f} s: {e!r}") from e
                raise EnvdError(f"envd /init failed: {e!r}") from e
            await asyncio.sleep(_poll_interval(started))
        except httpx.HTTPError as e:
            raise EnvdError(f"envd /init failed: {e!r}") from e
    if r.status_code >= 300:
        raise EnvdError(f"envd /init failed: HTTP {r.status_code} {r.text[:200]}")


async def get_json(client: httpx.AsyncClient, host: str, path: str, access_token: str | None):
    """GET ``path`` from envd and return the decoded JSON body.

    Raises:
        EnvdError: connection failure, non-2xx answer or a body that is not JSON.
    """
    headers = {"X-Access-Token": access_token} if access_token else {}
    try:
        r = await client.get(f"{envd_url(host)}{path}", headers=headers, timeout=5.0)
    except httpx.HTTPError as e:
        raise EnvdError(f"GET {path}: {e!r}") from e
    if r.status_code >= 300:
        raise EnvdError(f"GET {path}: HTTP {r.status_code} {r.text[:200]}")
    try:
        return r.json()
    except ValueError as e:
        raise EnvdError(f"GET {path}: the answer is not JSON: {e}") from e


async def upload(client: httpx.AsyncClient, host: str, path: str, data: bytes | AsyncIterable[bytes],
                 user: str = "root", port: int = ENVD_PORT) -> None:
    """Write ``data`` (bytes, or chunks streamed as they come) to ``path`` inside the
    sandbox (envd ``POST /files``, octet-stream), owned by ``user``.

    Raises:
        EnvdError: envd refused or the connection failed.
    """
    try:
        r = await client.post(f"{envd_url(host, port)}/files", params={"path": path, "username": user},
                              content=data, headers={"Content-Type": "application/octet-stream"},
                              timeout=httpx.Timeout(120.0, write=600.0))
    except httpx.HTTPError as e:
        raise EnvdError(f"upload to {path} failed: {e!r}") from e
    if r.status_code >= 300:
        raise EnvdError(f"upload to {path} failed: HTTP {r.status_code} {r.text[:200]}")


# --------------------------------------------------------------------------- Connect: processes

#: Longest output line passed on (bytes): a longer one is cut into pieces of this size,
#: so a step printing without newlines costs linear time (issue 25, item 9).
MAX_LINE_BYTES = 8 * 1024
#: Largest Connect message accepted from envd (bytes; envd sends output in small chunks).
MAX_MESSAGE_BYTES = 16 << 20
#: Connect end-of-stream flag (connectrpc.com/docs/protocol, "Streaming").
END_STREAM = 0x02


def envelope(msg: dict) -> bytes:
    """One Connect streaming message with the JSON codec: flags 0, length, payload."""
    data = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(data)) + data


def _auth(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


class _Lines:
    """Split a byte stream into lines for ``sink`` (partial last line kept; a line
    longer than :data:`MAX_LINE_BYTES` goes out in pieces of that size)."""

    def __init__(self, stream: str, sink: LineSink | None):
        self.stream, self.sink, self.buf = stream, sink, bytearray()

    def _emit(self, line: bytes) -> None:
        if self.sink:
            self.sink(self.stream, line.decode("utf-8", "replace"))

    def feed(self, data: bytes) -> None:
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl < 0:
                break
            self.buf += data[start:nl]
            self._emit(bytes(self.buf))
            self.buf.clear()
            start = nl + 1
        self.buf += data[start:]
        while len(self.buf) >= MAX_LINE_BYTES:
            self._emit(bytes(self.buf[:MAX_LINE_BYTES]))
            del self.buf[:MAX_LINE_BYTES]

    def flush(self) -> None:
        if self.buf:
            self._emit(bytes(self.buf))
        self.buf.clear()


async def run(
    client: httpx.AsyncClient,
    host: str,
    command: str,
    *,
    user: str = "root",
    envs: dict[str, str] | None = None,
    cwd: str | None = None,
    on_line: LineSink | None = None,
    timeout_s: float | None = 600.0,
    background: bool = False,
    port: int = ENVD_PORT,
    access_token: str | None = None,
) -> int:
    """Run ``command`` with ``/bin/sh -c`` inside the sandbox whose envd listens on
    ``host:port`` as ``user``, with ``envs`` added and working directory ``cwd``
    (Connect ``process.Process/Start``), proving ``access_token`` when the sandbox has one.

    Output lines go to ``on_line(stream, line)``. With ``background`` the call returns
    0 as soon as envd reports the process started (the process keeps running: envd
    does not kill commands whose client disconnects). ``timeout_s`` None: no limit
    (the command is not killed; cancelling the call leaves it running).

    Returns:
        The exit code (-1 when the process ended without one, e.g. killed by a signal).

    Raises:
        EnvdError: envd rejected the request (bad user, missing cwd, …), failed, or sent
            a message over :data:`MAX_MESSAGE_BYTES`.
        TimeoutError: the command ran longer than ``timeout_s``.
    """
    proc: dict = {"cmd": "/bin/sh", "args": ["-c", command], "envs": dict(envs or {})}
    if cwd:
        proc["cwd"] = cwd
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        **_auth(user),
    }
    if access_token:
        headers["X-Access-Token"] = access_token
    if not background and timeout_s is not None:
        headers["Connect-Timeout-Ms"] = str(int(timeout_s * 1000))
    out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)

    async def go() -> int:
        url = f"{envd_url(host, port)}/process.Process/Start"
        async with client.stream("POST", url, content=envelope({"process": proc}), headers=headers,
                                 timeout=httpx.Timeout(10.0, read=None)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode("utf-8", "replace")
                raise EnvdError(f"envd process start answered HTTP {r.status_code}: {body[:300]}")
            buf = bytearray()
            async for chunk in r.aiter_bytes():
                buf += chunk
                pos = 0
                while len(buf) - pos >= 5:
                    flags, n = struct.unpack_from(">BI", buf, pos)
                    if n > MAX_MESSAGE_BYTES:
                        raise EnvdError(f"envd sent a {n}-byte message (at most {MAX_MESSAGE_BYTES})")
                    if len(buf) - pos < 5 + n:
                        break
                    payload = bytes(buf[pos + 5:pos + 5 + n])
                    pos += 5 + n
                    msg = json.loads(payload or b"{}")
                    if flags & END_STREAM:
                        if msg.get("error"):
                            e = msg["error"]
                            raise EnvdError(f"{e.get('code', 'error')}: {e.get('message', '')}")
                        out.flush()
                        err.flush()
                        return -1
                    ev = (msg.get("event") or {})
                    if "start" in ev and background:
                        return 0
                    if "data" in ev:
                        d = ev["data"]
                        if "stdout" in d:
                            out.feed(base64.b64decode(d["stdout"]))
                        if "stderr" in d:
                            err.feed(base64.b64decode(d["stderr"]))
                    if "end" in ev:
                        out.flush()
                        err.flush()
                        end = ev["end"]
                        if not end.get("exited", False) and "exitCode" not in end:
                            return -1
                        return int(end.get("exitCode", 0))
                del buf[:pos]
                await asyncio.sleep(0)  # other requests get the loop between chunks, however fast output comes
            raise EnvdError("envd closed the process stream without an end event")

    try:
        return await asyncio.wait_for(go(), timeout=None if background or timeout_s is None else timeout_s + 10)
    except TimeoutError as e:
        raise TimeoutError(f"command did not finish in {timeout_s:.0f} s") from e
    except httpx.HTTPError as e:
        raise EnvdError(f"envd connection failed: {e}") from e
