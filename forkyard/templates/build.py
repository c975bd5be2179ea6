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
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import hmac
import json
import logging
import os
import posixpath
import re
import secrets
import shlex
import tarfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from forkyard.config import ENVD_PORT, Settings
from forkyard.ids import is_name, rfc3339
from forkyard.orchestrator.lifecycle import DEFAULT_USER_KEY, DEFAULT_WORKDIR_KEY, TEMPLATE_KEY
from forkyard.orchestrator.errors import (
    BadRequest,
    Conflict,
    NotFound,
    OrchestratorError,
)
from forkyard.templates import build_envd, registry, unpack

log = logging.getLogger("forkyard.templates.build")

#: Metadata keys on build sandboxes (and so on the committed template snapshots); the
#: default user/workdir keys are the orchestrator's (it hands them to cold-booted envds).
BUILD_KEY = "forkyard.templateBuild"

_HASH = re.compile(r"^[0-9a-f]{64}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_USER = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}(:[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31})?$")
_MODE = re.compile(r"^[0-7]{3,4}$")
STEP_TYPES = {"RUN", "COPY", "ENV", "WORKDIR", "USER"}
#: Tags accepted on a build name (``name:tag``); other tags are not supported.
DEFAULT_TAGS = {"default", "latest"}
#: Image names that mean our ``base`` template (E2B's default ``fromImage``).
BASE_IMAGES = {"e2bdev/base"}
#: Build sandbox expiry (killed, not paused, if a build runs longer).
BUILD_SANDBOX_TIMEOUT_S = 3600
RUN_TIMEOUT_S = 1800
READY_TIMEOUT_S = 300
MAX_LOG_ENTRIES = 20000
#: Characters of log messages one build keeps (the oldest go first), so a step that
#: prints without end holds at most this much server memory.
MAX_LOG_BYTES = 16 << 20
MAX_CONCURRENT_BUILDS = 2
#: How long a COPY upload URL (``GET /templates/{id}/files/{hash}``) stays valid (s);
#: the SDK uploads right after asking. It is good for one upload: a stored tarball is
#: never replaced.
UPLOAD_URL_TTL_S = 3600
#: How often a running build checks that its sandbox still exists (s).
SANDBOX_CHECK_S = 1.0
STATUS_PAGE_LIMIT = 100
_LEVELS = {"debug": 0, "info": 1, "warn": 2, "error": 3}


def split_name(name: str) -> tuple[str, str | None]:
    """``"name:tag"`` → ``("name", "tag")``; validates both.

    Raises:
        BadRequest: invalid name, or a tag other than ``default``/``latest``.
    """
    if not isinstance(name, str):
        raise BadRequest("template name must be a string")
    base, _, tag = name.partition(":")
    if not is_name(base):
        raise BadRequest(f"invalid template name {base!r}: 1-64 of a-z, 0-9, '-', '_', starting with a letter or digit")
    if tag and tag not in DEFAULT_TAGS:
        raise BadRequest(f"tag {tag!r} is not supported here (only {', '.join(sorted(DEFAULT_TAGS))})")
    return base, tag or None


