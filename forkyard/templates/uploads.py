"""Build contexts: the tarballs ``COPY`` steps read, uploaded by the SDK to a signed URL
(E2B ``GET /templates/{id}/files/{hash}`` hands it out) and stored by their SHA-256 under
``<data_dir>/template-files/<sha256>.tar``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import re
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from forkyard.config import Settings
from forkyard.orchestrator.errors import BadRequest, Conflict
from forkyard.templates import unpack

_HASH = re.compile(r"^[0-9a-f]{64}$")
#: How long a COPY upload URL (``GET /templates/{id}/files/{hash}``) stays valid (s);
#: the SDK uploads right after asking. It is good for one upload: a stored tarball is
#: never replaced.
UPLOAD_URL_TTL_S = 3600


class Uploads:
    """Stored build contexts of one node.

    Args:
        settings: ``data_dir`` (where they are kept) and the unpack limits.
        secret: key signing upload URLs.
    """

    def __init__(self, settings: Settings, secret: str):
        self.settings = settings
        self._secret = secret.encode()
        self.files_dir = settings.data_dir / "template-files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        for f in self.files_dir.glob("*.partial"):
            f.unlink(missing_ok=True)

    def file_path(self, files_hash: str) -> Path:
        """Where the tarball of ``files_hash`` is (or will be) stored.

        Raises:
            BadRequest: not a lower-case hex SHA-256.
        """
        if not _HASH.match(files_hash or ""):
            raise BadRequest("files hash must be 64 lower-case hex digits (SHA-256)")
        return self.files_dir / f"{files_hash}.tar"

    def upload_token(self, files_hash: str, now: float | None = None) -> str:
        """Signature that authorises one upload of ``files_hash`` without the API key
        until :data:`UPLOAD_URL_TTL_S` from now: ``<expiry unix s>-<HMAC-SHA256 hex>``."""
        exp = int((time.time() if now is None else now) + UPLOAD_URL_TTL_S)
        mac = hmac.new(self._secret, f"{files_hash}:{exp}".encode(), hashlib.sha256).hexdigest()
        return f"{exp}-{mac}"

    def check_upload_token(self, files_hash: str, token: str) -> bool:
        """True when ``token`` is an :meth:`upload_token` of ``files_hash`` that has not expired."""
        exp, _, mac = (token or "").partition("-")
        if not exp.isdigit() or int(exp) < time.time():
            return False
        want = hmac.new(self._secret, f"{files_hash}:{exp}".encode(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, mac)

    async def store_upload(self, files_hash: str, chunks: AsyncIterator[bytes], max_bytes: int) -> int:
        """Store an uploaded (optionally gzipped) tarball for ``files_hash``; returns its size.

        It is read through once as a stream before it is kept: member paths must stay
        in the build context, and what it unpacks to must be within the limits of
        :mod:`forkyard.templates.unpack` (the build sandbox unpacks it; the server only
        streams it there, never whole in memory).

        Raises:
            unpack.LimitExceeded: body larger than ``max_bytes`` (``FORKYARD_MAX_UPLOAD_MB``)
                or unpacking past a limit (413).
            BadRequest: not a readable tar archive, or a member path leaves the context.
            Conflict: ``files_hash`` is stored already (uploads are never replaced).
        """
        dest = self.file_path(files_hash)
        if dest.exists():
            raise Conflict(f"files {files_hash} were uploaded already")
        tmp = dest.with_name(f"{dest.name}.{secrets.token_hex(4)}.partial")
        size = 0
        try:
            with open(tmp, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise unpack.LimitExceeded("FORKYARD_MAX_UPLOAD_MB", f"upload larger than {max_bytes} bytes")
                    f.write(chunk)
            try:
                await asyncio.to_thread(self._check_tar, tmp, unpack.Limits.from_settings(self.settings))
            except (unpack.ArchiveError, ValueError) as e:
                raise BadRequest(f"upload is not a usable tar archive: {e}") from e
            try:
                os.link(tmp, dest)  # never replaces: the first complete upload of a hash wins
            except FileExistsError:
                raise Conflict(f"files {files_hash} were uploaded already") from None
        finally:
            tmp.unlink(missing_ok=True)
        return size

    @staticmethod
    def _check_tar(path: Path, limits: unpack.Limits) -> None:
        with open(path, "rb") as f:
            for m, _ in unpack.members(f, unpack.Meter(limits)):
                if m.name.startswith("/") or ".." in Path(m.name).parts:
                    raise ValueError(f"unsafe member path {m.name!r}")


async def plain_tar(path: Path, max_bytes: int) -> AsyncIterator[bytes]:
    """The tarball at ``path`` as a stream of plain tar chunks (gunzipped as read, in a
    worker thread; at most ``max_bytes`` of them), never whole in memory.

    Raises:
        unpack.LimitExceeded: it decompresses to more than ``max_bytes``.
    """
    f = await asyncio.to_thread(open, path, "rb")
    try:
        stream = unpack.decompressed(f)
        total = 0
        while chunk := await asyncio.to_thread(stream.read, 1 << 20):
            total += len(chunk)
            if total > max_bytes:
                raise unpack.LimitExceeded("FORKYARD_MAX_UNPACKED_MB", f"the upload decompresses to more than {max_bytes} bytes")
            yield chunk
    finally:
        f.close()
