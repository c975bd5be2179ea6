"""Typed asyncio client for the forkyard REST API (httpx) that hands out the e2b SDK's
``AsyncSandbox`` for everything inside a sandbox (commands, PTY, files).

Times are seconds, sizes bytes unless a name says otherwise (``memory_mb``). Every
method raises a :class:`~forkyard.client.errors.ForkyardError` subclass on failure:
:class:`ServerUnreachable` (no connection), :class:`AuthError` (401/403),
:class:`NotFound` (404), :class:`Conflict` (409), :class:`BadRequest` (400/422),
:class:`NotSupported` (the server lacks the endpoint), :class:`ApiError` (others).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Self

import httpx

from forkyard.client import fanout
from forkyard.client.config import ResolvedConfig, resolve
from forkyard.client.errors import (
    ApiError,
    AuthError,
    BadRequest,
    Conflict,
    ForkError,
    ForkyardError,
    NotFound,
    NotSupported,
    ServerUnreachable,
)

ENVD_PORT = 49983


def _ts(s: str | None) -> datetime | None:
    if not s:
        return None
    return datetime.fromisoformat(s)


@dataclass
class SandboxInfo:
    """One sandbox as the server lists it. ``started_at``/``end_at`` are aware UTC
    datetimes (``end_at``: when it expires); ``state`` is ``running`` or ``paused``."""

    sandbox_id: str
    template_id: str
    state: str
    started_at: datetime | None = None
    end_at: datetime | None = None
    cpu_count: int | None = None
    memory_mb: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    envd_version: str | None = None
    envd_access_token: str | None = None
    on_timeout: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxInfo:
        """Build from a ``ListedSandbox``/``SandboxDetail``/``Sandbox`` body."""
        return cls(
            sandbox_id=d["sandboxID"],
            template_id=d.get("templateID", ""),
            state=d.get("state", "running"),
            started_at=_ts(d.get("startedAt")),
            end_at=_ts(d.get("endAt")),
            cpu_count=d.get("cpuCount"),
            memory_mb=d.get("memoryMB"),
            metadata=dict(d.get("metadata") or {}),
            envd_version=d.get("envdVersion"),
            envd_access_token=d.get("envdAccessToken"),
            on_timeout=(d.get("lifecycle") or {}).get("onTimeout"),
            raw=d,
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the server's field names, without the envd access token)."""
        return {k: v for k, v in self.raw.items() if k != "envdAccessToken"}


@dataclass
class SnapshotInfo:
    """A snapshot: ``size_bytes`` of stored data, ``created_at`` aware UTC datetime."""

    snapshot_id: str
    names: list[str]
    sandbox_id: str | None
    template_id: str | None
    size_bytes: int | None
    created_at: datetime | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SnapshotInfo:
        """Build from a ``SnapshotInfo`` body."""
        return cls(d["snapshotID"], list(d.get("names") or []), d.get("sandboxID"), d.get("templateID"),
                   d.get("sizeBytes"), _ts(d.get("createdAt")), raw=d)


@dataclass
class TemplateInfo:
    """A template the server can create sandboxes from."""

    template_id: str
    names: list[str]
    cpu_count: int | None
    memory_mb: int | None
    build_status: str | None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TemplateInfo:
        """Build from a ``Template`` body."""
        return cls(d["templateID"], list(d.get("names") or d.get("aliases") or []), d.get("cpuCount"),
                   d.get("memoryMB"), d.get("buildStatus"), raw=d)


def _error_message(r: httpx.Response) -> str:
    try:
        body = r.json()
        if isinstance(body, dict) and body.get("message"):
            return str(body["message"])
    except ValueError:
        pass
    return (r.text or r.reason_phrase or "").strip()[:500]