@dataclass
class BuildRecord:
    """One build of a template: status, resources and log entries (E2B's shapes)."""

    build_id: str
    template_id: str
    status: str  # waiting | building | ready | error
    created_at: float
    cpu_count: int
    memory_mb: int
    finished_at: float | None = None
    #: disk size (MiB) of the template's sandboxes; 0 = the node's FORKYARD_DISK_MB.
    disk_mb: int = 0
    snapshot_id: str | None = None
    reason: dict | None = None
    logs: list[dict] = field(default_factory=list)

    def log(self, message: str, level: str = "info", step: str | None = None) -> None:
        """Append a log entry (oldest entries are dropped past :data:`MAX_LOG_ENTRIES`
        entries or :data:`MAX_LOG_BYTES` of messages; a message is cut at
        :data:`build_envd.MAX_LINE_BYTES` characters)."""
        if len(message) > build_envd.MAX_LINE_BYTES:
            message = message[: build_envd.MAX_LINE_BYTES]
        entry = {"timestamp": rfc3339(time.time()), "level": level, "message": message}
        if step is not None:
            entry["step"] = step
        self.logs.append(entry)
        size = self.__dict__.get("_log_bytes")
        if size is None:
            size = sum(len(e.get("message", "")) for e in self.logs[:-1])
        size += len(message)
        if len(self.logs) > MAX_LOG_ENTRIES or size > MAX_LOG_BYTES:
            drop = 0
            while drop < len(self.logs) - 1 and (len(self.logs) - drop > MAX_LOG_ENTRIES or size > MAX_LOG_BYTES):
                size -= len(self.logs[drop].get("message", ""))
                drop += 1
            del self.logs[:drop]
        self.__dict__["_log_bytes"] = size  # not a field: never saved


class StepFailed(Exception):
    """A build step failed; ``step`` is E2B's step name (``base``, ``1``…, ``finalize``)."""

    def __init__(self, step: str, message: str):
        super().__init__(message)
        self.step = step


@dataclass
class _Ctx:
    user: str
    workdir: str
    envs: dict[str, str] = field(default_factory=dict)


