"""Running a build's steps in its sandbox, through the sandbox's envd: ``RUN`` as the
current (or the step's) user with the accumulated ``ENV`` and ``WORKDIR``; ``COPY`` from
the uploaded context (Docker semantics: a directory's contents go into the destination,
a file into ``dest/`` or onto ``dest``); ``USER`` and ``WORKDIR`` change the context;
then the final env, user and workdir become the sandbox's defaults (envd ``/init``), the
start command starts in the background and the ready command is polled until it
succeeds. With the node's package cache on, the build sandbox was pointed at it when it
was created (:mod:`forkyard.pkgcache`); that configuration is removed before the
snapshot.
"""

from __future__ import annotations

import asyncio
import fnmatch
import posixpath
import secrets
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from forkyard.config import ENVD_PORT, Settings
from forkyard.guest import envd
from forkyard.orchestrator.images import DEFAULT_USER_KEY, DEFAULT_WORKDIR_KEY
from forkyard.pkgcache import GUEST_PATHS, remove_script
from forkyard.templates import unpack
from forkyard.templates.spec import BuildRecord, StepFailed
from forkyard.templates.uploads import Uploads, plain_tar

RUN_TIMEOUT_S = 1800
#: How long the ready command may take to succeed (s), how often it is run (s, E2B's 2 s)
#: and what it is after a start command without one (E2B's default: wait 20 s).
READY_TIMEOUT_S = 300
READY_POLL_S = 2.0
DEFAULT_READY_CMD = "sleep 20"


@dataclass
class _Ctx:
    user: str
    workdir: str
    envs: dict[str, str] = field(default_factory=dict)


