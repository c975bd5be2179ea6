"""The code-interpreter server of template ``code-interpreter-v1``: runs *inside* the
sandbox (its own venv, ``/opt/code-interpreter/venv``), on port 49999, speaking the HTTP
protocol the ``e2b-code-interpreter`` SDKs (PyPI 2.11, npm 2.8) use.

Not imported by forkyard on the host. Kernels are Jupyter kernels driven with
``jupyter_client`` (no Jupyter server): ``python3`` (ipykernel) and ``javascript``
(Deno's kernel, ``deno jupyter --kernel``; TypeScript runs in it too).

The protocol, as E2B's SDKs and their template's server define it (read from
github.com/e2b-dev/code-interpreter, ``python/e2b_code_interpreter`` and
``template/server``):

* ``GET /health`` → 200 ``"OK"``.
* ``POST /execute`` ``{code, context_id?, language?, env_vars?}`` → 200, a stream of JSON
  lines: ``{"type": "number_of_executions", "execution_count": N}``, ``stdout``/``stderr``
  ``{text, timestamp}``, ``result`` (the MIME bundle as ``text``, ``html``, ``png``, …,
  ``chart``, ``data``, ``extra``, ``is_main_result``), ``error`` ``{name, value,
  traceback}``, ``{"type": "keepalive"}`` every 5 s of silence, and last
  ``{"type": "end_of_execution"}``. ``context_id`` and ``language`` together: 400; an
  unknown context: 404; an unknown language: 400. A client that goes away mid-run
  interrupts the kernel (the SDK's ``timeout`` closes the stream).
* ``POST /contexts`` ``{language?, cwd?}`` → ``{id, language, cwd}``; ``GET /contexts`` →
  the list (the default python and javascript contexts included); ``DELETE
  /contexts/{id}``; ``POST /contexts/{id}/restart``.
* ``env_vars`` hold for that execution only; the sandbox's own env vars (envd's
  ``GET /envs``) are set in a context before its first execution.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator

import uvicorn
from jupyter_client.manager import AsyncKernelManager
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

log = logging.getLogger("code-interpreter")

PORT = 49999
ENVD_ENVS = "http://127.0.0.1:49983/envs"
#: How long an access token envd accepted is taken without asking again (s).
TOKEN_TTL_S = 60.0
DEFAULT_CWD = "/home/user"
#: Seconds of silence on /execute before a keepalive line (E2B's server sends one every
#: 5 s so that a vanished client is noticed by the failing write).
KEEPALIVE_S = 5.0
#: Bounds: request body (bytes), contexts, seconds to start a kernel.
MAX_BODY = 16 * 1024 * 1024
MAX_CONTEXTS = 64
KERNEL_START_S = 60.0
#: Seconds the next execution waits for an interrupted one to end.
RECOVER_S = 30.0
#: The SDKs' language names → the kernel that runs them.
KERNELS = {"python": "python3", "javascript": "javascript", "typescript": "javascript"}
ALIASES = {"py": "python", "python3": "python", "js": "javascript", "ts": "typescript"}
#: MIME type → the field of a ``result`` line (the SDKs' Result); the rest go to ``extra``.
MIME_FIELDS = {
    "text/plain": "text", "text/html": "html", "text/markdown": "markdown", "image/svg+xml": "svg",
    "image/png": "png", "image/jpeg": "jpeg", "application/pdf": "pdf", "text/latex": "latex",
    "application/json": "json", "application/javascript": "javascript", "e2b/data": "data",
    "e2b/chart": "chart",
}


class BadRequest(Exception):
    """A request the server refuses: ``status`` (4xx) and a message for the caller."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def normalize_language(language: str | None) -> str:
    """The SDKs' language (``None`` is python) in canonical form; BadRequest (400) for
    one no kernel here runs."""
    lang = (language or "python").strip().lower()
    lang = ALIASES.get(lang, lang)
    if lang not in KERNELS:
        raise BadRequest(400, f"language {language!r} is not supported here (python, javascript, typescript)")
    return lang


def result_line(bundle: dict, main: bool) -> dict:
    """A Jupyter MIME bundle as the SDKs' ``result`` line. A string's ``text/plain``
    loses its quotes (``'a'`` → ``a``), as E2B's server does."""
    out: dict = {"type": "result", "is_main_result": main}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        else:
            out[field] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    return out