class TemplateBuilds:
    """Template builds of one node.

    Args:
        settings: paths (``data_dir``) and the API key's file for upload signatures.
        orch: the :class:`~forkyard.orchestrator.manager.Orchestrator` (only its public
            methods: ``create``, ``get``, ``target``, ``snapshot``, ``kill``, ``list``,
            ``store``, ``snapshots.list/find/delete``).
        secret: key signing upload URLs.
    """

    def __init__(self, settings: Settings, orch, secret: str):
        self.settings = settings
        self.orch = orch
        self._secret = secret.encode()
        self.builds_dir = settings.data_dir / "template-builds"
        self.files_dir = settings.data_dir / "template-files"
        self.builds_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self._builds: dict[str, BuildRecord] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._sem = asyncio.Semaphore(MAX_CONCURRENT_BUILDS)
        self._http = httpx.AsyncClient(trust_env=False, limits=httpx.Limits(max_keepalive_connections=0))
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
        for f in self.files_dir.glob("*.partial"):
            f.unlink(missing_ok=True)

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
        """Cancel running builds (each kills its sandbox and is recorded as failed)."""
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
        base, _ = split_name(name)
        for t in tags or []:
            if t not in DEFAULT_TAGS:
                raise BadRequest(f"tag {t!r} is not supported here (only {', '.join(sorted(DEFAULT_TAGS))})")
        if registry.resolve(self.settings, base) is not None:
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
                registry.check_disk_mb(self.settings, disk_mb)
            except ValueError as e:
                raise BadRequest(str(e)) from None
        rec = BuildRecord(build_id=str(uuid.uuid4()), template_id=base, status="waiting",
                          created_at=time.time(), cpu_count=cpu, memory_mb=mem, disk_mb=disk_mb or 0)
        self._builds[rec.build_id] = rec
        self._save(rec)
        return rec

    def known_template(self, template_id: str) -> bool:
        """True for a template with any recorded build or a committed snapshot."""
        name = template_id.partition(":")[0]
        return any(b.template_id == name for b in self._builds.values()) or self.template_snapshot(name) is not None

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

    # ---- trigger ----------------------------------------------------------------------
    def _resolve_base(self, body: dict) -> str:
        tmpl = body.get("fromTemplate")
        image = body.get("fromImage")
        if tmpl is not None and image is not None:
            raise BadRequest("give fromTemplate or fromImage, not both")
        if tmpl is not None:
            if not isinstance(tmpl, str):
                raise BadRequest("fromTemplate must be a string")
            name = tmpl.partition(":")[0]
            if registry.resolve(self.settings, name) or self.orch.snapshots.find(name):
                return name
            raise BadRequest(f"base template {tmpl!r} not found")
        if image is None:
            return "base"
        if not isinstance(image, str) or not image:
            raise BadRequest("fromImage must be a non-empty string")
        repo = image.split("@", 1)[0]
        if ":" in repo.rsplit("/", 1)[-1]:
            repo = repo.rsplit(":", 1)[0]
        if repo in BASE_IMAGES or repo.startswith("docker.io/library/") and repo[18:] in BASE_IMAGES:
            return "base"
        short = repo.rsplit("/", 1)[-1]
        if is_name(short) and (registry.resolve(self.settings, short) or self.orch.snapshots.find(short)):
            return short
        raise BadRequest(f"image {image!r} is not available: registry pulls are not supported here; "
                         "import it first (POST /templates/import) or use fromTemplate")

    def _validate_steps(self, steps) -> list[dict]:
        if steps is None:
            return []
        if not isinstance(steps, list):
            raise BadRequest("steps must be a list")
        out = []
        for i, s in enumerate(steps, 1):
            if not isinstance(s, dict):
                raise BadRequest(f"step {i} must be an object")
            typ, args = s.get("type"), s.get("args") or []
            if typ not in STEP_TYPES:
                raise BadRequest(f"step {i}: unsupported type {typ!r} (supported: {', '.join(sorted(STEP_TYPES))})")
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise BadRequest(f"step {i}: args must be a list of strings")
            if typ == "RUN" and (not 1 <= len(args) <= 2 or not args[0].strip()):
                raise BadRequest(f"step {i}: RUN needs a command and an optional user")
            if typ in ("RUN",) and len(args) == 2 and args[1] and not _USER.match(args[1]):
                raise BadRequest(f"step {i}: invalid user {args[1]!r}")
            if typ == "ENV" and (len(args) % 2 or not args or not all(_ENV_NAME.match(k) for k in args[::2])):
                raise BadRequest(f"step {i}: ENV needs name/value pairs with valid names")
            if typ in ("WORKDIR", "USER") and (len(args) != 1 or not args[0]):
                raise BadRequest(f"step {i}: {typ} needs exactly one argument")
            if typ == "USER" and not _USER.match(args[0]):
                raise BadRequest(f"step {i}: invalid user {args[0]!r}")
            if typ == "COPY":
                if not 2 <= len(args) <= 4 or not args[0] or not args[1]:
                    raise BadRequest(f"step {i}: COPY needs src, dest, [user, mode]")
                if len(args) > 2 and args[2] and not _USER.match(args[2]):
                    raise BadRequest(f"step {i}: invalid COPY user {args[2]!r}")
                if len(args) > 3 and args[3] and not _MODE.match(args[3]):
                    raise BadRequest(f"step {i}: invalid COPY mode {args[3]!r}")
                src = posixpath.normpath(args[0])
                if src.startswith(("/", "../")) or src == "..":
                    raise BadRequest(f"step {i}: COPY source must be relative to the build context")
                path = self.file_path(s.get("filesHash") or "")
                if not path.exists():
                    raise BadRequest(f"step {i}: files of COPY {args[0]!r} were not uploaded (filesHash {s.get('filesHash')})")
            out.append({"type": typ, "args": list(args), "filesHash": s.get("filesHash")})
        return out

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
        base = self._resolve_base(body)
        steps = self._validate_steps(body.get("steps"))
        start_cmd, ready_cmd = body.get("startCmd"), body.get("readyCmd")
        for k, v in (("startCmd", start_cmd), ("readyCmd", ready_cmd)):
            if v is not None and not isinstance(v, str):
                raise BadRequest(f"{k} must be a string")
        rec.status = "building"
        rec.log(f"Building template {rec.template_id} (build {rec.build_id}) from {base}", step="base")
        self._save(rec)
        task = asyncio.create_task(self._run(rec, base, steps, start_cmd or None, ready_cmd or None),
                                   name=f"template-build-{build_id}")
        self._tasks[build_id] = task
        task.add_done_callback(lambda _t: self._tasks.pop(build_id, None))
        return rec

    # ---- the build itself ----------------------------------------------------------------
    async def _sh(self, host: str, rec: BuildRecord, step: str, cmd: str, ctx: _Ctx, user: str | None = None,
                  cwd: str | None = None, quiet: bool = False, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, list[str]]:
        tail: list[str] = []

        def sink(stream: str, line: str) -> None:
            tail.append(line)
            del tail[:-20]
            if not quiet:
                rec.log(line, "info" if stream == "stdout" else "warn", step)

        try:
            rc = await build_envd.run(self._http, host, cmd, user=user or ctx.user, envs=ctx.envs,
                                      cwd=cwd or ctx.workdir, on_line=sink, timeout_s=timeout_s)
        except (build_envd.EnvdError, TimeoutError) as e:
            raise StepFailed(step, f"step {step}: {e}") from e
        return rc, tail

    async def _root(self, host: str, rec: BuildRecord, step: str, script: str) -> None:
        """Run a helper script as root in ``/``; raise with its output on failure."""
        tail: list[str] = []
        try:
            rc = await build_envd.run(self._http, host, script, user="root", cwd="/",
                                      on_line=lambda s, line: tail.append(line), timeout_s=RUN_TIMEOUT_S)
        except (build_envd.EnvdError, TimeoutError) as e:
            raise StepFailed(step, f"step {step}: {e}") from e
        if rc != 0:
            for line in tail[-20:]:
                rec.log(line, "error", step)
            raise StepFailed(step, f"step {step} failed: {tail[-1] if tail else f'exit code {rc}'}")

    async def _user_exists(self, host: str, user: str) -> bool:
        name = user.partition(":")[0]
        if name.isdigit():
            return True
        script = f'while IFS=: read -r n rest; do [ "$n" = {shlex.quote(name)} ] && exit 0; done < /etc/passwd; exit 1'
        try:
            return await build_envd.run(self._http, host, script, user="root", cwd="/", timeout_s=30) == 0
        except (build_envd.EnvdError, TimeoutError):
            return False

    def _abs(self, ctx: _Ctx, path: str) -> str:
        return posixpath.normpath(path if path.startswith("/") else posixpath.join(ctx.workdir, path))

    @staticmethod
    def _copy_plan(tar_path: Path, src: str, dest_abs: str, into_dir: bool | None,
                   limits: unpack.Limits) -> list[tuple[str, str]]:
        """``(path in the archive, target path)`` pairs for ``COPY src dest`` (Docker
        rules: a directory's entries go into ``dest``; a file goes to ``dest/name`` when
        ``dest`` ends with ``/`` or several sources match, else onto ``dest``)."""
        with open(tar_path, "rb") as f:
            members = {posixpath.normpath(m.name): m.isdir() for m, _ in unpack.members(f, unpack.Meter(limits))}
        src = posixpath.normpath(src)

        def is_dir(n: str) -> bool:
            return n == "." or members.get(n, False) or any(m.startswith(n + "/") for m in members)

        if src == ".":
            hits = ["."] if members else []
        elif any(c in src for c in "*?["):
            parts = src.split("/")
            names = {"/".join(n.split("/")[: len(parts)]) for n in members}
            hits = [n for n in sorted(names) if len(n.split("/")) == len(parts)
                    and all(fnmatch.fnmatchcase(a, b) for a, b in zip(n.split("/"), parts))]
        else:
            hits = [src] if src in members or any(n.startswith(src + "/") for n in members) else []
        multi = into_dir or len(hits) > 1
        plan = []
        for h in hits:
            if is_dir(h):
                prefix = "" if h == "." else h + "/"
                children = sorted({n[len(prefix):].split("/")[0] for n in members if n.startswith(prefix) and n != h})
                plan += [(prefix + c, posixpath.join(dest_abs, c)) for c in children]
            else:
                plan.append((h, posixpath.join(dest_abs, posixpath.basename(h)) if multi else dest_abs))
        return plan

    async def _copy(self, host: str, rec: BuildRecord, step: str, ctx: _Ctx, args: list[str], files_hash: str) -> None:
        src, dest = args[0], args[1]
        owner = args[2] if len(args) > 2 and args[2] else ctx.user
        mode = args[3] if len(args) > 3 and args[3] else None
        tar_path = self.file_path(files_hash)
        dest_abs = self._abs(ctx, dest)
        limits = unpack.Limits.from_settings(self.settings)
        try:
            plan = await asyncio.to_thread(self._copy_plan, tar_path, src, dest_abs, dest.endswith("/"), limits)
        except (unpack.ArchiveError, unpack.LimitExceeded) as e:
            raise StepFailed(step, f"step {step}: COPY {src}: the uploaded context cannot be used: {e}") from e
        if not plan:
            raise StepFailed(step, f"step {step}: COPY {src}: no such file in the uploaded context")
        if not await self._user_exists(host, owner):
            raise StepFailed(step, f"step {step}: COPY: unknown user {owner.partition(':')[0]!r}")
        # On the sandbox's disk, not /tmp: that is a tmpfs of a quarter of its memory.
        stage = f"/var/tmp/.forkyard-build-{secrets.token_hex(6)}"
        try:
            await build_envd.upload(self._http, host, f"{stage}.tar", _plain_tar(tar_path, limits.stream_bytes()),
                                    user="root")
        except (unpack.LimitExceeded, build_envd.EnvdError) as e:
            raise StepFailed(step, f"step {step}: COPY {src}: {e}") from e
        q = shlex.quote
        lines = ["set -e", f"mkdir -p {stage}", f"tar -xf {stage}.tar -C {stage}"]
        targets = []
        for path, target in plan:
            parent = posixpath.dirname(target)
            lines += [f"[ -d {q(parent)} ] || {{ mkdir -p {q(parent)}; chown {q(owner)} {q(parent)}; }}",
                      f"rm -rf {q(target)}", f"cp -a {q(posixpath.join(stage, path))} {q(target)}"]
            targets.append(q(target))
        lines.append(f"chown -hR {q(owner)} " + " ".join(targets))
        if mode:
            lines.append(f"chmod -R {mode} " + " ".join(targets))
        lines.append(f"rm -rf {stage} {stage}.tar")
        await self._root(host, rec, step, "\n".join(lines))

    async def _run_steps(self, rec: BuildRecord, sid: str, base: str, steps: list[dict],
                         start_cmd: str | None, ready_cmd: str | None) -> None:
        host, _ = self.orch.target(sid, ENVD_PORT)
        base_meta = self.orch.snapshots.find(base)
        user = (base_meta.metadata.get(DEFAULT_USER_KEY) if base_meta else None) or "user"
        workdir = (base_meta.metadata.get(DEFAULT_WORKDIR_KEY) if base_meta else None) or "/home/user"
        if not await self._user_exists(host, user):
            user, workdir = "root", "/"
        ctx = _Ctx(user=user, workdir=workdir, envs=dict(base_meta.env_vars) if base_meta else {})
        n = len(steps)
        for i, s in enumerate(steps, 1):
            step, typ, args = str(i), s["type"], s["args"]
            shown = " ".join(args) if typ != "ENV" else " ".join(f"{k}={v}" for k, v in zip(args[::2], args[1::2]))
            rec.log(f"[{i}/{n}] {typ} {shown}", step=step)
            if typ == "RUN":
                run_user = args[1] if len(args) > 1 and args[1] else ctx.user
                if not await self._user_exists(host, run_user):
                    raise StepFailed(step, f"step {step}: unknown user {run_user!r}")
                rc, tail = await self._sh(host, rec, step, args[0], ctx, user=run_user.partition(":")[0])
                if rc != 0:
                    last = tail[-1] if tail else ""
                    msg = f"step {step} (RUN {args[0]}) failed with exit code {rc}"
                    rec.log(msg, "error", step)
                    raise StepFailed(step, msg + (f": {last}" if last else ""))
            elif typ == "COPY":
                await self._copy(host, rec, step, ctx, args, s["filesHash"])
            elif typ == "ENV":
                ctx.envs.update(zip(args[::2], args[1::2]))
            elif typ == "WORKDIR":
                wd = self._abs(ctx, args[0])
                q = shlex.quote(wd)
                await self._root(host, rec, step, f"set -e\nif [ ! -d {q} ]; then mkdir -p {q}; chown {shlex.quote(ctx.user)} {q}; fi")
                ctx.workdir = wd
            elif typ == "USER":
                if not await self._user_exists(host, args[0]):
                    raise StepFailed(step, f"step {step}: unknown user {args[0]!r}")
                ctx.user = args[0].partition(":")[0]
        # finalize: defaults for the sandboxes created from this template
        rec.log("Finalizing: env, user and workdir become the template's defaults", step="finalize")
        try:
            await build_envd.init(self._http, host, env_vars=ctx.envs, default_user=ctx.user, default_workdir=ctx.workdir)
        except build_envd.EnvdError as e:
            raise StepFailed("finalize", str(e)) from e
        sbx = self.orch.get(sid)
        sbx.env_vars = dict(ctx.envs)
        sbx.metadata = {**sbx.metadata, DEFAULT_USER_KEY: ctx.user, DEFAULT_WORKDIR_KEY: ctx.workdir}
        self.orch.store.put(sbx)
        if start_cmd:
            rec.log(f"Running start command: {start_cmd}", step="finalize")
            try:
                await build_envd.run(self._http, host, start_cmd, user=ctx.user, envs=ctx.envs, cwd=ctx.workdir,
                                     background=True)
            except build_envd.EnvdError as e:
                raise StepFailed("finalize", f"start command failed to start: {e}") from e
        if ready_cmd:
            rec.log(f"Waiting for ready command: {ready_cmd}", step="finalize")
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                rc, _ = await self._sh(host, rec, "finalize", ready_cmd, ctx, quiet=True, timeout_s=60)
                if rc == 0:
                    break
                if time.monotonic() > deadline:
                    raise StepFailed("finalize", f"ready command {ready_cmd!r} did not succeed within {READY_TIMEOUT_S} s")
                await asyncio.sleep(1.0)
            rec.log("Ready command succeeded", step="finalize")

    async def _run(self, rec: BuildRecord, base: str, steps: list[dict], start_cmd: str | None,
                   ready_cmd: str | None) -> None:
        sid = None
        try:
            async with self._sem:
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
                await self._while_alive(rec, sid, self._run_steps(rec, sid, base, steps, start_cmd, ready_cmd))
                rec.log("Snapshotting the sandbox", step="finalize")
                try:
                    meta = await self.orch.snapshot(sid, name=rec.template_id)
                except OrchestratorError as e:
                    raise StepFailed("finalize", f"snapshot failed: {e}") from e
                for old in self.orch.snapshots.list():
                    if old.metadata.get(TEMPLATE_KEY) == rec.template_id and old.snapshot_id != meta.snapshot_id:
                        self.orch.snapshots.delete(old.snapshot_id)
                rec.snapshot_id = meta.snapshot_id
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
        for b in [b for b in self._builds.values() if b.template_id == name]:
            self._builds.pop(b.build_id, None)
            (self.builds_dir / f"{b.build_id}.json").unlink(missing_ok=True)


async def _plain_tar(path: Path, max_bytes: int) -> AsyncIterator[bytes]:
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