class StepRunner:
    """Runs the steps of builds.

    Args:
        settings: the unpack limits (COPY).
        orch: the orchestrator (``target``, ``get``, ``store``, ``snapshots.find``).
        uploads: the stored build contexts.
        http: the client envd calls go through.
    """

    def __init__(self, settings: Settings, orch, uploads: Uploads, http: httpx.AsyncClient):
        self.settings = settings
        self.orch = orch
        self.uploads = uploads
        self._http = http

    async def _sh(self, host: str, rec: BuildRecord, step: str, cmd: str, ctx: _Ctx, user: str | None = None,
                  cwd: str | None = None, timeout_s: float = RUN_TIMEOUT_S) -> tuple[int, list[str]]:
        tail: list[str] = []

        def sink(stream: str, line: str) -> None:
            tail.append(line)
            del tail[:-20]
            rec.log(line, "info" if stream == "stdout" else "warn", step)

        try:
            rc = await envd.run(self._http, host, cmd, user=user or ctx.user, envs=ctx.envs,
                                cwd=cwd or ctx.workdir, on_line=sink, timeout_s=timeout_s)
        except (envd.EnvdError, TimeoutError) as e:
            raise StepFailed(step, f"step {step}: {e}") from e
        return rc, tail

    async def _root(self, host: str, rec: BuildRecord, step: str, script: str) -> None:
        """Run a helper script as root in ``/``; raise with its output on failure."""
        tail: list[str] = []
        try:
            rc = await envd.run(self._http, host, script, user="root", cwd="/",
                                on_line=lambda s, line: tail.append(line), timeout_s=RUN_TIMEOUT_S)
        except (envd.EnvdError, TimeoutError) as e:
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
            return await envd.run(self._http, host, script, user="root", cwd="/", timeout_s=30) == 0
        except (envd.EnvdError, TimeoutError):
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
        tar_path = self.uploads.file_path(files_hash)
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
            await envd.upload(self._http, host, f"{stage}.tar", plain_tar(tar_path, limits.stream_bytes()),
                              user="root")
        except (unpack.LimitExceeded, envd.EnvdError) as e:
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

    async def run(self, rec: BuildRecord, sid: str, base: str, steps: list[dict],
                  start_cmd: str | None, ready_cmd: str | None) -> None:
        """Run ``steps`` (checked by :func:`forkyard.templates.spec.validate_steps`) in
        build sandbox ``sid`` made from ``base``, then finalize it (defaults, start and
        ready commands), logging into ``rec``.

        Raises:
            StepFailed: a step failed (named by E2B's step name).
        """
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
            await envd.init(self._http, host, env_vars=ctx.envs, default_user=ctx.user, default_workdir=ctx.workdir,
                            timeout_s=10.0)
        except envd.EnvdError as e:
            raise StepFailed("finalize", str(e)) from e
        sbx = self.orch.get(sid)
        sbx.env_vars = dict(ctx.envs)
        sbx.metadata = {**sbx.metadata, DEFAULT_USER_KEY: ctx.user, DEFAULT_WORKDIR_KEY: ctx.workdir}
        self.orch.store.put(sbx)
        await self._start_and_ready(rec, host, ctx, start_cmd, ready_cmd)
        if getattr(self.orch, "package_cache", None) is not None:
            # The build fetched through the node's package cache; the template must not
            # point its sandboxes at it (they get it at create while it is on).
            rec.log("Removing the package cache's configuration from the template", step="finalize")
            await self._root(host, rec, "finalize", remove_script(list(GUEST_PATHS)))

    async def _start_and_ready(self, rec: BuildRecord, host: str, ctx: _Ctx, start_cmd: str | None,
                               ready_cmd: str | None) -> None:
        """E2B's finalize: the start command runs in the background as the template's
        user (with its env and workdir) while the ready command (default
        :data:`DEFAULT_READY_CMD` after a start command) is polled every
        :data:`READY_POLL_S` until it exits 0, for at most :data:`READY_TIMEOUT_S`. Both
        commands' output goes to the build log (``[start] [stdout]: …``,
        ``[ready] [stderr]: …``). A start command that exits non-zero before the ready
        command succeeded fails the build at once; one still running when it succeeds
        keeps running (it is in the template's snapshot).

        Raises:
            StepFailed: step ``finalize``, with the command's exit code and last line.
        """
        if not start_cmd and not ready_cmd:
            return
        start_tail: list[str] = []

        def sink(prefix: str, tail: list[str]):
            def on_line(stream: str, line: str) -> None:
                tail.append(line)
                del tail[:-20]
                rec.log(f"[{prefix}] [{stream}]: {line}", "info" if stream == "stdout" else "warn", "finalize")
            return on_line

        start = None
        if start_cmd:
            rec.log(f"Running start command: {start_cmd}", step="finalize")
            start = asyncio.create_task(envd.run(
                self._http, host, start_cmd, user=ctx.user, envs=ctx.envs, cwd=ctx.workdir,
                on_line=sink("start", start_tail), timeout_s=None))
        ready = ready_cmd or DEFAULT_READY_CMD

        def start_failed() -> StepFailed | None:
            """The failure of a start command that has ended (None: still running or exit 0)."""
            if start is None or not start.done():
                return None
            try:
                rc = start.result()
            except (envd.EnvdError, OSError) as e:
                return StepFailed("finalize", f"start command failed to start: {e}")
            if rc == 0:
                return None
            last = f": {start_tail[-1]}" if start_tail else ""
            return StepFailed("finalize", f"start command {start_cmd!r} exited with code {rc} before the template "
                                          f"was ready{last}")

        rec.log(f"Waiting for template to be ready: {ready}", step="finalize")
        deadline = time.monotonic() + READY_TIMEOUT_S
        try:
            while True:
                ready_tail: list[str] = []
                probe = asyncio.create_task(envd.run(
                    self._http, host, ready, user=ctx.user, envs=ctx.envs, cwd=ctx.workdir,
                    on_line=sink("ready", ready_tail), timeout_s=max(1.0, min(60.0, deadline - time.monotonic()))))
                waits = {probe} | ({start} if start is not None and not start.done() else set())
                while not probe.done():
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    if (err := start_failed()) is not None:
                        probe.cancel()
                        await asyncio.gather(probe, return_exceptions=True)
                        raise err
                    waits = {probe}
                try:
                    rc = probe.result()
                except TimeoutError:
                    rc = None
                except envd.EnvdError as e:
                    raise StepFailed("finalize", f"ready command failed to start: {e}") from e
                if rc == 0:
                    break
                rec.log(f"Template is not ready: ready command {'timed out' if rc is None else f'exited with code {rc}'}",
                        step="finalize")
                if time.monotonic() > deadline:
                    last = f"; its last output: {ready_tail[-1]}" if ready_tail else ""
                    raise StepFailed("finalize", f"ready command {ready!r} did not succeed within {READY_TIMEOUT_S} s{last}")
                if start is not None and not start.done():
                    await asyncio.wait({start}, timeout=READY_POLL_S)
                    if (err := start_failed()) is not None:
                        raise err
                else:
                    await asyncio.sleep(READY_POLL_S)
            if (err := start_failed()) is not None:
                raise err
            rec.log("Template is ready", step="finalize")
        finally:
            if start is not None and not start.done():
                start.cancel()  # only the stream: envd keeps the process running
                await asyncio.gather(start, return_exceptions=True)
