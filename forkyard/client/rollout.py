"""Fork-and-run helpers for RL loops: :func:`fork` and :func:`rollout` (the engine is
:mod:`forkyard.client.fanout`; without a ``client`` these make one from the environment)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from forkyard.client import fanout
from forkyard.client.api import AsyncForkyard
from forkyard.client.fanout import ChildResult, Step

__all__ = ["ChildResult", "Step", "fork", "rollout"]


async def fork(sandbox, n: int = 1, *, timeout: int = 300, client: AsyncForkyard | None = None) -> list:
    """Fork ``sandbox`` (an e2b ``AsyncSandbox`` or a sandbox id) into ``n`` children.

    Args:
        n: number of children (≥ 1).
        timeout: each child's lifetime, seconds.
        client: REST client; by default one from the environment/config file.

    Returns:
        One entry per child, in order: an e2b ``AsyncSandbox`` or a :class:`ForkError`.

    Raises:
        ForkyardError: the whole fork failed (unknown/paused source, server down).
    """
    if client is not None:
        return await client.fork(sandbox, n, timeout=timeout)
    async with AsyncForkyard() as c:
        return await c.fork(sandbox, n, timeout=timeout)


async def rollout(
    source,
    n: int,
    step: Step,
    *,
    concurrency: int = 8,
    collect_files: Sequence[str] = (),
    then: Literal["kill", "pause", "keep"] = "kill",
    timeout: int = 600,
    step_timeout: float | None = 300,
    client: AsyncForkyard | None = None,
) -> list[ChildResult]:
    """Fork ``source`` into ``n`` children, run ``step`` in each, collect the results,
    then kill (or pause, or keep) the children — in one call.

    Args:
        source: the e2b ``AsyncSandbox`` (or sandbox id) to fork; it keeps running.
        n: number of children (≥ 1).
        step: a shell command (``FORKYARD_CHILD`` = index in its environment) or an async
            callable ``step(child)`` / ``step(child, index)``.
        concurrency: at most this many steps run at once (≥ 1).
        collect_files: absolute paths read from each child after its step (even a failed
            one), as bytes.
        then: ``"kill"`` (default) frees each child when done, ``"pause"`` keeps it paused
            for later inspection (resume with ``connect``), ``"keep"`` leaves it running.
        timeout: each child's lifetime, seconds (it expires even if this process dies).
        step_timeout: a step that runs longer than this (seconds) is an error; ``None``
            or 0 for no limit.
        client: REST client; by default one from the environment/config file.

    Returns:
        One :class:`ChildResult` per child, in order. Partial failures (a fork that did
        not start, a step that raised or timed out, a file that is missing, a failed
        kill/pause) are reported in the results, never raised.

    Raises:
        ForkyardError: the fork call itself failed (unknown/paused source, server
            down); no child exists then.
        ValueError: bad ``n``, ``concurrency`` or ``then``.
    """
    if client is not None:
        return await fanout.run(client, source, n, step, concurrency=concurrency, collect_files=collect_files,
                                then=then, timeout=timeout, step_timeout=step_timeout)
    async with AsyncForkyard() as own:
        return await fanout.run(own, source, n, step, concurrency=concurrency, collect_files=collect_files,
                                then=then, timeout=timeout, step_timeout=step_timeout)