def _env_code(language: str, env: dict[str, str | None]) -> str:
    """Code that sets (value) or deletes (None) env vars in ``language``'s kernel; values
    are JSON-quoted, which is a valid string literal in Python and JavaScript."""
    lines = []
    for k, v in env.items():
        key = json.dumps(str(k))
        if language == "python":
            lines.append(f"__import__('os').environ[{key}] = {json.dumps(str(v))}" if v is not None
                         else f"__import__('os').environ.pop({key}, None)")
        else:
            lines.append(f"Deno.env.set({key}, {json.dumps(str(v))});" if v is not None
                         else f"Deno.env.delete({key});")
    return "\n".join(lines)


def _chdir_code(language: str, cwd: str) -> str:
    return f"__import__('os').chdir({json.dumps(cwd)})" if language == "python" else f"Deno.chdir({json.dumps(cwd)});"


class Context:
    """One kernel and its client; executions run one at a time (``lock``)."""

    def __init__(self, language: str, cwd: str):
        self.id = str(uuid.uuid4())
        self.language, self.cwd = language, cwd
        self.km = AsyncKernelManager(kernel_name=KERNELS[language])
        self.kc = None
        self.lock = asyncio.Lock()
        self.envs_set = False
        self._recovering: asyncio.Future | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None

    def info(self) -> dict:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    async def start(self) -> None:
        """Start the kernel (cwd ``self.cwd``) and wait until it answers; raises
        RuntimeError when it does not within KERNEL_START_S."""
        await self.km.start_kernel(cwd=self.cwd if os.path.isdir(self.cwd) else "/")
        await self._connect()
        await self.run_silent(_chdir_code(self.language, self.cwd))

    async def _connect(self) -> None:
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            await self.kc.wait_for_ready(timeout=KERNEL_START_S)
        except RuntimeError as e:
            raise RuntimeError(f"the {self.language} kernel did not start: {e}") from e
        self._reader = asyncio.create_task(self._read_iopub())

    async def _read_iopub(self) -> None:
        """Route every iopub message to the queue of the execution it answers."""
        while True:
            msg = await self.kc.get_iopub_msg()
            q = self._queues.get(msg.get("parent_header", {}).get("msg_id"))
            if q is not None:
                q.put_nowait(msg)

    async def run_silent(self, code: str) -> None:
        """Run ``code`` without output (setup: cwd, env vars); waits for it to finish."""
        if code:
            async for _ in self._run(code, silent=True):
                pass

    async def _run(self, code: str, silent: bool = False) -> AsyncIterator[dict]:
        """Execute ``code``; yields the SDK's lines (no ``end_of_execution``) until the
        kernel is idle again for it."""
        q: asyncio.Queue = asyncio.Queue()
        msg_id = self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        self._queues[msg_id] = q
        errored = False
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), timeout=KEEPALIVE_S)
                except asyncio.TimeoutError:
                    if not self.km.has_kernel or not await self.km.is_alive():
                        yield {"type": "error", "name": "KernelDied", "value": "the kernel exited", "traceback": ""}
                        return
                    yield {"type": "keepalive"}
                    continue
                kind, content = msg["msg_type"], msg["content"]
                stamp = msg["header"].get("date")
                stamp = stamp.isoformat() if isinstance(stamp, datetime.datetime) else stamp
                if kind == "status" and content.get("execution_state") == "idle":
                    return
                if silent:
                    continue
                if kind == "execute_input":
                    yield {"type": "number_of_executions", "execution_count": content.get("execution_count")}
                elif kind == "stream":
                    name = "stderr" if content.get("name") == "stderr" else "stdout"
                    yield {"type": name, "text": content.get("text", ""), "timestamp": stamp}
                elif kind in ("execute_result", "display_data"):
                    yield result_line(dict(content.get("data", {})), kind == "execute_result")
                elif kind == "error" and not errored:
                    errored = True
                    yield {"type": "error", "name": content.get("ename", ""), "value": content.get("evalue", ""),
                           "traceback": "".join(content.get("traceback", []))}
        finally:
            self._queues.pop(msg_id, None)

    async def execute(self, code: str, env_vars: dict[str, str], token: str | None) -> AsyncIterator[dict]:
        """The lines of one execution with ``env_vars`` set for it only. A client that
        goes away (the generator is closed or cancelled) interrupts the kernel; the next
        execution waits until the interrupted one has ended (else ipykernel would abort
        the next request, answering it with nothing)."""
        async with self.lock:
            if self._recovering is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self._recovering, timeout=RECOVER_S)
                self._recovering = None
            if not self.envs_set:
                self.envs_set = True
                await self.run_silent(_env_code(self.language, await sandbox_envs(token)))
            if env_vars:
                await self.run_silent(_env_code(self.language, env_vars))
            unset = _env_code(self.language, {k: None for k in env_vars})
            finished = False
            try:
                async for line in self._run(code):
                    yield line
                finished = True
            finally:
                if finished:
                    await self.run_silent(unset)
                else:  # a task: this one is being cancelled, its awaits would be too
                    self._recovering = asyncio.ensure_future(self._recover(unset))

    async def _recover(self, unset: str) -> None:
        """Interrupt the abandoned cell and wait until the kernel has finished it (a
        silent execution queued behind it answers), then unset its env vars."""
        await self.km.interrupt_kernel()
        await self.run_silent("pass" if self.language == "python" else ";")
        await self.run_silent(unset)

    async def restart(self) -> None:
        """Restart the kernel (state lost) and set its cwd again."""
        async with self.lock:
            await self._stop_client()
            await self.km.restart_kernel(now=True)
            await self._connect()
            self.envs_set = False
            await self.run_silent(_chdir_code(self.language, self.cwd))

    async def _stop_client(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        if self.kc is not None:
            self.kc.stop_channels()

    async def shutdown(self) -> None:
        await self._stop_client()
        await self.km.shutdown_kernel(now=True)


async def sandbox_envs(token: str | None) -> dict[str, str]:
    """The sandbox's env vars from envd (``GET /envs``, with the caller's access token);
    {} when envd does not answer within 5 s."""
    def get() -> dict[str, str]:
        req = urllib.request.Request(ENVD_ENVS, headers={"X-Access-Token": token} if token else {})
        with urllib.request.urlopen(req, timeout=5) as r:
            body = json.loads(r.read(1024 * 1024))
        return {str(k): str(v) for k, v in body.items()} if isinstance(body, dict) else {}

    try:
        return await asyncio.to_thread(get)
    except Exception as e:  # noqa: BLE001 — env vars are best effort, as on E2B
        log.warning("no env vars from envd: %s", e)
        return {}


def envd_answer(token: str | None) -> int | None:
    """The status envd's ``GET /envs`` answers with access token ``token`` (None: no
    header) — 200, or 401 when the sandbox is secure and the token is not its own — or
    None when envd does not answer within 5 s."""
    req = urllib.request.Request(ENVD_ENVS, headers={"X-Access-Token": token} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:  # noqa: BLE001 — no answer
        return None


class TokenCheck:
    """ASGI middleware: ``POST /execute`` (running code) needs the sandbox's envd access
    token in ``X-Access-Token`` when the sandbox is secure — envd decides
    (:func:`envd_answer`); a token envd accepted is remembered (its SHA-256) for
    :data:`TOKEN_TTL_S`. Wrong or missing: 401 ``{"message": …}``; envd silent: 503.

    Stricter than E2B's server, which checks nothing (its port is reachable by anyone who
    knows the sandbox id, through the proxy): both SDKs send the token with ``/execute``
    (e2b-code-interpreter 2.11, @e2b/code-interpreter 2.8), not with ``/contexts``, so
    the context routes (which run no code) stay as open as E2B's."""

    def __init__(self, app):
        self.app = app
        self._ok: dict[str, float] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"].rstrip("/") != "/execute":
            return await self.app(scope, receive, send)
        token = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-access-token"), None)
        key = hashlib.sha256((token or "").encode()).hexdigest()
        now = time.monotonic()
        if now - self._ok.get(key, -TOKEN_TTL_S) >= TOKEN_TTL_S:
            status = await asyncio.to_thread(envd_answer, token)
            if status != 200:
                code, msg = (503, "envd did not answer; retry") if status is None else \
                    (401, "unauthorized: the sandbox's access token is needed (X-Access-Token)")
                return await JSONResponse({"message": msg}, status_code=code)(scope, receive, send)
            if len(self._ok) > 64:
                self._ok.clear()
            self._ok[key] = now
        return await self.app(scope, receive, send)


class Server:
    """The contexts and the routes; ``defaults`` maps a language to its default context."""

    def __init__(self):
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self.create_lock = asyncio.Lock()

    async def new_context(self, language: str, cwd: str) -> Context:
        if len(self.contexts) >= MAX_CONTEXTS:
            raise BadRequest(429, f"at most {MAX_CONTEXTS} contexts; remove one first")
        ctx = Context(language, cwd)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default_context(self, language: str) -> Context:
        async with self.create_lock:
            cid = self.defaults.get(language)
            if cid not in self.contexts:
                ctx = await self.new_context(language, DEFAULT_CWD)
                self.defaults[language] = cid = ctx.id
            return self.contexts[cid]

    async def startup(self) -> None:
        for language in ("python", "javascript"):
            await self.default_context(language)
        log.info("code interpreter ready on :%d", PORT)

    async def shutdown(self) -> None:
        for ctx in list(self.contexts.values()):
            await ctx.shutdown()


async def _body(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise BadRequest(413, f"request body larger than {MAX_BODY} bytes")
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        raise BadRequest(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "the body must be a JSON object")
    return body


def _str_or_none(body: dict, key: str) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise BadRequest(400, f"{key} must be a string")
    return v


def make_app(server: Server) -> Starlette:
    """The ASGI app serving ``server``'s routes (see the module docstring)."""

    def fail(e: BadRequest) -> Response:
        return PlainTextResponse(str(e), status_code=e.status)

    async def health(request: Request) -> Response:
        return JSONResponse("OK")

    async def execute(request: Request) -> Response:
        try:
            body = await _body(request)
            code = body.get("code")
            if not isinstance(code, str):
                raise BadRequest(400, "code must be a string")
            context_id, language = _str_or_none(body, "context_id"), _str_or_none(body, "language")
            env_vars = body.get("env_vars") or {}
            if not isinstance(env_vars, dict):
                raise BadRequest(400, "env_vars must be an object")
            if context_id and language:
                raise BadRequest(400, "Only one of context_id or language can be provided")
            if context_id:
                ctx = server.contexts.get(context_id)
                if ctx is None:
                    raise BadRequest(404, f"Context {context_id} not found")
            else:
                ctx = await server.default_context(normalize_language(language))
        except BadRequest as e:
            return fail(e)
        token = request.headers.get("x-access-token")

        async def lines():
            try:
                async for line in ctx.execute(code, {str(k): str(v) for k, v in env_vars.items()}, token):
                    yield json.dumps(line) + "\n"
            except Exception as e:  # noqa: BLE001 — the kernel went away: say so in the stream
                log.exception("execution failed")
                yield json.dumps({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""}) + "\n"
            yield '{"type": "end_of_execution"}\n'

        return StreamingResponse(lines(), media_type="application/json")

    async def create_context(request: Request) -> Response:
        try:
            body = await _body(request)
            language = normalize_language(_str_or_none(body, "language"))
            cwd = _str_or_none(body, "cwd") or DEFAULT_CWD
            ctx = await server.new_context(language, cwd)
        except BadRequest as e:
            return fail(e)
        return JSONResponse(ctx.info())

    async def list_contexts(request: Request) -> Response:
        return JSONResponse([c.info() for c in server.contexts.values()])

    async def remove_context(request: Request) -> Response:
        ctx = server.contexts.pop(request.path_params["cid"], None)
        if ctx is None:
            return PlainTextResponse(f"Context {request.path_params['cid']} not found", status_code=404)
        server.defaults = {k: v for k, v in server.defaults.items() if v != ctx.id}
        await ctx.shutdown()
        return Response(status_code=200)

    async def restart_context(request: Request) -> Response:
        ctx = server.contexts.get(request.path_params["cid"])
        if ctx is None:
            return PlainTextResponse(f"Context {request.path_params['cid']} not found", status_code=404)
        await ctx.restart()
        return Response(status_code=200)

    app = Starlette(
        routes=[
            Route("/health", health),
            Route("/execute", execute, methods=["POST"]),
            Route("/contexts", create_context, methods=["POST"]),
            Route("/contexts", list_contexts, methods=["GET"]),
            Route("/contexts/{cid}", remove_context, methods=["DELETE"]),
            Route("/contexts/{cid}/restart", restart_context, methods=["POST"]),
        ],
        lifespan=lambda app: _lifespan(server),
    )
    app.add_middleware(TokenCheck)
    return app


@contextlib.asynccontextmanager
async def _lifespan(server: Server):
    await server.startup()
    try:
        yield
    finally:
        await server.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    uvicorn.run(make_app(Server()), host="0.0.0.0", port=PORT, log_level="warning", timeout_keep_alive=640)


if __name__ == "__main__":
    main()