class AsyncForkyard:
    """Async REST client. Use as ``async with AsyncForkyard() as fy: …`` (or call
    :meth:`aclose`).

    Args:
        url: server URL (default: see :mod:`forkyard.client.config`).
        api_key: API key (same resolution).
        timeout: per-request timeout, seconds (default 120: fork and pause checkpoint
            memory and can take a while on a busy host).
    """

    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 120.0):
        self.config: ResolvedConfig = resolve(url, api_key)
        self.url = self.config.url
        self.api_key = self.config.api_key
        headers = {"X-API-Key": self.api_key} if self.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections (sandboxes are left as they are)."""
        await self._http.aclose()

    # -- plumbing -------------------------------------------------------------------------
    async def _request(self, method: str, path: str, *, what: str = "", ok_404: bool = False,
                       ok_400: bool = False, **kw) -> httpx.Response:
        try:
            r = await self._http.request(method, path, **kw)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise ServerUnreachable(self.url, type(e).__name__) from e
        except httpx.TimeoutException as e:
            raise ApiError(f"{method} {path}: the server did not answer in time ({type(e).__name__})",
                           hint="the host may be overloaded; retry") from e
        except httpx.HTTPError as e:
            raise ServerUnreachable(self.url, f"{type(e).__name__}: {e}") from e
        if r.status_code < 300 or (ok_404 and r.status_code == 404) or (ok_400 and r.status_code == 400):
            return r
        msg = _error_message(r)
        label = f"{what}: " if what else f"{method} {path}: "
        if r.status_code in (401, 403):
            raise AuthError(f"{label}the server rejected the API key ({r.status_code} {msg})", status=r.status_code)
        if r.status_code == 404:
            raise NotFound(label + (msg or "not found"), status=404)
        if r.status_code == 409:
            raise Conflict(label + msg, status=409)
        if r.status_code in (400, 422):
            raise BadRequest(label + msg, status=r.status_code)
        if r.status_code == 405:
            raise NotSupported(f"{label}not supported by this server ({method} {path} → 405)", status=405)
        raise ApiError(f"{label}{r.status_code} {msg}", status=r.status_code)

    # -- server ---------------------------------------------------------------------------
    async def health(self) -> bool:
        """``True`` when ``GET /health`` answers 200. Raises :class:`ServerUnreachable`."""
        r = await self._request("GET", "/health", ok_404=True)
        return r.status_code == 200

    async def node_metrics(self) -> dict[str, Any]:
        """``GET /metrics/node``: on a node ``{"sandboxes": {"running", "paused"},
        "spareSlots", "pausesInFlight", …}``; on a gateway ``{"sandboxes": …, "nodes":
        [{"nodeID", "status", "heartbeatAge" (s), "report": {running, paused,
        max_sandboxes, vcpus, vcpus_reserved, memory_mb, load1, …}}]}``."""
        r = await self._request("GET", "/metrics/node", what="node metrics")
        return r.json()

    # -- sandboxes ------------------------------------------------------------------------
    async def list_sandboxes(self, state: Iterable[str] | None = None, metadata: dict[str, str] | None = None,
                             template: str | None = None) -> list[SandboxInfo]:
        """All sandboxes (every page), newest first. ``state``: any of ``running``,
        ``paused`` (default both); ``metadata``: exact key/value matches; ``template``:
        template id."""
        params: dict[str, str] = {"limit": "100"}
        if state:
            params["state"] = ",".join(state)
        if metadata:
            params["metadata"] = urllib.parse.urlencode(
                {urllib.parse.quote(k): urllib.parse.quote(v) for k, v in metadata.items()})
        if template:
            params["template"] = template
        return [SandboxInfo.from_json(d) for d in await self._all_pages("/v2/sandboxes", params, "list sandboxes")]

    async def _all_pages(self, path: str, params: dict[str, str], what: str) -> list[dict]:
        """GET every page of an E2B-paginated listing (``nextToken`` query /
        ``x-next-token`` header) and return the concatenated JSON items."""
        out: list[dict] = []
        while True:
            r = await self._request("GET", path, params=params, what=what)
            out += r.json()
            token = r.headers.get("x-next-token")
            if not token:
                return out
            params["nextToken"] = token

    async def get_sandbox(self, sandbox_id: str) -> SandboxInfo:
        """Details of one sandbox. Raises :class:`NotFound` for an unknown id."""
        r = await self._request("GET", f"/sandboxes/{_q(sandbox_id)}", what=f"sandbox {sandbox_id}")
        return SandboxInfo.from_json(r.json())

    async def create_sandbox(self, template: str = "base", *, timeout: int = 300,
                             metadata: dict[str, str] | None = None, envs: dict[str, str] | None = None,
                             auto_pause: bool = False) -> SandboxInfo:
        """Create a sandbox from ``template`` (name, id or snapshot) living ``timeout``
        seconds; at expiry it is paused when ``auto_pause`` else killed. Envd access is
        secured with a per-sandbox token (kept in the result, used by :meth:`sandbox`).
        Raises :class:`NotFound` for an unknown template."""
        body: dict[str, Any] = {"templateID": template, "timeout": timeout, "autoPause": auto_pause, "secure": True}
        if metadata:
            body["metadata"] = metadata
        if envs:
            body["envVars"] = envs
        r = await self._request("POST", "/sandboxes", json=body, what=f"create sandbox from {template!r}")
        return SandboxInfo.from_json(r.json())

    async def kill(self, sandbox_id: str) -> None:
        """Kill a sandbox (running or paused). Raises :class:`NotFound`."""
        await self._request("DELETE", f"/sandboxes/{_q(sandbox_id)}", what=f"kill {sandbox_id}")

    async def pause(self, sandbox_id: str) -> None:
        """Pause (checkpoint memory and stop). Raises :class:`NotFound`, :class:`Conflict`
        when already paused."""
        await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/pause", what=f"pause {sandbox_id}")

    async def resume(self, sandbox_id: str, timeout: int | None = None) -> SandboxInfo:
        """Resume a paused sandbox under the same id, expiring ``timeout`` seconds from
        now (server default when ``None``). Raises :class:`Conflict` when running."""
        body = {"timeout": timeout} if timeout else {}
        r = await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/resume", json=body,
                                what=f"resume {sandbox_id}")
        return SandboxInfo.from_json(r.json())

    async def connect_info(self, sandbox_id: str, timeout: int = 300) -> SandboxInfo:
        """``POST /sandboxes/{id}/connect``: resumes a paused sandbox; a running one gets
        its expiry moved to at least ``timeout`` seconds from now (never shortened)."""
        r = await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/connect", json={"timeout": timeout},
                                what=f"connect to {sandbox_id}")
        return SandboxInfo.from_json(r.json())

    async def set_timeout(self, sandbox_id: str, seconds: int) -> None:
        """Make the sandbox expire ``seconds`` from now (0…86400; may shorten)."""
        await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/timeout", json={"timeout": seconds},
                            what=f"set timeout of {sandbox_id}")

    async def refresh(self, sandbox_id: str, seconds: int) -> None:
        """Keep the sandbox alive at least ``seconds`` (≤ 3600) more."""
        await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/refreshes", json={"duration": seconds},
                            what=f"refresh {sandbox_id}")

    async def metrics(self, sandbox_id: str) -> dict[str, Any]:
        """Latest usage sample: ``cpuCount``, ``cpuUsedPct`` (%), ``memUsed``/``memTotal``
        and ``diskUsed``/``diskTotal`` (bytes). ``{}`` when the server has none."""
        r = await self._request("GET", f"/sandboxes/{_q(sandbox_id)}/metrics", what=f"metrics of {sandbox_id}")
        data = r.json()
        return data[-1] if data else {}

    async def logs(self, sandbox_id: str) -> list[dict[str, Any]]:
        """Sandbox log lines (``GET /sandboxes/{id}/logs``): ``{timestamp, line}`` each,
        plus ``level`` when the server gives structured ``logEntries`` (``line`` is then
        the entry's message). Raises :class:`NotSupported` when the server has no logs
        endpoint, :class:`NotFound` for an unknown id. A sandbox that died by itself
        within the last hour still has logs on forkyard (the last saying why)."""
        r = await self._request("GET", f"/sandboxes/{_q(sandbox_id)}/logs", ok_404=True, what=f"logs of {sandbox_id}")
        if r.status_code == 404:
            await self.get_sandbox(sandbox_id)  # NotFound for an unknown id: the 404 was the sandbox's
            raise NotSupported("this server has no sandbox logs endpoint (GET /sandboxes/{id}/logs → 404)")
        data = r.json()
        if isinstance(data, dict) and isinstance(data.get("logEntries"), list):
            return [{"timestamp": e.get("timestamp"), "line": e.get("message"), "level": e.get("level")}
                    for e in data["logEntries"]]
        return list(data.get("logs", []) if isinstance(data, dict) else data)

    async def fork_info(self, sandbox_id: str, count: int = 1, timeout: int = 300) -> list[SandboxInfo | ForkError]:
        """Fork a running sandbox into ``count`` children (any number; the server takes
        at most 100 per call, so larger counts are split), each living ``timeout``
        seconds. The source is briefly paused and keeps its id and expiry. One entry per
        child: its :class:`SandboxInfo` or a :class:`ForkError`. Raises for a failure of
        the whole call (unknown or paused source)."""
        if count < 1:
            raise BadRequest(f"fork count must be ≥ 1, got {count}")
        out: list[SandboxInfo | ForkError] = []
        left = count
        while left:
            n = min(left, 100)
            r = await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/fork", json={"count": n, "timeout": timeout},
                                    what=f"fork {sandbox_id}")
            for item in r.json():
                if item.get("sandbox"):
                    out.append(SandboxInfo.from_json(item["sandbox"]))
                else:
                    err = item.get("error") or {}
                    out.append(ForkError(int(err.get("code", 500)), str(err.get("message", "fork failed"))))
            left -= n
        return out

    # -- snapshots and templates ----------------------------------------------------------
    async def create_snapshot(self, sandbox_id: str, name: str | None = None) -> SnapshotInfo:
        """Snapshot a running sandbox (it keeps running); usable as a template."""
        r = await self._request("POST", f"/sandboxes/{_q(sandbox_id)}/snapshots", json={"name": name} if name else {},
                                what=f"snapshot {sandbox_id}")
        return SnapshotInfo.from_json(r.json())

    async def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[SnapshotInfo]:
        """All snapshots (every page), oldest first, filtered by source sandbox / name."""
        params: dict[str, str] = {"limit": "100"}
        if sandbox_id:
            params["sandboxID"] = sandbox_id
        if name:
            params["name"] = name
        return [SnapshotInfo.from_json(d) for d in await self._all_pages("/snapshots", params, "list snapshots")]

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (``DELETE /templates/{id}``). Raises :class:`NotFound`."""
        await self._request("DELETE", f"/templates/{_q(snapshot_id)}", what=f"delete {snapshot_id}")

    async def list_templates(self) -> list[TemplateInfo]:
        """Templates the server can create sandboxes from."""
        r = await self._request("GET", "/templates", what="list templates")
        return [TemplateInfo.from_json(d) for d in r.json()]

    async def delete_template(self, template_id: str) -> None:
        """Delete a template or snapshot (``DELETE /templates/{id}``). Raises :class:`NotFound`."""
        await self._request("DELETE", f"/templates/{_q(template_id)}", what=f"delete template {template_id}")

    async def import_template(self, name: str, tarball, progress=None, disk_mb: int | None = None) -> TemplateInfo:
        """Import a container image as template ``name``: ``tarball`` is the path of a
        ``docker save`` tarball or a tar of an OCI image layout (optionally gzipped),
        streamed as ``POST /templates/import?name=NAME``; ``disk_mb`` sizes its
        sandboxes' disks (MiB, ``diskSizeMB``; None: the server's default). ``progress(n)`` is called with
        each chunk's size (bytes). Raises :class:`NotSupported` when the server has no
        import endpoint, :class:`Conflict` when the name is taken, :class:`BadRequest`
        for an image the server cannot use, ``OSError`` when the file cannot be read."""
        async def body():
            with open(tarball, "rb") as f:  # noqa: ASYNC230 — sequential 1 MiB reads
                while chunk := f.read(1 << 20):
                    if progress:
                        progress(len(chunk))
                    yield chunk

        path = "/templates/import"
        params = {"name": name, **({"diskSizeMB": disk_mb} if disk_mb is not None else {})}
        # Probe first with an empty body (→ 400 "empty body" where supported, 409 when the
        # name is taken) so a server without the endpoint, or with the name taken, answers
        # before a large upload starts rather than closing the connection mid-body.
        probe = await self._request("POST", path, params=params, ok_404=True, ok_400=True,
                                    what=f"import template {name!r}")
        if probe.status_code == 404:
            raise NotSupported(f"template import is not supported by this server (POST {path} → 404)")
        if probe.status_code == 400 and "diskSizeMB" in (msg := _error_message(probe)):
            raise BadRequest(f"import template {name!r}: {msg}", status=400)
        r = await self._request("POST", path, params=params, content=body(), ok_404=True,
                                timeout=httpx.Timeout(60, read=1800), what=f"import template {name!r}",
                                headers={"Content-Type": "application/x-tar"})
        if r.status_code == 404:
            raise NotSupported(f"template import is not supported by this server (POST {path} → 404)")
        return TemplateInfo.from_json(r.json())

    # -- envd (through the e2b SDK) -------------------------------------------------------
    def sandbox(self, info: SandboxInfo):
        """An e2b ``AsyncSandbox`` for a running sandbox described by ``info`` (as returned
        by :meth:`create_sandbox`, :meth:`connect_info`, :meth:`get_sandbox`,
        :meth:`fork_info`); no request is made."""
        from e2b import AsyncSandbox
        from e2b.connection_config import ConnectionConfig
        from packaging.version import Version

        headers = {"E2b-Sandbox-Id": info.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if info.envd_access_token:
            headers["X-Access-Token"] = info.envd_access_token
        params = self.sdk_params()
        cc = ConnectionConfig(extra_sandbox_headers=headers, **params)
        # The same construction the SDK's own create/fork use for their results.
        return AsyncSandbox(sandbox_id=info.sandbox_id, sandbox_domain=None,
                            envd_version=Version(info.envd_version or "0.6.4"),
                            envd_access_token=info.envd_access_token, traffic_access_token=None,
                            connection_config=cc)

    def sdk_params(self) -> dict[str, Any]:
        """``api_url``/``sandbox_url``/``api_key`` for e2b SDK calls against this server."""
        return {"api_url": self.url, "sandbox_url": self.config.sandbox_url, "api_key": self.api_key or ""}

    async def create(self, template: str = "base", **kw):
        """Create a sandbox (see :meth:`create_sandbox` for arguments) and return its
        e2b ``AsyncSandbox``."""
        return self.sandbox(await self.create_sandbox(template, **kw))

    async def connect(self, sandbox_id: str, timeout: int = 300):
        """An e2b ``AsyncSandbox`` for ``sandbox_id``, resuming it when paused; its expiry
        becomes at least ``timeout`` seconds from now. Raises :class:`NotFound`."""
        info = await self.get_sandbox(sandbox_id)
        if info.state == "paused" or (info.end_at and (info.end_at.timestamp() - _now()) < timeout):
            info = await self.connect_info(sandbox_id, timeout)
        return self.sandbox(info)

    async def fork(self, sandbox, n: int = 1, *, timeout: int = 300) -> list:
        """Fork ``sandbox`` (an ``AsyncSandbox`` or id) into ``n`` children living
        ``timeout`` seconds each. Returns one entry per child: an ``AsyncSandbox`` or a
        :class:`ForkError`."""
        sid = sandbox if isinstance(sandbox, str) else sandbox.sandbox_id
        return [r if isinstance(r, ForkError) else self.sandbox(r) for r in await self.fork_info(sid, n, timeout)]

    async def rollout(self, source, n: int, step, **kw):
        """See :func:`forkyard.client.rollout` (this client is used for the REST calls)."""
        return await fanout.run(self, source, n, step, **kw)


def _now() -> float:
    import time

    return time.time()


def _q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


__all__ = ["AsyncForkyard", "ForkError", "ForkyardError", "SandboxInfo", "SnapshotInfo", "TemplateInfo"]
