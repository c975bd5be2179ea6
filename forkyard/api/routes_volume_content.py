"""The E2B volume content API as the e2b SDK's ``Volume`` instance methods call it (e2b
2.63 ``e2b/volume/client/api/volumes``), on the node's own address: point the SDK at it
with ``E2B_VOLUME_API_URL`` (or ``api_url=``). Authorization: ``Bearer <the volume's
token>`` (``Volume.create``/``get_info`` give it), checked before any body byte is read;
the API key is not accepted here (as on E2B: the token is the volume's own).

* ``GET /volumecontent/{id}/path?path=`` → 200 entry; ``PATCH`` (``{uid, gid, mode}``)
  → 200 entry; ``DELETE`` → 204;
* ``GET /volumecontent/{id}/dir?path=&depth=`` → 200 ``[entry]``; ``POST`` (``uid, gid,
  mode, force`` in the query) → 201 entry;
* ``GET /volumecontent/{id}/file?path=`` → 200 the bytes; ``PUT`` (raw body) → 201 entry.

404: unknown path; 400: bad path or depth; 401: wrong token; 507: the volume is full.
Bodies are bounded by ``FORKYARD_MAX_UPLOAD_MB`` (:mod:`forkyard.api.limits`) and by the
volume's size. File operations: :mod:`forkyard.orchestrator.volumes.content`.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from forkyard.orchestrator.volumes.content import CHUNK, VolumeFiles


async def _files(request: Request, volume_id: str) -> VolumeFiles:
    """The volume's files when the request's bearer token is the volume's (else 401)."""
    vols = request.app.state.orchestrator.volumes
    auth = request.headers.get("authorization", "")
    token = auth[7:] if auth[:7].lower() == "bearer " else ""
    if not token or not await asyncio.to_thread(vols.check_token, volume_id, token):
        raise HTTPException(401, "invalid volume token: send Authorization: Bearer <token of this volume>")
    rec = await asyncio.to_thread(vols.get, volume_id)
    return VolumeFiles(await asyncio.to_thread(vols.ensure_mounted, rec))


router = APIRouter(prefix="/volumecontent/{volume_id}")
_Files = Depends(_files)


class Metadata(BaseModel):
    """``PATCH …/path`` body (E2B ``PatchVolumecontentVolumeIDPathBody``)."""

    model_config = ConfigDict(extra="forbid")
    uid: int | None = Field(default=None, ge=0, le=2**32 - 2)
    gid: int | None = Field(default=None, ge=0, le=2**32 - 2)
    mode: int | None = Field(default=None, ge=0, le=0o7777)


_ID = Query(default=None, ge=0, le=2**32 - 2)
_MODE = Query(default=None, ge=0, le=0o7777)


@router.get("/path")
async def get_path(path: str, files: VolumeFiles = _Files):
    """The entry at ``path``."""
    return await asyncio.to_thread(files.stat, path)


@router.patch("/path")
async def patch_path(path: str, body: Metadata, files: VolumeFiles = _Files):
    """Change owner and/or mode."""
    return await asyncio.to_thread(files.update, path, body.uid, body.gid, body.mode)


@router.delete("/path", status_code=204)
async def delete_path(path: str, files: VolumeFiles = _Files):
    """Remove a file, link or directory tree."""
    await asyncio.to_thread(files.remove, path)
    return Response(status_code=204)


@router.get("/dir")
async def get_dir(path: str, depth: int = Query(default=1), files: VolumeFiles = _Files):
    """List a directory ``depth`` levels deep."""
    return await asyncio.to_thread(files.list, path, depth)


@router.post("/dir", status_code=201)
async def post_dir(path: str, uid: int | None = _ID, gid: int | None = _ID, mode: int | None = _MODE,
                   force: bool = False, files: VolumeFiles = _Files):
    """Make a directory (``force``: with its parents)."""
    return JSONResponse(await asyncio.to_thread(files.make_dir, path, uid, gid, mode, force), status_code=201)


@router.get("/file")
async def get_file(path: str, files: VolumeFiles = _Files):
    """The file's bytes, streamed."""
    fd = await asyncio.to_thread(files.open_read, path)

    async def chunks():
        try:
            while data := await asyncio.to_thread(os.read, fd, CHUNK):
                yield data
        finally:
            os.close(fd)

    return StreamingResponse(chunks(), media_type="application/octet-stream",
                             headers={"content-length": str(os.fstat(fd).st_size)})


@router.put("/file", status_code=201)
async def put_file(request: Request, path: str, uid: int | None = _ID, gid: int | None = _ID,
                   mode: int | None = _MODE, force: bool = False, files: VolumeFiles = _Files):
    """Write the raw body to ``path`` (replacing it), streamed to disk from a thread."""
    q: queue.Queue = queue.Queue(maxsize=8)

    def feed():
        while (chunk := q.get()) is not None:
            yield chunk

    result: dict = {}

    def write():
        try:
            result["entry"] = files.write(path, feed(), uid, gid, mode, force)
        except BaseException as e:  # noqa: BLE001 — re-raised on the loop
            result["error"] = e
            while q.get() is not None:  # drain so the producer never blocks
                pass

    worker = threading.Thread(target=write, name="volume-put", daemon=True)
    worker.start()
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(q.put, chunk)
    finally:
        await asyncio.to_thread(q.put, None)
        await asyncio.to_thread(worker.join)
    if "error" in result:
        raise result["error"]
    return JSONResponse(result["entry"], status_code=201)

