"""Minimal host-side envd client used by template builds.

Speaks envd's Connect RPC with the JSON codec (``application/connect+json``, enveloped
messages: 1 flag byte, 4-byte big-endian length, payload; flag ``0x02`` marks the
end-of-stream message) for ``process.Process/Start``, plus envd's plain HTTP
``POST /files`` and ``POST /init``. The user of a request is chosen the way the E2B SDK
does it: ``Authorization: Basic base64("<user>:")``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterable, Callable
from datetime import UTC, datetime

import httpx

from forkyard.config import ENVD_PORT

LineSink = Callable[[str, str], None]  # (stream "stdout"/"stderr", line)


class EnvdError(Exception):
    """envd answered with an error or the connection failed."""


def _auth(user: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}


def _envelope(msg: dict) -> bytes:
    data = json.dumps(msg).encode()
    return struct.pack(">BI", 0, len(data)) + data


#: Longest output line passed on (bytes): a longer one is cut into pieces of this size,
#: so a step printing without newlines costs linear time (issue 25, item 9).
MAX_LINE_BYTES = 8 * 1024
#: Largest Connect message accepted from envd (bytes; envd sends output in small chunks).
MAX_MESSAGE_BYTES = 16 << 20


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
    timeout_s: float = 600.0,
    background: bool = False,
    port: int = ENVD_PORT,
) -> int:
    """Run ``command`` with ``/bin/sh -c`` inside the sandbox whose envd listens on
    ``host:port`` as ``user``, with ``envs`` added and working directory ``cwd``.

    Output lines go to ``on_line(stream, line)``. With ``background`` the call returns
    0 as soon as envd reports the process started (the process keeps running: envd
    does not kill commands whose client disconnects).

    Returns:
        The exit code (-1 when the process ended without one, e.g. killed by a signal).

    Raises:
        EnvdError: envd rejected the request (bad user, missing cwd, …) or failed.
        TimeoutError: the command ran longer than ``timeout_s``.
    """
    proc: dict = {"cmd": "/bin/sh", "args": ["-c", command], "envs": dict(envs or {})}
    if cwd:
        proc["cwd"] = cwd
    headers = {
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
        "Connect-Timeout-Ms": str(int(timeout_s * 1000)) if not background else "0",
        **_auth(user),
    }
    if background:
        headers.pop("Connect-Timeout-Ms")
    out, err = _Lines("stdout", on_line), _Lines("stderr", on_line)

    async def go() -> int:
        url = f"http://{host}:{port}/process.Process/Start"
        async with client.stream("POST", url, content=_envelope({"process": proc}), headers=headers,
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
                    if flags & 0x02:
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
        return await asyncio.wait_for(go(), timeout=None if background else timeout_s + 10)
    except TimeoutError as e:
        raise TimeoutError(f"command did not finish in {timeout_s:.0f} s") from e
    except httpx.HTTPError as e:
        raise EnvdError(f"envd connection failed: {e}") from e


async def upload(client: httpx.AsyncClient, host: str, path: str, data: bytes | AsyncIterable[bytes],
                 user: str = "root", port: int = ENVD_PORT) -> None:
    """Write ``data`` (bytes, or chunks streamed as they come) to ``path`` inside the
    sandbox (envd ``POST /files``, octet-stream), owned by ``user``.

    Raises:
        EnvdError: envd refused or the connection failed.
    """
    try:
        r = await client.post(f"http://{host}:{port}/files", params={"path": path, "username": user},
                              content=data, headers={"Content-Type": "application/octet-stream"},
                              timeout=httpx.Timeout(120.0, write=600.0))
    except httpx.HTTPError as e:
        raise EnvdError(f"upload to {path} failed: {e!r}") from e
    if r.status_code >= 300:
        raise EnvdError(f"upload to {path} failed: HTTP {r.status_code} {r.text[:200]}")


async def init(client: httpx.AsyncClient, host: str, *, env_vars: dict[str, str] | None = None,
               default_user: str | None = None, default_workdir: str | None = None,
               port: int = ENVD_PORT) -> None:
    """``POST /init`` on an unsecured envd: merge ``env_vars`` into the sandbox env and set
    the default user / working directory of later requests.

    Raises:
        EnvdError: envd refused or the connection failed.
    """
    body: dict = {"timestamp": datetime.now(UTC).isoformat()}
    if env_vars:
        body["envVars"] = env_vars
    if default_user:
        body["defaultUser"] = default_user
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    try:
        r = await client.post(f"http://{host}:{port}/init", json=body, timeout=10.0)
    except httpx.HTTPError as e:
        raise EnvdError(f"envd /init failed: {e}") from e
    if r.status_code >= 300:
        raise EnvdError(f"envd /init failed: HTTP {r.status_code} {r.text[:200]}")
