"""The fork-run-collect engine behind :func:`forkyard.client.rollout` and
:meth:`AsyncForkyard.rollout <forkyard.client.api.AsyncForkyard.rollout>`: it works on the
REST client it is given and imports none, so the client can offer it as a method."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from forkyard.client.errors import ForkError, ForkyardError

#: A rollout step: a shell command (run with ``bash -l -c`` in each child, with
#: ``FORKYARD_CHILD`` set to the child's index) or an async callable taking the child's
#: ``AsyncSandbox`` (and, if it accepts a second positional argument, the index).
Step = str | Callable[..., Awaitable[Any]]


@dataclass
class ChildResult:
    """What happened in one child of a :func:`~forkyard.client.rollout.rollout`.

    Exactly one of "outputs" or ``error`` describes the step: when ``error`` is ``None``
    the step ran to the end (a command's non-zero ``exit_code`` is an output, not an
    error). ``error`` is set when the fork failed (``sandbox_id`` is then ``None``), the
    callable raised, or the step timed out.

    Attributes:
        index: position 0…n-1.
        sandbox_id: the child's id, ``None`` when its fork failed.
        stdout / stderr: the command's output (text), or of a callable that returned an
            object with ``stdout``/``stderr``/``exit_code`` (e.g. an e2b ``CommandResult``).
        exit_code: the command's exit code, ``None`` if it did not finish.
        value: what a callable step returned.
        files: collected files, path → content (bytes); missing ones are in ``file_errors``.
        file_errors: path → why it could not be read.
        error: why the step did not complete (text), or ``None``.
        exception: the exception behind ``error``, when there was one.
        cleanup_error: why the final kill/pause failed, or ``None``.
        duration_s: wall time of the step and the file collection, seconds.
    """

    index: int
    sandbox_id: str | None = None
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    value: Any = None
    files: dict[str, bytes] = field(default_factory=dict)
    file_errors: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    exception: BaseException | None = field(default=None, repr=False)
    cleanup_error: str | None = None
    duration_s: float = 0.0

    @property
    def ok(self) -> bool:
        """The step completed and (for commands) exited 0."""
        return self.error is None and (self.exit_code in (0, None))

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (file contents decoded as UTF-8 with replacement)."""
        return {
            "index": self.index, "sandboxID": self.sandbox_id, "stdout": self.stdout, "stderr": self.stderr,
            "exitCode": self.exit_code, "files": {k: v.decode("utf-8", "replace") for k, v in self.files.items()},
            "fileErrors": self.file_errors, "error": self.error, "cleanupError": self.cleanup_error,
            "durationS": round(self.duration_s, 3),
        }


class Forker(Protocol):
    """What the engine needs of a REST client (:class:`~forkyard.client.api.AsyncForkyard`)."""

    async def fork(self, sandbox, n: int = 1, *, timeout: int = 300) -> list: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def pause(self, sandbox_id: str) -> None: ...


def _accepts_index(fn) -> bool:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    except (TypeError, ValueError):
        return False
    return len(params) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


def _describe(e: BaseException) -> str:
    msg = str(e).strip()
    return f"{type(e).__name__}: {msg}" if msg else type(e).__name__


async def _run_step(child, index: int, step: Step, res: ChildResult, step_timeout: float | None) -> None:
    from e2b import CommandExitException

    if isinstance(step, str):
        try:
            r = await child.commands.run(step, envs={"FORKYARD_CHILD": str(index)},
                                         timeout=step_timeout or 0, request_timeout=60)
            res.stdout, res.stderr, res.exit_code = r.stdout, r.stderr, r.exit_code
        except CommandExitException as e:
            res.stdout, res.stderr, res.exit_code = e.stdout, e.stderr, e.exit_code
        return
    coro = step(child, index) if _accepts_index(step) else step(child)
    try:
        value = await (asyncio.wait_for(coro, step_timeout) if step_timeout else coro)
    except CommandExitException as e:  # a callable letting a failing command escape
        res.stdout, res.stderr, res.exit_code = e.stdout, e.stderr, e.exit_code
        raise
    res.value = value
    if all(hasattr(value, a) for a in ("stdout", "stderr", "exit_code")):
        res.stdout, res.stderr, res.exit_code = value.stdout, value.stderr, value.exit_code


async def run(
    client: Forker,
    source,
    n: int,
    step: Step,
    *,
    concurrency: int = 8,
    collect_files: Sequence[str] = (),
    then: Literal["kill", "pause", "keep"] = "kill",
    timeout: int = 600,
    step_timeout: float | None = 300,
) -> list[ChildResult]:
    """:func:`forkyard.client.rollout` with ``client`` given (see it for the arguments,
    the results and the errors raised); ``client`` stays open."""
    if n < 1 or concurrency < 1:
        raise ValueError("n and concurrency must be ≥ 1")
    if then not in ("kill", "pause", "keep"):
        raise ValueError(f"then must be 'kill', 'pause' or 'keep', not {then!r}")
    children = await client.fork(source, n, timeout=timeout)
    sem = asyncio.Semaphore(concurrency)

    async def one(index: int, child) -> ChildResult:
        res = ChildResult(index=index)
        if isinstance(child, ForkError):
            res.error = f"fork failed: {child}"
            return res
        res.sandbox_id = child.sandbox_id
        async with sem:
            t0 = time.monotonic()
            try:
                await _run_step(child, index, step, res, step_timeout)
            except TimeoutError as e:
                res.error, res.exception = f"step timed out after {step_timeout} s", e
            except Exception as e:  # noqa: BLE001 — reported per child
                res.error, res.exception = _describe(e), e
            for path in collect_files:
                try:
                    res.files[path] = bytes(await child.files.read(path, format="bytes", request_timeout=120))
                except Exception as e:  # noqa: BLE001
                    res.file_errors[path] = _describe(e)
            res.duration_s = time.monotonic() - t0
            try:
                if then == "kill":
                    await client.kill(child.sandbox_id)
                elif then == "pause":
                    await client.pause(child.sandbox_id)
            except ForkyardError as e:
                res.cleanup_error = str(e)
        return res

    try:
        return list(await asyncio.gather(*(one(i, c) for i, c in enumerate(children))))
    except BaseException:  # cancelled (Ctrl-C, outer timeout): do not leave children behind
        if then == "kill":
            await asyncio.shield(asyncio.gather(
                *(client.kill(c.sandbox_id) for c in children if not isinstance(c, ForkError)),
                return_exceptions=True))
        raise
