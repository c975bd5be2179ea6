"""E2B volume routes as the official SDK's ``Volume`` calls them (e2b 2.63
``e2b/api/client/api/volumes``; storage: :mod:`forkyard.orchestrator.volumes.store`).

* ``POST /volumes`` ``{name}`` → 201 ``{volumeID, name, token}`` (400 bad name or the
  node's limit, 409 name taken);
* ``GET /volumes`` → 200 ``[{volumeID, name}]``;
* ``GET /volumes/{volumeID}`` → 200 ``{volumeID, name, token}`` (404);
* ``DELETE /volumes/{volumeID}`` → 204 (404; 409 while a sandbox mounts it).

All need the API key (``X-API-Key``). The content API (``/volumecontent/…``, the
volume's own token) is :mod:`forkyard.api.routes_volume_content`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from forkyard.api.auth import require_key

router = APIRouter(dependencies=[Depends(require_key)])


class NewVolume(BaseModel):
    """``POST /volumes`` body (E2B ``NewVolume``)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=64)


def _with_token(rec) -> dict:
    return {"volumeID": rec.id, "name": rec.name, "token": rec.token}


@router.post("/volumes", status_code=201)
async def create_volume(request: Request, body: NewVolume):
    """Create a volume (its image and row are made in the volumes directory, shared by
    every node of a cluster; mounted here on a single node, where it is used in a cluster)."""
    rec = await asyncio.to_thread(request.app.state.orchestrator.volumes.create, body.name)
    return JSONResponse(_with_token(rec), status_code=201)


@router.get("/volumes")
async def list_volumes(request: Request):
    """Every volume (of the cluster, when the volumes directory is shared), oldest first."""
    recs = await asyncio.to_thread(request.app.state.orchestrator.volumes.all)
    return [{"volumeID": r.id, "name": r.name} for r in recs]


@router.get("/volumes/{volume_id}")
async def get_volume(request: Request, volume_id: str):
    """One volume with its content-API token."""
    return _with_token(await asyncio.to_thread(request.app.state.orchestrator.volumes.get, volume_id))


@router.delete("/volumes/{volume_id}", status_code=204)
async def delete_volume(request: Request, volume_id: str):
    """Destroy a volume and its files (409 while any sandbox, running or paused, mounts it)."""
    orch = request.app.state.orchestrator
    in_use = any(m["id"] == volume_id for r in orch.records() for m in r.volume_mounts)
    await asyncio.to_thread(orch.volumes.destroy, volume_id, in_use)
    return Response(status_code=204)
