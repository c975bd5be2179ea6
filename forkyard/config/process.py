"""Settings every kind of forkyard process reads: logs, tracing and metrics
(:class:`ObsSettings`), where the client finds a server (:class:`ClientSettings`),
bounds on client connections (:class:`ProxySettings`), the snapshot repository
(:class:`RepositorySettings`) and the client's cache directory."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from forkyard.config._env import _env


@dataclass(frozen=True)
class ObsSettings:
    """Observability settings of every component (:mod:`forkyard.obs`).

    Attributes:
        log_format: ``FORKYARD_LOG_FORMAT``: ``json``, ``text`` or ``auto`` (default:
            text on a terminal, else JSON lines).
        tracing: ``FORKYARD_TRACING``: ``off`` (default) or ``otlp``.
        metrics_token: ``FORKYARD_METRICS_TOKEN``: the bearer token a ``/metrics``
            scrape may present ("" when unset).
        metrics_token_file: ``FORKYARD_METRICS_TOKEN_FILE``: a file holding that token.
    """

    log_format: str = field(default_factory=lambda: _env("FORKYARD_LOG_FORMAT", "auto"))
    tracing: str = field(default_factory=lambda: _env("FORKYARD_TRACING", "off"))
    metrics_token: str = field(default_factory=lambda: _env("FORKYARD_METRICS_TOKEN"), repr=False)
    metrics_token_file: str = field(default_factory=lambda: _env("FORKYARD_METRICS_TOKEN_FILE"))


@dataclass(frozen=True)
class ClientSettings:
    """What the client and the CLI read from the environment, each variable's text ("" when
    unset); :func:`forkyard.client.config.resolve` says in which order they count.

    Attributes:
        url: ``FORKYARD_URL``; e2b_api_url: ``E2B_API_URL``; sandbox_url:
            ``E2B_SANDBOX_URL`` (envd traffic; default the API URL).
        e2b_api_key: ``E2B_API_KEY``; api_key: ``FORKYARD_API_KEY``.
        port: ``FORKYARD_PORT`` (a local server's, when nothing else names one).
        data_dir: ``FORKYARD_DATA_DIR`` (default ``/var/lib/forkyard``): a local server's
            key file is ``<data_dir>/api_key``.
        config_file: ``FORKYARD_CONFIG``: the file ``forkyard auth`` writes.
        xdg_config_home: ``XDG_CONFIG_HOME``: where that file is by default.
    """

    url: str = field(default_factory=lambda: _env("FORKYARD_URL"))
    e2b_api_url: str = field(default_factory=lambda: _env("E2B_API_URL"))
    sandbox_url: str = field(default_factory=lambda: _env("E2B_SANDBOX_URL"))
    e2b_api_key: str = field(default_factory=lambda: _env("E2B_API_KEY"), repr=False)
    api_key: str = field(default_factory=lambda: _env("FORKYARD_API_KEY"), repr=False)
    port: str = field(default_factory=lambda: _env("FORKYARD_PORT"))
    data_dir: str = field(default_factory=lambda: _env("FORKYARD_DATA_DIR", "/var/lib/forkyard"))
    config_file: str = field(default_factory=lambda: _env("FORKYARD_CONFIG"))
    xdg_config_home: str = field(default_factory=lambda: _env("XDG_CONFIG_HOME"))


@dataclass(frozen=True)
class ProxySettings:
    """Bounds on client connections of every HTTP server forkyard runs (node, gateway:
    :func:`forkyard.api.limits.uvicorn_limits`).

    Attributes:
        header_timeout_s: ``FORKYARD_HEADER_TIMEOUT_S`` (20): a request head must be
            complete this long after the connection opened or the previous response (s;
            nginx's ``client_header_timeout`` default is 60 s).
        max_connections_per_client: ``FORKYARD_MAX_CONNECTIONS_PER_CLIENT`` (1024): open
            connections one client address may hold (raise it on a node behind a busy
            gateway, whose traffic all comes from one address).
        max_connections: ``FORKYARD_MAX_CONNECTIONS`` (4096): open connections + running
            requests in all; beyond it uvicorn answers 503.
    """

    header_timeout_s: float = field(default_factory=lambda: float(_env("FORKYARD_HEADER_TIMEOUT_S", "20")))
    max_connections_per_client: int = field(
        default_factory=lambda: int(_env("FORKYARD_MAX_CONNECTIONS_PER_CLIENT", "1024")))
    max_connections: int = field(default_factory=lambda: int(_env("FORKYARD_MAX_CONNECTIONS", "4096")))


@dataclass(frozen=True)
class RepositorySettings:
    """Where snapshots are committed and how big the node's cache may grow, as given in
    the environment (:class:`forkyard.repository.config.RepoConfig` checks them and opens
    the backend). Read from ``env`` when given (tests), else the process environment.

    Attributes:
        repo: ``FORKYARD_REPO``: a directory or ``s3://bucket/prefix`` ("" when unset:
            the node's own ``<data>/snapshots/repository``).
        s3_endpoint / s3_region: ``FORKYARD_S3_ENDPOINT`` / ``FORKYARD_S3_REGION``
            (required for ``s3://``; no default region on purpose).
        access_key / secret_key: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
            (required for ``s3://``; nothing else is consulted: no profiles, no instance
            metadata).
        cache_bytes: ``FORKYARD_CACHE_BYTES`` as given (None when unset: 10 GiB).
        gc_grace_s: ``FORKYARD_GC_GRACE_S`` as given (None when unset: 3600 s).
    """

    repo: str = ""
    s3_endpoint: str = ""
    s3_region: str = ""
    access_key: str = field(default="", repr=False)
    secret_key: str = field(default="", repr=False)
    cache_bytes: str | None = None
    gc_grace_s: str | None = None

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None) -> RepositorySettings:
        """The settings in ``env`` (default: the process environment)."""
        env = os.environ if env is None else env
        return cls(repo=env.get("FORKYARD_REPO", ""), s3_endpoint=env.get("FORKYARD_S3_ENDPOINT", ""),
                   s3_region=env.get("FORKYARD_S3_REGION", ""), access_key=env.get("AWS_ACCESS_KEY_ID", ""),
                   secret_key=env.get("AWS_SECRET_ACCESS_KEY", ""), cache_bytes=env.get("FORKYARD_CACHE_BYTES"),
                   gc_grace_s=env.get("FORKYARD_GC_GRACE_S"))


def user_cache_dir() -> Path:
    """Where the CLI keeps downloads on the client's host (``forkyard template add``):
    ``$XDG_CACHE_HOME/forkyard``, else ``~/.cache/forkyard`` (XDG Base Directory spec)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "forkyard"
