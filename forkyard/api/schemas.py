"""Request/response bodies of the E2B REST API (field names from E2B's OpenAPI spec as
shipped in the ``e2b`` SDK's generated models: ``NewSandbox``, ``Sandbox``,
``SandboxDetail``, ``ListedSandbox``, ``SandboxMetric``, ``Error``)."""

from __future__ import annotations

import base64
from datetime import datetime, timezone

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from forkyard.config import ENVD_VERSION
from forkyard.orchestrator.errors import BadRequest
from forkyard.orchestrator.store import SandboxRecord


#: Bounds on client-supplied maps (E2B documents none; these keep listings and exec
#: environments sane: Linux limits one env string to 128 KiB).
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 16 * 1024
MAX_ENV_BYTES = 128 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class NewSandbox(_Strict):
    """``POST /sandboxes`` and ``POST /v2/sandboxes`` body. ``timeout`` in seconds."""

    template_id: str = Field(alias="templateID", min_length=1, max_length=128)
    timeout: int | None = Field(default=None, ge=0, le=86400)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    secure: bool | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allow_internet_access")
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, v):
        if v is not None:
            if len(v) > MAX_METADATA_KEYS:
                raise ValueError(f"at most {MAX_METADATA_KEYS} metadata keys")
            if sum(len(k) + len(x) for k, x in v.items()) > MAX_METADATA_BYTES:
                raise ValueError(f"metadata larger than {MAX_METADATA_BYTES} bytes")
        return v

    @field_validator("env_vars")
    @classmethod
    def _env_ok(cls, v):
        if v is not None:
            for k, x in v.items():
                if not k or "=" in k or "\0" in k or "\0" in x:
                    raise ValueError(f"invalid environment variable name or value {k!r}: names must be "
                                     "non-empty without '=' and neither may contain NUL")
            if sum(len(k) + len(x) + 2 for k, x in v.items()) > MAX_ENV_BYTES:
                raise ValueError(f"envVars larger than {MAX_ENV_BYTES} bytes")
        return v


class TimeoutBody(_Strict):
    """``POST /sandboxes/{id}/timeout``: ``timeout`` seconds from now."""

    timeout: int = Field(ge=0, le=86400)


class RefreshBody(_Strict):
    """``POST /sandboxes/{id}/refreshes``: extend by ``duration`` seconds (≤ 3600)."""

    duration: int | None = Field(default=None, ge=0, le=3600)


class ConnectBody(_Strict):
    """``POST /sandboxes/{id}/connect``: new ``timeout`` in seconds."""

    timeout: int = Field(default=300, ge=0, le=86400)


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def sandbox_created(rec: SandboxRecord) -> dict:
    """``Sandbox`` body returned by create/connect (201/200)."""
    d = {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "envdVersion": ENVD_VERSION,
        "alias": rec.template_id,
    }
    if rec.envd_access_token:
        d["envdAccessToken"] = rec.envd_access_token
    return d


def sandbox_listed(rec: SandboxRecord) -> dict:
    """``ListedSandbox`` body (list endpoints)."""
    return {
        "templateID": rec.template_id,
        "alias": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "startedAt": _iso(rec.started_at),
        "endAt": _iso(rec.end_at),
        "cpuCount": rec.vcpus,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "state": "paused" if rec.state == "paused" else "running",
        "envdVersion": ENVD_VERSION,
        "metadata": rec.metadata,
    }


def sandbox_detail(rec: SandboxRecord) -> dict:
    """``SandboxDetail`` body (``GET /sandboxes/{id}``)."""
    d = sandbox_listed(rec)
    d["lifecycle"] = {"autoResume": False, "onTimeout": "pause" if rec.auto_pause else "kill"}
    if rec.envd_access_token:
        d["envdAccessToken"] = rec.envd_access_token
    return d


def error(code: int, message: str) -> dict:
    """E2B ``Error`` body."""
    return {"code": code, "message": message}


class ResumeBody(_Strict):
    """``POST /sandboxes/{id}/resume``: new ``timeout`` (s) and ``autoPause``."""

    timeout: int | None = Field(default=None, ge=1, le=86400)
    auto_pause: bool | None = Field(default=None, alias="autoPause")


class ForkBody(_Strict):
    """``POST /sandboxes/{id}/fork``: ``count`` children (1…100, default 1) each living
    ``timeout`` seconds (default 15)."""

    count: StrictInt = Field(default=1, ge=1, le=100)
    timeout: StrictInt = Field(default=15, ge=1, le=86400)


class SnapshotBody(_Strict):
    """``POST /sandboxes/{id}/snapshots``: optional ``name``; ``memory`` false (a
    filesystem-only snapshot, E2B's ``mode="filesystem"``) is refused with 400."""

    name: str | None = Field(default=None, max_length=64)
    memory: bool | None = None


class PauseBody(_Strict):
    """``POST /sandboxes/{id}/pause`` (E2B ``SandboxPauseRequest``): ``memory`` (default
    true; false = filesystem-only pause, refused with 400 here) and
    ``requireHealthyGuest`` (default false; true = 503 unless envd answers first)."""

    memory: bool | None = None
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")


#: Why ``memory: false`` is refused (pause and snapshot).
FILESYSTEM_ONLY_UNSUPPORTED = (
    "memory: false (a filesystem-only pause/snapshot, SDK mode='filesystem') is not supported by "
    "forkyard's gVisor runtime: pauses and snapshots always keep memory and running processes; "
    "omit memory or send memory: true"
)


def snapshot_info(meta) -> dict:
    """E2B ``SnapshotInfo`` body plus forkyard extras (source, size, creation time)."""
    return {
        "snapshotID": meta.snapshot_id,
        "names": meta.names,
        "sandboxID": meta.source_sandbox_id,
        "templateID": meta.template_id,
        "sizeBytes": meta.size_bytes,
        "createdAt": _iso(meta.created_at),
    }


def paginate(items: list, limit: int, next_token: str | None, response) -> list:
    """One page of ``items`` for E2B-style pagination: ``next_token`` is the opaque
    token from the previous page's ``x-next-token`` header (here a base64 offset);
    sets that header on ``response`` when more items follow.

    Raises:
        BadRequest: the token is not one this server issued.
    """
    start = 0
    if next_token:
        try:
            start = int(base64.urlsafe_b64decode(next_token.encode()).decode())
            if start < 0:
                raise ValueError("negative offset")
        except Exception as e:  # noqa: BLE001 — any decoding failure is the client's
            raise BadRequest("invalid nextToken") from e
    if start + limit < len(items):
        response.headers["x-next-token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
    return items[start : start + limit]
