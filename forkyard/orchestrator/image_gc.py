"""Deleting the images nothing needs any more: pause images of sandboxes that resumed or
were killed, and fork images (a restore reads the whole image; measured: deleting it
afterwards does not affect the restored sandbox).

Runs in the background after a kill or resume (at most one run at a time, plus one
queued), so no operation waits on the repository; on S3 each call is a network round
trip.
"""

from __future__ import annotations

import asyncio
import logging
import time

from forkyard.config import Settings
from forkyard.ids import rfc3339
from forkyard.orchestrator.store import Store
from forkyard.repository.snapshots import SnapshotStore

log = logging.getLogger("forkyard.orchestrator")


class ImageGC:
    """Deletes unreferenced ``pause``/``fork`` images from the repository.

    Args:
        settings: ``cluster`` (the repository is shared: only :attr:`garbage` is
            deleted) and ``fork_image_ttl_s``.
        store: the rows whose ``image_id`` keep an image.
        snapshots: the repository.

    Attributes:
        garbage: pause images this node made garbage (resumed or killed their
            sandbox); in a cluster only these are deleted (see :meth:`run_sync`).
    """

    def __init__(self, settings: Settings, store: Store, snapshots: SnapshotStore):
        self.settings = settings
        self.store = store
        self.snapshots = snapshots
        self.garbage: set[str] = set()
        self._task: asyncio.Task | None = None
        self._wanted = False

    @property
    def in_flight(self) -> bool:
        """A background run is in progress."""
        return self._task is not None and not self._task.done()

    def later(self) -> None:
        """Run :meth:`run` in the background (at most one at a time, plus one queued),
        so a kill or resume never waits on the repository."""
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="gc-images")

    async def _loop(self) -> None:
        while self._wanted:
            self._wanted = False
            await self.run()

    async def wait(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for a background run to end (node shutdown)."""
        if self._task:
            await asyncio.wait([self._task], timeout=timeout_s)

    async def run(self) -> None:
        """Delete pause/fork images no sandbox row refers to any more (repository
        calls run in a thread). Best effort: a repository failure is logged and retried
        by the next call."""
        try:
            await asyncio.to_thread(self.run_sync)
        except Exception as e:  # noqa: BLE001 — never fail the operation that triggered it
            log.warning("deleting unused pause images failed (retried later): %s", e)

    def run_sync(self) -> None:
        """Alone: delete every pause/fork image no local row refers to. In a cluster
        (``settings.cluster``) the repository is shared and other nodes' paused
        sandboxes have images there too, so only the images this node made garbage
        (:attr:`garbage`) are deleted, and ``fork`` images older than
        ``settings.fork_image_ttl_s`` (left by a gateway that died mid-fork)."""
        referenced = {r.image_id for r in self.store.all() if r.image_id}
        if self.settings.cluster:
            for sid in list(self.garbage - referenced):
                meta = self.snapshots.get(sid)
                if meta is not None and meta.kind == "pause":  # never a user's snapshot or template
                    self.snapshots.delete(sid)
                self.garbage.discard(sid)
            stale = time.time() - self.settings.fork_image_ttl_s
            for meta in self.snapshots.list("fork"):  # left by a gateway that died mid-fork
                if meta.created_at and meta.created_at < stale:
                    log.info("deleting fork image %s left over from %s", meta.snapshot_id,
                             rfc3339(meta.created_at, "seconds"))
                    self.snapshots.delete(meta.snapshot_id)
            return
        for meta in self.snapshots.list():
            if meta.kind in ("pause", "fork") and meta.snapshot_id not in referenced:
                self.snapshots.delete(meta.snapshot_id)
