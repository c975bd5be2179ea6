"""E2B template build routes (as the official SDK's ``Template.build`` calls them) and
image import.

Flow of ``Template.build(template, "name")`` (e2b ``template_sync/build_api.py``):

1. ``POST /v3/templates`` ``{name, tags?, cpuCount?, memoryMB?, diskSizeMB?}`` → 202
   (``diskSizeMB`` is forkyard's: E2B sizes disks per team, and shows the size);
   ``{templateID, buildID, public, names, tags, aliases}``;
2. per ``COPY`` step ``GET /templates/{id}/files/{hash}`` → 201 ``{present, url?}``; when
   not present the SDK ``PUT``s the (gzipped) tarball to ``url`` — here
   ``/template-files/{hash}?token=…`` on this server, signed so no API key is needed;
3. ``POST /v2/templates/{id}/builds/{buildID}`` with the steps → 202; the build runs in
   the background (:mod:`forkyard.templates.build`);
4. ``GET /templates/{id}/builds/{buildID}/status?logsOffset=N`` → ``{status, logEntries,
   logs, reason?}`` until ``ready`` / ``error``.

Also: ``GET /templates/aliases/{alias}`` (``Template.exists``), ``GET`` / ``DELETE
/templates/{id}``, ``GET /v2/templates``, and ``POST /templates/import?name=NAME`` with a
``docker save`` / OCI layout tarball as the body (forkyard's own).
"""

from __future__ import annotations

import asyncio
import secrets
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from forkyard.api.auth import require_key
from forkyard.config import ENVD_VERSION
from forkyard.ids import rfc3339
from forkyard.orchestrator import images
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound
from forkyard.templates import build_oci, registry, unpack
from forkyard.templates.build import TemplateBuilds


@asynccontextmanager
async def _lifespan(app: FastAPI):
    builds = TemplateBuilds(app.state.settings, app.state.orchestrator, app.state.api_key)
    app.state.template_builds = builds
    await builds.start()
    try:
        yield
    finally:
        await builds.stop()


router = APIRouter(lifespan=_lifespan)
authed = [Depends(require_key)]


def _too_large(message: str) -> JSONResponse:
    """413 ``{code, message}``: an upload or what it unpacks to is past a limit (the
    message names the setting)."""
    return JSONResponse({"code": 413, "message": message}, status_code=413, headers={"Connection": "close"})


def _builds(request: Request) -> TemplateBuilds:
    return request.app.state.template_builds


