"""Host-side calls to a sandbox's envd over its slot's outer address.

Protocol source: E2B envd's plain HTTP endpoints ``GET /health`` (204 when ready) and
``POST /init`` (JSON ``envVars``, ``accessToken``, ``defaultUser``, ``timestamp``).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone

import httpx

from forkyard.config import ENVD_PORT


def envd_url(outer_ip: str) -> str:
    """Base URL of envd for a slot's outer address."""
    return f"http://{outer_ip}:{ENVD_PORT}"


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


async def wait_healthy(client: httpx.AsyncClient, outer_ip: str, timeout_s: float) -> None:
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
            r = await client.get(f"{envd_url(outer_ip)}/health", timeout=1.0)
            if r.status_code < 300:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = e
        await asyncio.sleep(_poll_interval(started))
    raise TimeoutError(f"envd did not become healthy in {timeout_s:.0f} s: {last!r}")


async def init(
    client: httpx.AsyncClient,
    outer_ip: str,
    env_vars: dict[str, str],
    access_token: str | None,
    current_token: str | None = None,
    default_user: str = "user",
    wait_s: float = 0.0,
    default_workdir: str | None = None,
) -> None:
    """Send ``POST /init`` with the sandbox's env vars and access token.

    ``current_token`` is the token envd already holds (a restored checkpoint keeps its
    source's token; envd only accepts a new one from a caller that knows the old one).
    ``default_user`` is the user of requests that name none, ``default_workdir``
    (when given) their working directory. With ``wait_s`` > 0 a
    refused connection (envd not listening yet) is retried (as :func:`wait_healthy`
    polls) for up to ``wait_s`` seconds, so a just-started sandbox needs no separate ``/health`` poll;
    the request is never sent twice once a connection was made.

    Raises:
        httpx.HTTPError: connection failure or non-2xx answer.
        TimeoutError: envd refused connections for ``wait_s`` seconds.
    """
    body: dict = {
        "envVars": env_vars,
        "defaultUser": default_user,
        "timestamp": datetime.now(timezone.utc).isoformat(),
    }
    if default_workdir:
        body["defaultWorkdir"] = default_workdir
    if access_token:
        body["accessToken"] = access_token
    headers = {"X-Access-Token": current_token} if current_token else {}
    started = time.monotonic()
    deadline = started + wait_s
    while True:
        try:
            r = await client.post(f"{envd_url(outer_ip)}/init", json=body, headers=headers, timeout=5.0)
            break
        except httpx.ConnectError as e:
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    raise TimeoutError(f"envd did not accept connections in {wait_s:.0f} s: {e!r}") from e
                raise
            await asyncio.sleep(_poll_interval(started))
    r.raise_for_status()


async def get_json(client: httpx.AsyncClient, outer_ip: str, path: str, access_token: str | None):
    """GET ``path`` from envd and return the decoded JSON body.

    Raises:
        httpx.HTTPError: connection failure or non-2xx answer.
    """
    headers = {"X-Access-Token": access_token} if access_token else {}
    r = await client.get(f"{envd_url(outer_ip)}{path}", headers=headers, timeout=5.0)
    r.raise_for_status()
    return r.json()
