"""Repository settings (read from the environment by
:class:`forkyard.config.RepositorySettings`), checked, and the backend they name.

=========================  ================================================================
``FORKYARD_REPO``          committed repository: a directory (``posix_fs``, default
                           ``<data>/snapshots/repository``) or ``s3://bucket/prefix``
``FORKYARD_S3_ENDPOINT``   S3 endpoint URL (required for ``s3://``)
``FORKYARD_S3_REGION``     S3 region (required for ``s3://``; no default on purpose)
``AWS_ACCESS_KEY_ID``      S3 credentials (required for ``s3://``; nothing else is
``AWS_SECRET_ACCESS_KEY``  consulted: no profiles, no instance metadata)
``FORKYARD_CACHE_BYTES``   node-local cache bound in bytes (default 10 GiB; accepts a
                           plain integer)
``FORKYARD_GC_GRACE_S``    chunks younger than this are never collected (default 3600)
=========================  ================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from forkyard.config import RepositorySettings
from forkyard.repository.backends import Backend, PosixBackend, S3Backend
from forkyard.repository.errors import RepositoryConfigError

DEFAULT_CACHE_BYTES = 10 << 30
DEFAULT_GC_GRACE_S = 3600.0


@dataclass
class RepoConfig:
    """Where the repository and the cache live and how big the cache may grow.

    Attributes:
        url: directory path or ``s3://bucket/prefix``.
        s3_endpoint, s3_region, access_key, secret_key: S3 settings (``s3://`` only).
        cache_bytes: node-local cache bound (bytes, > 0).
        gc_grace_s: GC never removes chunks younger than this (seconds).
    """

    url: str
    s3_endpoint: str | None = None
    s3_region: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    cache_bytes: int = DEFAULT_CACHE_BYTES
    gc_grace_s: float = DEFAULT_GC_GRACE_S

    @classmethod
    def from_env(cls, default_dir: Path, env: Mapping[str, str] | None = None) -> RepoConfig:
        """Settings from ``env`` (default: the process environment, read by
        :class:`forkyard.config.RepositorySettings`); ``default_dir`` is the posix
        repository used when ``FORKYARD_REPO`` is unset.

        Raises:
            RepositoryConfigError: a malformed number.
        """
        return cls.from_settings(RepositorySettings.read(env), default_dir)

    @classmethod
    def from_settings(cls, given: RepositorySettings, default_dir: Path) -> RepoConfig:
        """The checked configuration of ``given``; ``default_dir`` as for :meth:`from_env`.

        Raises:
            RepositoryConfigError: a malformed number.
        """
        try:
            cache = int(DEFAULT_CACHE_BYTES if given.cache_bytes is None else given.cache_bytes)
            grace = float(DEFAULT_GC_GRACE_S if given.gc_grace_s is None else given.gc_grace_s)
        except ValueError as e:
            raise RepositoryConfigError(f"FORKYARD_CACHE_BYTES / FORKYARD_GC_GRACE_S must be numbers: {e}") from e
        if cache <= 0:
            raise RepositoryConfigError("FORKYARD_CACHE_BYTES must be a positive number of bytes")
        return cls(
            url=given.repo or str(default_dir),
            s3_endpoint=given.s3_endpoint or None,
            s3_region=given.s3_region or None,
            access_key=given.access_key or None,
            secret_key=given.secret_key or None,
            cache_bytes=cache,
            gc_grace_s=grace,
        )

    def open_backend(self) -> Backend:
        """The backend ``url`` names.

        Raises:
            RepositoryConfigError: ``s3://`` without bucket, endpoint, region or
                credentials (all named in the message), or an unusable bucket/directory.
        """
        if self.url.startswith("s3://"):
            bucket, _, prefix = self.url[5:].partition("/")
            missing = [name for name, v in (("bucket in FORKYARD_REPO (s3://BUCKET/prefix)", bucket),
                                            ("FORKYARD_S3_ENDPOINT", self.s3_endpoint),
                                            ("FORKYARD_S3_REGION", self.s3_region),
                                            ("AWS_ACCESS_KEY_ID", self.access_key),
                                            ("AWS_SECRET_ACCESS_KEY", self.secret_key)) if not v]
            if missing:
                raise RepositoryConfigError(f"s3 repository {self.url}: missing {', '.join(missing)}")
            return S3Backend(bucket, prefix, self.s3_endpoint, self.s3_region, self.access_key, self.secret_key)
        if "://" in self.url:
            raise RepositoryConfigError(f"unsupported repository URL {self.url!r} (a directory or s3://bucket/prefix)")
        return PosixBackend(Path(self.url).expanduser().resolve())
