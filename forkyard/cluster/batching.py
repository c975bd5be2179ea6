"""Calls of one Redis script that arrive within a few milliseconds, sent to Redis in one
pipeline (issue 26: the scheduler's heartbeats).

At 300 nodes a scheduler runs the heartbeat script 300 times a second. Through redis-py's
asyncio client each call alone costs ~0.28 ms of the scheduler's CPU (command packing,
a pooled connection, a socket write and read); in pipelines of 3 / 5 / 10 calls, 0.12 /
0.09 / 0.07 ms a call (``bench/bench_beat_batching.py``, 2026-12-07, loopback Redis 7,
hiredis). Each call still runs as its own script on Redis (atomic per call, as before);
a caller waits at most :attr:`ScriptBatcher.window_s` longer for its answer.
"""

from __future__ import annotations

import asyncio

from redis.exceptions import NoScriptError

#: How long the first call of a batch waits for others (s). At 300 heartbeats a second
#: over two replicas, ~7 calls a batch (0.08 ms of CPU a call in the microbench, against
#: ~0.15 at the ~1.5 a batch of a 10 ms window); a heartbeat's answer comes up to this
#: much later (the node waits 2 s for it).
WINDOW_S = 0.050
#: Calls in one pipeline at most: a full batch is sent at once.
MAX_BATCH = 64


class ScriptBatcher:
    """Batches calls of ``script`` (a redis-py ``AsyncScript`` registered on ``client``).

    Args:
        client: the ``redis.asyncio.Redis`` client the pipelines are made from.
        script: the registered script (its ``sha``; a call Redis answers NOSCRIPT, as after
            a restart, is repeated alone through ``script``, which loads it).
        window_s: see :data:`WINDOW_S`; max_batch: see :data:`MAX_BATCH`.
    """

    def __init__(self, client, script, window_s: float = WINDOW_S, max_batch: int = MAX_BATCH):
        self._r, self._script = client, script
        self.window_s, self.max_batch = window_s, max_batch
        self._queue: list[tuple[list, list, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._running: set[asyncio.Task] = set()

    async def call(self, keys: list, args: list):
        """Run the script with ``keys`` and ``args`` in the next batch; returns its reply.

        Raises:
            redis.exceptions.RedisError, OSError: as the call alone would (the connection
                failed for the whole batch, or the script failed for this call).
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((keys, args, fut))
        if len(self._queue) >= self.max_batch:
            self._send()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._on_timer)
        return await fut

    def _on_timer(self) -> None:
        self._timer = None
        if self._queue:
            self._send()

    def _send(self) -> None:
        batch, self._queue = self._queue, []
        task = asyncio.get_running_loop().create_task(self._run(batch), name="script-batch")
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, batch: list[tuple[list, list, asyncio.Future]]) -> None:
        try:
            async with self._r.pipeline(transaction=False) as p:
                for keys, args, _ in batch:
                    p.evalsha(self._script.sha, len(keys), *keys, *args)
                replies = await p.execute(raise_on_error=False)
        except BaseException as e:  # the connection failed: every call of the batch fails
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            if not isinstance(e, Exception):
                raise
            return
        for (keys, args, fut), reply in zip(batch, replies):
            if fut.done():  # its caller went away
                continue
            if isinstance(reply, NoScriptError):  # Redis restarted: load it, alone
                try:
                    reply = await self._script(keys=keys, args=args)
                except Exception as e:  # noqa: BLE001 — this call's error, to its caller
                    reply = e
            if fut.done():
                continue
            if isinstance(reply, Exception):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)
