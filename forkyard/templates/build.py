"""Template builds: E2B's ``Template`` build API on top of sandboxes and snapshots.

A build (shared/DESIGN.md §4, "templates are snapshots"):

1. creates a sandbox from the base (a rootfs template such as ``base``, or another
   built template / snapshot),
2. runs the steps through that sandbox's envd — ``RUN`` as the current (or the step's)
   user with the accumulated ``ENV`` and ``WORKDIR``; ``COPY`` from the uploaded file
   tarball (Docker semantics: a directory's contents go into the destination, a file
   into ``dest/`` or onto ``dest``); ``USER`` and ``WORKDIR`` change the context,
3. makes the final env, user and workdir the sandbox defaults (envd ``/init``), starts
   the start command in the background and polls the ready command until it succeeds,
4. commits the running sandbox as a snapshot named after the template
   (:meth:`Orchestrator.snapshot`), deletes the template's previous snapshot and kills
   the build sandbox.

``Sandbox.create(name)`` then restores that snapshot: files, env and the start
command's processes are there, envd already running. A failed build commits nothing;
an earlier successful build of the same name stays in use.

Template id = template name (``[a-z0-9][a-z0-9_-]{0,63}``). Build records (status and
logs) are JSON files under ``<data_dir>/template-builds``; uploaded ``COPY`` tarballs
live under ``<data_dir>/template-files/<sha256>.tar``. A build interrupted by a server
stop is recorded as failed and its sandbox is killed.

This module keeps the builds (records, queries, the run of each); :mod:`.spec` checks
what a build is asked, :mod:`.steps` runs steps 2 and 3 in the sandbox, :mod:`.uploads`
keeps the uploaded contexts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from dataclasses import asdict

import httpx

from forkyard.config import Settings
from forkyard.orchestrator import images
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound, OrchestratorError
from forkyard.ids import rfc3339
from forkyard.orchestrator.images import TEMPLATE_KEY
from forkyard.templates import build_oci, registry, unpack
from forkyard.templates import tags as tagmod
from forkyard.templates.spec import (
    BuildRecord,
    PullBase,
    StepFailed,
    resolve_base,
    split_name,
    validate_steps,
)
from forkyard.templates.steps import StepRunner
from forkyard.templates.uploads import Uploads

log = logging.getLogger("forkyard.templates.build")

#: Metadata key on build sandboxes (and so on the committed template snapshots); the
#: default user/workdir keys are the orchestrator's (it hands them to cold-booted envds).
BUILD_KEY = "forkyard.templateBuild"
#: Build sandbox expiry (killed, not paused, if a build runs longer).
BUILD_SANDBOX_TIMEOUT_S = 3600
MAX_CONCURRENT_BUILDS = 2
#: How often a running build checks that its sandbox still exists (s).
SANDBOX_CHECK_S = 1.0
STATUS_PAGE_LIMIT = 100
_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


class TemplateBuilds:
    """Template builds of one node.

    Args:
        settings: paths (``data_dir``) and the API key's file for upload signatures.
        orch: the :class:`~forkyard.orchestrator.manager.Orchestrator` (only its public
            methods: ``create``, ``get``, ``target``, ``snapshot``, ``kill``, ``list``,
            ``store``, ``snapshots.list/find/delete``).
        secret: key signing upload URLs.

    Attributes:
        uploads: the build contexts COPY steps read (:class:`~forkyard.templates.uploads.Uploads`).
    """

    def __init__(self, settings: Settings, orch, secret: str):
        self.settings = settings
        self.orch = orch
        self.builds_dir = settings.data_dir / "template-builds"
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        self.uploads = Uploads(settings, secret)
        self._builds: dict[str, BuildRecord] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._sem = asyncio.Semaphore(MAX_CONCURRENT_BUILDS)
        self._http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
        self._steps = StepRunner(settings, orch, self.uploads, self._http)
        self.puller = registry.Puller(settings)
        self.tags = tagmod.TagStore(settings.data_dir / "template-tags")
        self._load()

    # ---- persistence ------------------------------------------------------------------
    def _load(self) -> None:
        for path in self.builds_dir.glob("*.json"):
            try:
                rec = BuildRecord(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as e:
                log.warning("ignoring unreadable build record %s: %s", path, e)
                continue
            if rec.status in ("waiting", "building"):
                rec.status, rec.finished_at = "error", time.time()
                rec.reason = {"message": "build interrupted by a server restart", "step": "base"}
                rec.log("build interrupted by a server restart", "error")
                self._save(rec)
            self._builds[rec.build_id] = rec

    def _save(self, rec: BuildRecord) -> None:
        tmp = self.builds_dir / f".{rec.build_id}.tmp"
        tmp.write_text(json.dumps(asdict(rec)))
        os.replace(tmp, self.builds_dir / f"{rec.build_id}.json")

    async def start(self) -> None:
        """Kill build sandboxes left over from an interrupted server (their builds are
        already recorded as failed)."""
        for sbx in self.orch.list():
            if BUILD_KEY in sbx.metadata and sbx.metadata[BUILD_KEY] not in self._tasks:
                log.info("killing leftover build sandbox %s", sbx.id)
                try:
                    await self.orch.kill(sbx.id)
                except OrchestratorError:
                    pass

    async def stop(self) -> None:
        """Cancel running builds (each kills its sandbox and is recorded as failed; a
        pull in progress is stopped)."""
        self.puller.cancel()
        for task in list(self._tasks.values()):
            task.cancel()
        for task in list(self._tasks.values()):
            try:
                await task
            except BaseException:  # noqa: BLE001
                pass
        await self._http.aclose()

    # ---- queries ------------------------------------------------------------------------
    def get_build(self, template_id: str, build_id: str) -> BuildRecord:
        """The build ``build_id`` of ``template_id``.

        Raises:
            NotFound: unknown build or template.
        """
        rec = self._builds.get(build_id)
        if rec is None or rec.template_id != template_id.partition(":")[0]:
            raise NotFound(f"build {build_id!r} of template {template_id!r} not found")
        return rec

    def builds_of(self, template_id: str) -> list[BuildRecord]:
        """Every recorded build of ``template_id``, oldest first."""
        return sorted((b for b in self._builds.values() if b.template_id == template_id), key=lambda b: b.created_at)

    def template_snapshot(self, name: str):
        """The committed snapshot of built template ``name`` (None if never built)."""
        meta = self.orch.snapshots.find(name)
        if meta is not None and meta.metadata.get(TEMPLATE_KEY) == name:
            return meta
        return None

    def built_templates(self) -> list:
        """Snapshots that are built templates, one per name (the newest)."""
        out = {}
        for meta in self.orch.snapshots.list():
            name = meta.metadata.get(TEMPLATE_KEY)
            if name and name in meta.names:
                out[name] = meta
        return [out[k] for k in sorted(out)]

    def status(self, template_id: str, build_id: str, logs_offset: int = 0, limit: int = STATUS_PAGE_LIMIT,
               level: str | None = None) -> dict:
        """E2B ``TemplateBuildInfo``: status and the log entries from ``logs_offset``.

        Raises:
            NotFound: unknown build. BadRequest: negative offset / bad limit or level.
        """
        rec = self.get_build(template_id, build_id)
        if logs_offset < 0 or not 0 <= limit <= STATUS_PAGE_LIMIT:
            raise BadRequest(f"logsOffset must be >= 0 and limit between 0 and {STATUS_PAGE_LIMIT}")
        entries = rec.logs
        if level is not None:
            if level not in _LEVELS:
                raise BadRequest(f"unknown log level {level!r}")
            entries = [e for e in entries if _LEVELS.get(e["level"], 1) >= _LEVELS[level]]
        page = entries[logs_offset: logs_offset + limit]
        out = {
            "templateID": rec.template_id,
            "buildID": rec.build_id,
            "status": rec.status,
            "logEntries": page,
            "logs": [f"{e['timestamp']} [{e['level']}] {e['message']}" for e in page],
        }
        if rec.reason:
            out["reason"] = rec.reason
        return out

    # ---- request / upload ---------------------------------------------------------------
    def request(self, name: str, cpu_count: int | None = None, memory_mb: int | None = None,
                tags: list[str] | None = None, disk_mb: int | None = None) -> BuildRecord:
        """Register a new build of template ``name`` (``POST /v3/templates``); status
        ``waiting`` until :meth:`trigger`. ``disk_mb`` (MiB, the body's ``diskSizeMB``, a
        forkyard extension: E2B sets disks per team) sizes the disk of the build
        sandbox and so of every sandbox made from the template; None = the base's
        (else ``FORKYARD_DISK_MB``); bounded by ``FORKYARD_MAX_DISK_MB``.

        Raises:
            BadRequest: bad name/tag/resources, or ``name`` is a rootfs template.
            Conflict: a build of ``name`` is already running.
        """
        base, tag = split_name(name)
        wanted = tagmod.normalize(([tag] if tag else []) + list(tags if tags is not None else []))
        if images.resolve(self.settings, base) is not None:
            raise BadRequest(f"{base!r} is a rootfs template on this node; choose another name")
        meta = self.orch.snapshots.find(base)
        if meta is not None and meta.metadata.get(TEMPLATE_KEY) != base:
            raise Conflict(f"{base!r} is already the name of a snapshot")
        if any(b.template_id == base and b.status == "building" for b in self._builds.values()):
            raise Conflict(f"template {base!r} is already being built")
        cpu = self.settings.default_vcpu if cpu_count is None else cpu_count
        mem = self.settings.default_memory_mb if memory_mb is None else memory_mb
        if not isinstance(cpu, int) or not 1 <= cpu <= 8:
            raise BadRequest("cpuCount must be between 1 and 8")
        if not isinstance(mem, int) or not 128 <= mem <= 8192:
            raise BadRequest("memoryMB must be between 128 and 8192")
        if disk_mb is not None:
            try:
                images.check_disk_mb(self.settings, disk_mb)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        rec = BuildRecord(build_id=str(uuid.uuid4()), template_id=base, status="waiting",
                          created_at=time.time(), cpu_count=cpu, memory_mb=mem, disk_mb=disk_mb or 0,
                          tags=wanted or [tagmod.DEFAULT_TAG])
        self._builds[rec.build_id] = rec
        self._save(rec)
        return rec

    def known_template(self, template_id: str) -> bool:
        """True for a template with any recorded build or a committed snapshot."""
        name = template_id.partition(":")[0]
        return any(b.template_id == name for b in self._builds.values()) or self.template_snapshot(name) is not None

    # ---- trigger ----------------------------------------------------------------------
    def trigger(self, template_id: str, build_id: str, body: dict) -> BuildRecord:
        """Validate the build spec (E2B ``TemplateBuildStartV2``) and start the build in
        the background (``POST /v2/templates/{id}/builds/{buildID}``).

        Raises:
            NotFound: unknown build. Conflict: already started.
            BadRequest: invalid steps, base not available here, files not uploaded.
        """
        rec = self.get_build(template_id, build_id)
        if rec.status != "waiting":
            raise Conflict(f"build {build_id} was already started ({rec.status})")
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        base = resolve_base(self.settings, self.orch.snapshots, body)
        steps = validate_steps(body.get("steps"), self.uploads.file_path)
        start_cmd, ready_cmd = body.get("startCmd"), body.get("readyCmd")
        for k, v in (("startCmd", start_cmd), ("readyCmd", ready_cmd)):
            if v is not None and not isinstance(v, str):
                raise BadRequest(f"{k} must be a string")
        rec.status = "building"
        shown = f"image {base.image}" if isinstance(base, PullBase) else base
        rec.log(f"Building template {rec.template_id} (build {rec.build_id}) from {shown}", step="base")
        self._save(rec)
        task = asyncio.create_task(self._run(rec, base, steps, start_cmd or None, ready_cmd or None),
                                   name=f"template-build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(build_id, None))
        return rec

    async def _pull(self, rec: BuildRecord, base: PullBase) -> str:
        """Pull ``base`` (:mod:`.registry`) logging into ``rec``; the rootfs template's name.

        Raises:
            StepFailed: step ``base``, with what went wrong and what to do.
        """
        loop = asyncio.get_running_loop()

        def progress(line: str) -> None:
            try:
                loop.call_soon_threadsafe(rec.log, line, "info", "base")
            except RuntimeError:  # the loop closed under a pull that was cancelled
                pass

        try:
            return await asyncio.to_thread(self.puller.pull, base.image, base.creds, progress)
        except registry.PullError as e:
            raise StepFailed("base", f"cannot pull {base.image}: {e}") from None
        except (build_oci.ImageImportError, unpack.LimitExceeded) as e:
            raise StepFailed("base", f"cannot unpack {base.image}: {e}") from None

    async def _run(self, rec: BuildRecord, base: str | PullBase, steps: list[dict], start_cmd: str | None,
                   ready_cmd: str | None) -> None:
        sid = None
        try:
            async with self._sem:
                if isinstance(base, PullBase):
                    base = await self._pull(rec, base)
                try:
                    sbx = await self.orch.create(
                        base, timeout_s=BUILD_SANDBOX_TIMEOUT_S, auto_pause=False,
                        metadata={TEMPLATE_KEY: rec.template_id, BUILD_KEY: rec.build_id},
                        vcpus=rec.cpu_count, memory_mb=rec.memory_mb, disk_mb=rec.disk_mb or None,
                    )
                except OrchestratorError as e:
                    raise StepFailed("base", f"could not start a sandbox from {base!r}: {e}") from e
                sid = sbx.id
                rec.log(f"Build sandbox {sid} started", step="base")
                await self._while_alive(rec, sid, self._steps.run(rec, sid, base, steps, start_cmd, ready_cmd))
                rec.log("Snapshotting the sandbox", step="finalize")
                try:
                    meta = await self.orch.snapshot(sid, name=rec.template_id)
                except OrchestratorError as e:
                    raise StepFailed("finalize", f"snapshot failed: {e}") from e
                rec.snapshot_id = meta.snapshot_id
                self.tags.assign(rec.template_id, rec.build_id, rec.tags or [tagmod.DEFAULT_TAG])
                self._drop_untagged(rec.template_id, keep=meta.snapshot_id)
                rec.status, rec.finished_at = "ready", time.time()
                rec.log(f"Template {rec.template_id} is ready (snapshot {meta.snapshot_id})", step="finalize")
        except asyncio.CancelledError:
            self._fail(rec, "base", "build cancelled (server stopping)")
            raise
        except StepFailed as e:
            self._fail(rec, e.step, str(e))
        except Exception as e:
            log.exception("build %s failed", rec.build_id)
            self._fail(rec, "finalize", f"internal error: {e}")
        finally:
            self._save(rec)
            if sid is not None:
                try:
                    await asyncio.shield(self.orch.kill(sid))
                except Exception as e:  # noqa: BLE001
                    log.warning("killing build sandbox %s failed: %s", sid, e)

    def _drop_untagged(self, name: str, keep: str) -> None:
        """Delete the snapshots of template ``name``'s earlier builds that no tag names
        (``keep``: the newest build's)."""
        tagged = {self._builds[b].snapshot_id for b in self.tags.builds_tagged(name) if b in self._builds}
        for old in self.orch.snapshots.list():
            if (old.metadata.get(TEMPLATE_KEY) == name and old.snapshot_id != keep
                    and old.snapshot_id not in tagged):
                self.orch.snapshots.delete(old.snapshot_id)

    # ---- tags --------------------------------------------------------------------------
    def snapshot_for(self, name: str, tag: str | None) -> str | None:
        """Snapshot id of built template ``name`` at ``tag`` (None: ``default``). With no
        tag recorded at all (templates built before tags), ``default`` is the newest build. None when ``name`` is not a built template here or the tag names nothing.

        Raises:
            BadRequest: invalid name or tag.
        """
        meta = self.template_snapshot(name)
        if meta is None:
            return None
        tag = tagmod.normalize([tag])[0] if tag else tagmod.DEFAULT_TAG
        build_id = self.tags.build_of(name, tag)
        if build_id is None:
            return meta.snapshot_id if tag == tagmod.DEFAULT_TAG and not self.tags.of(name) else None
        rec = self._builds.get(build_id)
        if rec is None or rec.snapshot_id is None or self.orch.snapshots.get(rec.snapshot_id) is None:
            return None
        return rec.snapshot_id

    def assign_tags(self, target: str, tags) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` (``name[:tag]``) names (E2B ``POST
        /templates/tags``); returns ``(build id, tags)``.

        Raises:
            BadRequest: bad target or tags, no tags. NotFound: no such template or tag.
        """
        name, tag = split_name(target)
        wanted = tagmod.normalize(tags)
        if not wanted:
            raise BadRequest("At least one tag is required")
        if self.template_snapshot(name) is None:
            raise NotFound(f"template {name!r} not found")
        build_id = self.tags.build_of(name, tag)
        if build_id is None and (tag or tagmod.DEFAULT_TAG) == tagmod.DEFAULT_TAG and not self.tags.of(name):
            newest = self.template_snapshot(name).snapshot_id
            build_id = next((b.build_id for b in self.builds_of(name) if b.snapshot_id == newest), None)
        if build_id is None or self.snapshot_for(name, tag) is None:
            raise NotFound(f"Template '{target}' with tag '{tag or tagmod.DEFAULT_TAG}' not found")
        self.tags.assign(name, build_id, wanted)
        return build_id, wanted

    def remove_tags(self, name: str, tags) -> None:
        """Remove ``tags`` of template ``name`` (E2B ``DELETE /templates/tags``); the
        builds no tag names any more stay until the template is deleted.

        Raises:
            BadRequest: ``name`` has a tag, bad or no tags, ``default`` among them.
            NotFound: no such template.
        """
        if not isinstance(name, str) or ":" in name:
            raise BadRequest("Template name should not contain a tag, use the 'tags' field instead")
        base, _ = split_name(name)
        wanted = tagmod.normalize(tags)
        if not wanted:
            raise BadRequest("At least one tag is required")
        if self.template_snapshot(base) is None:
            raise NotFound(f"template {name!r} not found")
        self.tags.remove(base, wanted)

    def list_tags(self, name: str) -> list[dict]:
        """E2B ``TemplateTag`` entries ``{tag, buildID, createdAt}`` of template ``name``.

        Raises:
            NotFound: no such template.
        """
        base = name.partition(":")[0]
        if self.template_snapshot(base) is None:
            raise NotFound(f"template {name!r} not found")
        out = [{"tag": t, "buildID": e["buildID"], "createdAt": rfc3339(e.get("createdAt", 0))}
               for t, e in sorted(self.tags.of(base).items()) if isinstance(e, dict) and e.get("buildID")]
        if not out:  # built before tags: its newest build is the default
            newest = self.template_snapshot(base).snapshot_id
            b = next((b for b in self.builds_of(base) if b.snapshot_id == newest), None)
            if b is not None:
                out.insert(0, {"tag": tagmod.DEFAULT_TAG, "buildID": b.build_id,
                               "createdAt": rfc3339(b.finished_at or b.created_at)})
        return out

    async def _while_alive(self, rec: BuildRecord, sid: str, work) -> None:
        """Run coroutine ``work`` while build sandbox ``sid`` lives; when it goes (killed,
        died) ``work`` is cancelled and the step fails at once (its envd stream would
        otherwise wait on a connection into a netns that no longer exists).

        Raises:
            StepFailed: the sandbox went away (or what ``work`` raised).
        """
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=SANDBOX_CHECK_S)
                if task.done():
                    break
                try:
                    self.orch.get(sid)
                except NotFound as e:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    step = next((x["step"] for x in reversed(rec.logs) if "step" in x), "base")
                    raise StepFailed(step, f"the build sandbox stopped: {e}") from None
            task.result()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def _fail(self, rec: BuildRecord, step: str, message: str) -> None:
        rec.log(message, "error", step)
        rec.status, rec.finished_at = "error", time.time()
        rec.reason = {"message": message, "step": step, "logEntries": [e for e in rec.logs if e["level"] == "error"][-20:]}

    # ---- delete ------------------------------------------------------------------------
    def delete(self, template_id: str) -> None:
        """Delete built template ``template_id``: its snapshot and build records.

        Raises:
            NotFound: no such built template. Conflict: a build of it is running.
        """
        name = template_id.partition(":")[0]
        if not self.known_template(name):
            raise NotFound(f"template {template_id!r} not found")
        if any(b.template_id == name and b.status in ("waiting", "building") and b.build_id in self._tasks
               for b in self._builds.values()):
            raise Conflict(f"template {name!r} is being built")
        for meta in self.orch.snapshots.list():
            if meta.metadata.get(TEMPLATE_KEY) == name:
                self.orch.snapshots.delete(meta.snapshot_id)
        self.tags.drop(name)
        for b in [b for b in self._builds.values() if b.template_id == name]:
            self._builds.pop(b.build_id, None)
            (self.builds_dir / f"{b.build_id}.json").unlink(missing_ok=True)

    def drop_unused_pulled(self) -> list[str]:
        """Remove the pulled images (:mod:`.registry`) nothing uses any more: no
        committed image (a template's, a snapshot, a paused sandbox's, a fork's) expects
        their rootfs and no sandbox record names them. Keeps them all while a build is
        waiting or running, or while a sandbox runs from an image whose record is gone
        (what it runs on cannot be told). Blocking (removes trees): call it in a thread.
        Returns the names removed."""
        pulled = [t.template_id for t in images.list_templates(self.settings)
                  if registry.is_pulled(self.settings, t.template_id)]
        if not pulled or any(b.status in ("waiting", "building") for b in self._builds.values()):
            return []
        metas = {m.snapshot_id: m for m in self.orch.snapshots.list()}
        used = {m.template_id for m in metas.values()}
        for sbx in self.orch.list():
            if sbx.image_id and sbx.image_id not in metas:
                return []
            used.add(sbx.template_id)
        gone = [name for name in pulled if name not in used]
        for name in gone:
            log.info("removing pulled image %s: no template, snapshot or sandbox uses it", name)
            registry.remove_pulled(self.settings, name)
        return gone