async def _json_body(request: Request) -> dict:
    try:
        body = await request.json()
    except RecursionError:  # json.loads on deeply nested arrays/objects
        raise BadRequest("body is nested too deeply") from None
    except ValueError as e:
        raise BadRequest(f"body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    return body


def template_entries(request: Request) -> list[dict]:
    """Every template on this node in E2B's ``Template`` shape: rootfs templates
    (``base``, imported images) and built templates (snapshots)."""
    settings = request.app.state.settings
    out = []
    for t in images.list_templates(settings):
        if registry.is_pulled(settings, t.template_id):
            continue  # a pulled image: the base of built templates, not one itself (E2B lists none)
        try:
            ts = (settings.templates_dir / t.template_id / images.MARKER).stat().st_mtime
        except OSError:
            ts = 0.0
        out.append(_entry(t.template_id, t.template_id, settings.default_vcpu, settings.default_memory_mb, ts, ts, 1,
                          t.disk_mb or settings.default_disk_mb))
    builds = getattr(request.app.state, "template_builds", None)
    if builds is not None:
        for meta in builds.built_templates():
            name = meta.metadata["forkyard.template"]
            done = builds.builds_of(name)
            build_id = next((b.build_id for b in reversed(done) if b.snapshot_id == meta.snapshot_id), meta.snapshot_id)
            created = done[0].created_at if done else meta.created_at
            out.append(_entry(name, build_id, meta.vcpus, meta.memory_mb, created, meta.created_at, len(done) or 1,
                              meta.disk_mb or settings.default_disk_mb))
    return out


def _entry(tid: str, build_id: str, cpu: int, mem: int, created: float, updated: float, nbuilds: int,
           disk_mb: int) -> dict:
    """E2B's ``Template`` shape; ``disk_mb`` is shown as ``diskSizeMB`` (0: unbounded)."""
    return {
        "templateID": tid, "buildID": build_id, "cpuCount": cpu, "memoryMB": mem, "diskSizeMB": disk_mb,
        "public": False, "aliases": [tid], "names": [tid], "createdAt": rfc3339(created), "updatedAt": rfc3339(updated),
        "createdBy": None, "lastSpawnedAt": None, "spawnCount": 0, "buildCount": nbuilds,
        "envdVersion": ENVD_VERSION, "buildStatus": "ready",
    }


@router.get("/v2/templates", dependencies=authed)
async def list_templates_v2(request: Request):
    """Same list as ``GET /templates``."""
    return template_entries(request)


@router.post("/v3/templates", status_code=202, dependencies=authed)
async def request_build(request: Request):
    """Register a build of template ``name``: 202 ``TemplateRequestResponseV3``;
    400 bad name/tag/resources; 409 a build of it is running."""
    body = await _json_body(request)
    name = body.get("name") or body.get("alias")
    if not name:
        raise BadRequest("name is required")
    rec = _builds(request).request(name, body.get("cpuCount"), body.get("memoryMB"), body.get("tags"),
                                   body.get("diskSizeMB"))
    return JSONResponse({"templateID": rec.template_id, "buildID": rec.build_id, "public": False,
                         "names": [rec.template_id], "tags": rec.tags, "aliases": [rec.template_id]},
                        status_code=202)


@router.post("/templates/tags", status_code=201, dependencies=authed)
async def assign_tags(request: Request):
    """Point ``tags`` at the build ``target`` (``name[:tag]``) names: 201
    ``{tags, buildID}``; 400 bad target/tags or none; 404 no such template or tag."""
    body = await _json_body(request)
    target = body.get("target")
    if not isinstance(target, str) or not target:
        raise BadRequest("target is required (name[:tag])")
    build_id, tags = _builds(request).assign_tags(target, body.get("tags"))
    return JSONResponse({"tags": tags, "buildID": build_id}, status_code=201)


@router.delete("/templates/tags", status_code=204, dependencies=authed)
async def remove_tags(request: Request):
    """Remove ``tags`` of template ``name``: 204; 400 a tag in ``name``, bad tags or
    ``default``; 404 no such template."""
    body = await _json_body(request)
    _builds(request).remove_tags(body.get("name"), body.get("tags"))
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", dependencies=authed)
async def list_tags(request: Request, template_id: str):
    """The template's tags (E2B ``TemplateTag``: ``{tag, buildID, createdAt}``); 404."""
    return _builds(request).list_tags(template_id)


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201, dependencies=authed)
async def file_upload_link(request: Request, template_id: str, files_hash: str):
    """Whether the COPY tarball ``files_hash`` is already here, and where to upload it."""
    builds = _builds(request)
    if not builds.known_template(template_id):
        raise NotFound(f"template {template_id!r} not found")
    path = builds.uploads.file_path(files_hash)
    url = str(request.base_url).rstrip("/") + f"/template-files/{files_hash}?token={builds.uploads.upload_token(files_hash)}"
    return JSONResponse({"present": path.exists(), "url": url}, status_code=201)


@router.put("/template-files/{files_hash}", status_code=201)
async def upload_files(request: Request, files_hash: str, token: str = ""):
    """Receive a COPY tarball (signed URL from the route above; no API key).

    A hash that is stored already answers 201 too and keeps what was stored (uploads are
    never replaced): E2B's upload URL is a storage object a PUT may write again, and the
    SDKs' ``force_upload``/``forceUpload`` upload a present hash again. Such a repeat is
    read through (bounded by ``FORKYARD_MAX_UPLOAD_MB``, else 413) and dropped."""
    builds = _builds(request)
    path = builds.uploads.file_path(files_hash)
    if not builds.uploads.check_upload_token(files_hash, token):
        return JSONResponse({"code": 403, "message": "invalid upload signature"}, status_code=403)
    limit = request.app.state.settings.max_upload_mb << 20
    if path.exists():
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return _too_large(f"upload refused: upload larger than {limit} bytes (FORKYARD_MAX_UPLOAD_MB)")
        return JSONResponse({"size": path.stat().st_size}, status_code=201)
    try:
        size = await builds.uploads.store_upload(files_hash, request.stream(), limit)
    except unpack.LimitExceeded as e:
        return _too_large(f"upload refused: {e}")
    except Conflict:  # a concurrent upload of the same hash was stored first: it stays
        size = path.stat().st_size
    return JSONResponse({"size": size}, status_code=201)


@router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202, dependencies=authed)
async def start_build(request: Request, template_id: str, build_id: str):
    """Start build ``build_id`` with the steps in the body (``TemplateBuildStartV2``)."""
    body = await _json_body(request)
    _builds(request).trigger(template_id, build_id, body)
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status", dependencies=authed)
async def build_status(request: Request, template_id: str, build_id: str,
                       logs_offset: int = Query(0, alias="logsOffset"), limit: int = Query(100),
                       level: str | None = Query(None)):
    """Build status with log entries from ``logsOffset`` (at most ``limit``, ≤ 100)."""
    return _builds(request).status(template_id, build_id, logs_offset, limit, level)


