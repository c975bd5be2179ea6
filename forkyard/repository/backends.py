"""Object backends of the committed repository: ``posix_fs`` and ``s3``.

Both expose the same tiny key/value interface (keys are ``/``-separated relative
names such as ``chunks/ab/ab12…`` or ``manifests/<id>.json``):

* :meth:`Backend.put` — whole-object write; ``exclusive=True`` creates only when the key
  is absent (posix: write a temporary file, fsync, ``link()`` it to the final name, which
  fails atomically when the name exists; S3: ``PutObject`` with ``If-None-Match: *``).
  A reader never sees a partial object on either backend.
* :meth:`Backend.get`, :meth:`Backend.exists`, :meth:`Backend.delete`,
  :meth:`Backend.list` (key, size in bytes, modification time in UNIX seconds).
* :meth:`Backend.barrier` — makes earlier non-exclusive puts durable (posix: fsync of the
  directories that received new names; S3: nothing, a PUT is durable when it returns).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from forkyard.repository.errors import (
    ObjectMissing,
    RepositoryConfigError,
    RepositoryError,
)

_TMP = ".tmp-"


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: ``key``, ``size`` (bytes), ``mtime`` (UNIX seconds)."""

    key: str
    size: int
    mtime: float


class Backend(ABC):
    """Key/value object store holding the committed repository.

    Attributes:
        kind: ``"posix_fs"`` or ``"s3"``.
        location: human-readable location (directory or ``s3://bucket/prefix``).

    Every method raises :class:`~forkyard.repository.errors.RepositoryError` (or a
    subclass) on I/O or backend failure.
    """

    kind: str = ""
    location: str = ""

    @abstractmethod
    def put(self, key: str, data: bytes, exclusive: bool = False) -> bool:
        """Store ``data`` under ``key`` atomically. With ``exclusive`` only when ``key``
        is absent. Returns False when ``exclusive`` and the key already exists, else
        True."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes. Raises :class:`ObjectMissing` when absent."""

    @abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; False when it was absent (posix) or unknown (S3 may say True)."""

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with ``prefix`` (a directory-style prefix ending
        in ``/``), in no particular order."""

    def barrier(self, keys: Iterable[str]) -> None:
        """Make earlier puts of ``keys`` durable (crash-safe) before something refers to
        them."""

    def cleanup_temporary(self, older_than_s: float) -> int:
        """Remove temporary objects left by interrupted writes that are older than
        ``older_than_s`` seconds; returns how many."""
        return 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixBackend(Backend):
    """Objects as files under ``root`` (a local directory or a shared mount).

    Writes go to ``<dir>/.tmp-<random>`` (fsync) and are renamed (or, exclusive,
    ``link()``-ed) to their final name; the directory is fsynced by :meth:`barrier`
    (chunks, batched) or right away (exclusive puts: manifests, leases, locks).
    """

    kind = "posix_fs"

    def __init__(self, root: Path):
        self.root = Path(root)
        self.location = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RepositoryConfigError(f"cannot create repository directory {self.root}: {e}") from e
        self._dirs: set[Path] = set()
        self._dirs_lock = threading.Lock()

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise RepositoryError(f"bad object key {key!r}")
        return self.root / key

    def _mkdir(self, d: Path) -> None:
        if d in self._dirs:
            return
        d.mkdir(parents=True, exist_ok=True)
        with self._dirs_lock:
            self._dirs.add(d)

    def put(self, key: str, data: bytes, exclusive: bool = False) -> bool:
        final = self._path(key)
        try:
            self._mkdir(final.parent)
            tmp = final.parent / f"{_TMP}{secrets.token_hex(8)}"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                if exclusive:
                    try:
                        os.link(tmp, final)
                    except FileExistsError:
                        return False
                    finally:
                        os.unlink(tmp)
                    _fsync_dir(final.parent)
                else:
                    os.replace(tmp, final)
            except BaseException:
                if tmp.exists():
                    tmp.unlink()
                raise
            return True
        except OSError as e:
            raise RepositoryError(f"writing {final} failed: {e}") from e

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectMissing(key) from None
        except OSError as e:
            raise RepositoryError(f"reading {path} failed: {e}") from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as e:
            raise RepositoryError(f"deleting {path} failed: {e}") from e
        return True

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/")) if prefix.strip("/") else self.root
        if not base.is_dir():
            return
        stack = [base]
        while stack:
            d = stack.pop()
            try:
                entries = list(os.scandir(d))
            except FileNotFoundError:
                continue
            for e in entries:
                if e.name.startswith(_TMP):
                    continue
                try:
                    if e.is_dir(follow_symlinks=False):
                        stack.append(Path(e.path))
                    elif e.is_file(follow_symlinks=False):
                        st = e.stat(follow_symlinks=False)
                        key = os.path.relpath(e.path, self.root).replace(os.sep, "/")
                        yield ObjectInfo(key, st.st_size, st.st_mtime)
                except FileNotFoundError:
                    continue

    def barrier(self, keys: Iterable[str]) -> None:
        dirs = {self._path(k).parent for k in keys}
        try:
            for d in dirs:
                _fsync_dir(d)
            parents = {d.parent for d in dirs} - dirs
            for d in parents:  # new fan-out directories themselves
                _fsync_dir(d)
        except OSError as e:
            raise RepositoryError(f"fsync of repository directories failed: {e}") from e

    def cleanup_temporary(self, older_than_s: float) -> int:
        n, cutoff = 0, time.time() - older_than_s
        for dirpath, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(_TMP):
                    p = Path(dirpath) / name
                    try:
                        if p.stat().st_mtime < cutoff:
                            p.unlink()
                            n += 1
                    except FileNotFoundError:
                        pass
        return n


