"""Request/response bodies of the E2B REST API (field names from E2B's OpenAPI spec as
shipped in the ``e2b`` SDK's generated models: ``NewSandbox``, ``Sandbox``,
``SandboxDetail``, ``ListedSandbox``, ``SandboxMetric``, ``Error``)."""

from __future__ import annotations

import base64
import re

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from forkyard.config import ENVD_VERSION
from forkyard.ids import rfc3339
from forkyard.orchestrator.errors import BadRequest
from forkyard.orchestrator.store import SandboxRecord


#: Bounds on client-supplied maps (E2B documents none; these keep listings and exec
#: environments sane: Linux limits one env string to 128 KiB).
MAX_METADATA_KEYS = 64
MAX_METADATA_BYTES = 16 * 1024
MAX_ENV_BYTES = 128 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore")


class AutoResume(BaseModel):
    """E2B ``SandboxAutoResumeConfig``."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool


class NetworkConfig(BaseModel):
    """E2B ``SandboxNetworkConfig`` (create's ``network``); which values are honoured:
    :func:`unsupported_create_fields`."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    allow_public_traffic: bool | None = Field(default=None, alias="allowPublicTraffic")
    allow_out: list[str] | None = Field(default=None, alias="allowOut", max_length=1024)
    deny_out: list[str] | None = Field(default=None, alias="denyOut", max_length=1024)
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers", max_length=64)
    egress_proxy: dict | None = Field(default=None, alias="egressProxy")
    mask_request_host: str | None = Field(default=None, alias="maskRequestHost", max_length=256)
    https_ports: list[int] | None = Field(default=None, alias="httpsPorts", max_length=64)
    rules: dict | None = None


class VolumeMount(BaseModel):
    """One E2B ``SandboxVolumeMount``: volume ``name`` at guest ``path``."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)
    path: str = Field(min_length=1, max_length=1024)


class NewSandbox(_Strict):
    """``POST /sandboxes`` and ``POST /v2/sandboxes`` body (E2B ``NewSandbox`` /
    ``NewSandboxV2``, e2b 2.63). ``timeout`` in seconds. Every field E2B defines is
    modelled; an unknown field is a 400 naming it, and a value forkyard does not
    enforce is refused by :func:`unsupported_create_fields` (never accepted and ignored).
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    template_id: str = Field(alias="templateID", min_length=1, max_length=128)
    timeout: int | None = Field(default=None, ge=0, le=86400)
    auto_pause: bool | None = Field(default=None, alias="autoPause")
    auto_pause_memory: bool | None = Field(default=None, alias="autoPauseMemory")
    auto_resume: AutoResume | None = Field(default=None, alias="autoResume")
    secure: bool | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allow_internet_access")
    network: NetworkConfig | None = None
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(default=None, alias="envVars")
    mcp: dict | None = None
    iam: dict | None = None
    volume_mounts: list[VolumeMount] | None = Field(default=None, alias="volumeMounts", max_length=16)

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


#: A Host mask: host[:port] made of DNS characters and the ``${PORT}`` placeholder.
_HOST_MASK = re.compile(r"(?:[A-Za-z0-9.-]|\$\{PORT\})+(?::(?:\d{1,5}|\$\{PORT\}))?")


def unsupported_egress(net) -> list[str]:
    """Refusals for egress fields forkyard does not enforce (``allowOut``/``denyOut`` are
    enforced; see :mod:`forkyard.network.egress`)."""
    out = []
    if net.dns_servers:
        out.append("network.dnsServers only matters with domain allowOut entries, which forkyard does not support")
    if net.egress_proxy:
        out.append("network.egressProxy is not supported")
    if net.rules:
        out.append("network.rules (egress request transforms) are not supported")
    return out


class NetworkUpdate(BaseModel):
    """``PUT /sandboxes/{id}/network`` body (E2B ``SandboxNetworkUpdateConfig``): replaces
    the whole egress configuration; omitted fields are cleared."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    allow_out: list[str] | None = Field(default=None, alias="allowOut", max_length=1024)
    deny_out: list[str] | None = Field(default=None, alias="denyOut", max_length=1024)
    dns_servers: list[str] | None = Field(default=None, alias="dnsServers", max_length=64)
    egress_proxy: dict | None = Field(default=None, alias="egressProxy")
    rules: dict | None = None
    allow_internet_access: bool | None = Field(default=None, alias="allow_internet_access")


def egress_policy(allow_out, deny_out, allow_internet_access):
    """:func:`forkyard.network.egress.parse_policy` with its errors as 400s.

    Raises:
        BadRequest: a domain, malformed or too many entries.
    """
    from forkyard.network.egress import PolicyError, parse_policy

    try:
        return parse_policy(allow_out, deny_out, allow_internet_access)
    except PolicyError as e:
        raise BadRequest(str(e)) from e


def unsupported_create_fields(body: NewSandbox) -> list[str]:
    """Messages for the create fields of ``body`` whose value forkyard does not enforce
    (empty: every field is honoured). Each message names the field as the API spells it.
    Defaults and explicit "off" values (``autoResume.enabled: false``, empty lists and
    maps, ``allowPublicTraffic: true``) are honoured and pass."""
    out = []
    if body.auto_pause_memory is False and body.auto_resume is not None and body.auto_resume.enabled:
        out.append("autoResume.enabled: true cannot be combined with autoPauseMemory: false (a "
                   "filesystem-only pause cold-boots on resume; resume it explicitly with connect)")
    if body.auto_resume is not None and body.auto_resume.enabled and body.auto_pause is False:
        out.append("autoResume.enabled: true needs autoPause: true (a killed sandbox cannot resume)")
    net = body.network
    if net is not None:
        out += unsupported_egress(net)
        if net.https_ports:
            out.append("network.httpsPorts is not supported yet (the proxy speaks plain HTTP to sandboxes); omit it")
        if net.mask_request_host is not None and not _HOST_MASK.fullmatch(net.mask_request_host):
            out.append("network.maskRequestHost must be a host[:port] (letters, digits, '.', '-', '${PORT}')")
    if body.mcp:
        out.append("mcp (an MCP gateway in the sandbox) is not supported")
    if body.iam and body.iam.get("tokens"):
        out.append("iam.tokens (workload identity) is not supported")
    return out


class TimeoutBody(_Strict):
    """``POST /sandboxes/{id}/timeout``: ``timeout`` seconds from now."""

    timeout: int = Field(ge=0, le=86400)


class RefreshBody(_Strict):
    """``POST /sandboxes/{id}/refreshes``: extend by ``duration`` seconds (≤ 3600)."""

    duration: int | None = Field(default=None, ge=0, le=3600)


class ConnectBody(_Strict):
    """``POST /sandboxes/{id}/connect``: new ``timeout`` in seconds; ``memory`` (E2B
    ``ConnectSandbox.memory``, default true; false = resume from disk state only)."""

    timeout: int = Field(default=300, ge=0, le=86400)
    memory: bool | None = None


def sandbox_created(rec: SandboxRecord, domain: str | None = None) -> dict:
    """``Sandbox`` body returned by create/connect (201/200); ``domain`` (the server's
    public sandbox domain) makes the SDKs' ``get_host(port)`` = ``PORT-ID.domain``."""
    d = {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "envdVersion": ENVD_VERSION,
        "alias": rec.template_id,
    }
    if rec.envd_access_token:
        d["envdAccessToken"] = rec.envd_access_token
    if domain:
        d["domain"] = domain
    if rec.traffic_token:
        d["trafficAccessToken"] = rec.traffic_token
    return d


#: Record states the API shows as ``paused``: E2B's API reports a sandbox that is being
#: paused as paused (it "behaves like a paused sandbox": connect resumes it), so a
#: ``get_info()`` right after a timeout auto-pause began does not say ``running``.
PAUSED_STATES = ("paused", "pausing")


def visible_state(rec: SandboxRecord) -> str:
    """The E2B ``SandboxState`` of ``rec``: ``paused`` for a paused or pausing sandbox,
    else ``running``."""
    return "paused" if rec.state in PAUSED_STATES else "running"


def sandbox_listed(rec: SandboxRecord) -> dict:
    """``ListedSandbox`` body (list endpoints)."""
    return {
        "templateID": rec.template_id,
        "alias": rec.template_id,
        "sandboxID": rec.id,
        "clientID": rec.client_id,
        "startedAt": rfc3339(rec.started_at),
        "endAt": rfc3339(rec.end_at),
        "cpuCount": rec.vcpus,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_mb,
        "state": visible_state(rec),
        "envdVersion": ENVD_VERSION,
        "metadata": rec.metadata,
    }


def sandbox_detail(rec: SandboxRecord, domain: str | None = None) -> dict:
    """``SandboxDetail`` body (``GET /sandboxes/{id}``), with the public ``domain``."""
    d = sandbox_listed(rec)
    if domain:
        d["domain"] = domain
    d["lifecycle"] = {"autoResume": rec.auto_resume, "onTimeout": "pause" if rec.auto_pause else "kill"}
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
    """``POST /sandboxes/{id}/snapshots``: optional ``name``; ``memory`` (default true;
    false = a filesystem-only snapshot, E2B's ``mode="filesystem"``)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")  # an unknown field is a 400

    name: str | None = Field(default=None, max_length=64)
    memory: bool | None = None


class PauseBody(_Strict):
    """``POST /sandboxes/{id}/pause`` (E2B ``SandboxPauseRequest``): ``memory`` (default
    true; false = a filesystem-only pause: resume cold-boots over the saved files) and
    ``requireHealthyGuest`` (default false; true = 503 unless envd answers first)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")  # an unknown field is a 400

    memory: bool | None = None
    require_healthy_guest: bool | None = Field(default=None, alias="requireHealthyGuest")


def snapshot_info(meta) -> dict:
    """E2B ``SnapshotInfo`` body plus forkyard extras (source, size, creation time)."""
    return {
        "snapshotID": meta.snapshot_id,
        "names": meta.names,
        "sandboxID": meta.source_sandbox_id,
        "templateID": meta.template_id,
        "sizeBytes": meta.size_bytes,
        "createdAt": rfc3339(meta.created_at),
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