@router.get("/templates/aliases/{alias}", dependencies=authed)
async def get_alias(request: Request, alias: str):
    """``{templateID, public}`` of a usable template named ``alias``; 404 otherwise."""
    name, _, tag = alias.partition(":")
    builds = _builds(request)
    if (images.resolve(request.app.state.settings, name) and not registry.is_pulled(request.app.state.settings, name)
            or builds.template_snapshot(name) and (not tag or builds.snapshot_for(name, tag))):
        return {"templateID": name, "public": False}
    raise NotFound(f"template alias {alias!r} not found")


@router.get("/templates/{template_id}", dependencies=authed)
async def get_template(request: Request, template_id: str):
    """A template with its builds (``TemplateWithBuilds``)."""
    name = template_id.partition(":")[0]
    entry = next((e for e in template_entries(request) if e["templateID"] == name), None)
    builds = _builds(request).builds_of(name)
    if entry is None and not builds:
        raise NotFound(f"template {template_id!r} not found")
    if entry is None:
        b = builds[-1]
        entry = _entry(name, b.build_id, b.cpu_count, b.memory_mb, builds[0].created_at, b.created_at, len(builds),
                       b.disk_mb or request.app.state.settings.default_disk_mb)
        entry["buildStatus"] = b.status
    entry["builds"] = [{
        "buildID": b.build_id, "status": b.status, "createdAt": rfc3339(b.created_at),
        "updatedAt": rfc3339(b.finished_at or b.created_at), "cpuCount": b.cpu_count, "memoryMB": b.memory_mb,
        **({"finishedAt": rfc3339(b.finished_at)} if b.finished_at else {}),
        "diskSizeMB": b.disk_mb or request.app.state.settings.default_disk_mb, "envdVersion": ENVD_VERSION,
    } for b in builds]
    return entry


@router.delete("/templates/{template_id}", status_code=204, dependencies=authed)
async def delete_template(request: Request, template_id: str):
    """Delete a built or imported template, or a snapshot (``base`` cannot be
    deleted): 204; 404 unknown."""
    settings = request.app.state.settings
    name = template_id.partition(":")[0]
    if registry.is_pulled(settings, name):
        raise BadRequest(f"{name!r} is a pulled image that built templates use; delete those templates instead")
    if build_oci.is_imported(settings, name):
        await asyncio.to_thread(build_oci.remove_imported, settings, name)
        return Response(status_code=204)
    if images.resolve(settings, name) is not None:
        raise BadRequest(f"template {name!r} is built on the host and cannot be deleted over the API")
    builds = _builds(request)
    if builds.known_template(name):
        builds.delete(name)
        await asyncio.to_thread(builds.drop_unused_pulled)
    else:  # E2B deletes snapshots through this path too
        request.app.state.orchestrator.delete_snapshot(template_id)
    return Response(status_code=204)


@router.post("/templates/import", status_code=201, dependencies=authed)
async def import_template(request: Request, name: str = Query(...),
                          disk_size_mb: int | None = Query(None, alias="diskSizeMB")):
    """Import the body — a ``docker save`` tarball or a tar of an OCI image layout
    (optionally gzipped) — as rootfs template ``name`` whose sandboxes get disks of
    ``diskSizeMB`` MiB (default ``FORKYARD_DISK_MB``): 201 ``Template``; 400 bad image,
    name or disk size; 409 name taken."""
    settings = request.app.state.settings
    if disk_size_mb is not None:
        try:
            images.check_disk_mb(settings, disk_size_mb)
        except ValueError as e:
            raise BadRequest(str(e)) from None
    if images.resolve(settings, name) is not None or _builds(request).template_snapshot(name) is not None:
        raise Conflict(f"template {name!r} already exists")
    tmp = settings.data_dir / f"import-{secrets.token_hex(6)}.tar"
    limit = settings.max_upload_mb << 20
    size = 0
    try:
        with open(tmp, "wb") as f:  # noqa: ASYNC230 — small sequential writes
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    return _too_large(f"image larger than {limit} bytes (limit: FORKYARD_MAX_UPLOAD_MB)")
                f.write(chunk)
        if size == 0:
            raise BadRequest("empty body: send the image tarball")
        try:
            t = await asyncio.to_thread(build_oci.import_image, settings, tmp, name, disk_mb=disk_size_mb or 0)
        except build_oci.TemplateExists as e:
            raise Conflict(str(e)) from e
        except build_oci.ImageImportError as e:
            raise BadRequest(str(e)) from e
        except unpack.LimitExceeded as e:
            return _too_large(f"image refused: {e}")
    finally:
        tmp.unlink(missing_ok=True)
    return JSONResponse(next(e for e in template_entries(request) if e["templateID"] == t.template_id),
                        status_code=201)