class S3Backend(Backend):
    """Objects in an S3-compatible bucket under ``prefix`` (boto3).

    Args:
        bucket, prefix: where (``prefix`` may be empty; a trailing ``/`` is added).
        endpoint: endpoint URL (e.g. ``http://127.0.0.1:9000``).
        region: region name (required; S3 signatures depend on it).
        access_key, secret_key: credentials (required; never read from elsewhere).

    Raises:
        RepositoryConfigError: the bucket cannot be reached or does not exist.
    """

    kind = "s3"

    def __init__(self, bucket: str, prefix: str, endpoint: str, region: str, access_key: str, secret_key: str,
                 max_connections: int = 32):
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.location = f"s3://{bucket}/{self.prefix}"
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, region_name=region, aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            config=Config(max_pool_connections=max_connections, retries={"max_attempts": 5, "mode": "standard"},
                          s3={"addressing_style": "path"}, connect_timeout=10, read_timeout=60),
        )
        from botocore.exceptions import BotoCoreError, ClientError

        self._ClientError = ClientError
        self._Errors = (ClientError, BotoCoreError)
        self._check_bucket(endpoint, region, access_key)

    #: What to do about each S3 error code at startup (codes: AWS S3 API reference,
    #: "Error responses"; the same ones MinIO sends).
    _ADVICE = {
        "InvalidAccessKeyId": "the server does not know access key {key!r}: check AWS_ACCESS_KEY_ID",
        "SignatureDoesNotMatch": "the server rejected the request signature: check AWS_SECRET_ACCESS_KEY",
        "AccessDenied": "access key {key!r} may not use this bucket: grant it s3:ListBucket, "
                        "s3:GetObject, s3:PutObject and s3:DeleteObject",
        "AuthorizationHeaderMalformed": "the server refused the signing region {region!r}: "
                                        "set FORKYARD_S3_REGION to the bucket's region",
        "NoSuchBucket": "the bucket does not exist: create it (e.g. `aws s3 mb s3://{bucket}` or "
                        "`mc mb ALIAS/{bucket}`) or fix the bucket in FORKYARD_REPO",
    }

    def _check_bucket(self, endpoint: str, region: str, access_key: str) -> None:
        """Fail at startup, with what to do, unless the bucket exists, the credentials
        work and ``region`` is the bucket's region.

        HEAD answers carry no error body, so a refused HEAD is repeated as a one-key
        listing whose XML error names the cause. A bucket in another region than
        ``region`` is refused even when the server would accept it (botocore redirects
        such requests, costing a round trip each; signatures belong to one region).

        Raises:
            RepositoryConfigError: the message names the setting to fix.
        """
        where = f"S3 bucket {self.bucket!r} at {endpoint}"
        try:
            head = self._client.head_bucket(Bucket=self.bucket)
        except self._Errors as e:
            if not isinstance(e, self._ClientError):
                raise RepositoryConfigError(f"{where} cannot be reached ({e}): check FORKYARD_S3_ENDPOINT "
                                            "and that the S3 server is running") from e
            try:
                self._client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
                err = e
            except self._Errors as e2:
                err = e2
            code = self._code(err) or self._code(e)
            if code in ("404", "NotFound"):
                code = "NoSuchBucket"
            advice = self._ADVICE.get(code, "").format(key=access_key, region=region, bucket=self.bucket)
            raise RepositoryConfigError(f"{where} is not usable: {advice or err} ({code})") from e
        actual = head.get("BucketRegion") or head["ResponseMetadata"]["HTTPHeaders"].get("x-amz-bucket-region")
        if actual and actual != region:
            raise RepositoryConfigError(f"{where} is in region {actual!r}, not FORKYARD_S3_REGION={region!r}: "
                                        f"set FORKYARD_S3_REGION={actual}")

    def _code(self, e: Exception) -> str:
        if isinstance(e, self._ClientError):
            return str(e.response.get("Error", {}).get("Code", ""))
        return ""

    def put(self, key: str, data: bytes, exclusive: bool = False) -> bool:
        kwargs = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self.prefix + key, Body=data, **kwargs)
        except self._Errors as e:
            if exclusive and self._code(e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise RepositoryError(f"S3 put of {key} failed: {e}") from e
        return True

    def get(self, key: str) -> bytes:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)["Body"].read()
        except self._Errors as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                raise ObjectMissing(key) from None
            raise RepositoryError(f"S3 get of {key} failed: {e}") from e

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self.prefix + key)
            return True
        except self._Errors as e:
            if self._code(e) in ("NoSuchKey", "404", "NotFound"):
                return False
            raise RepositoryError(f"S3 head of {key} failed: {e}") from e

    def delete(self, key: str) -> bool:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self.prefix + key)
        except self._Errors as e:
            raise RepositoryError(f"S3 delete of {key} failed: {e}") from e
        return True

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", []):
                    yield ObjectInfo(obj["Key"][len(self.prefix):], int(obj["Size"]), obj["LastModified"].timestamp())
        except self._Errors as e:
            raise RepositoryError(f"S3 list of {prefix} failed: {e}") from e
