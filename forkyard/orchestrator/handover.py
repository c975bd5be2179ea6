"""Hand-over between the nodes of a cluster: adopting a paused sandbox whose node is gone
or draining, forgetting one the cluster gave to another node, deleting the ``fork``
images a cross-node fork exported. The node agent (:mod:`forkyard.cluster.agent`) and
the gateway call these through the orchestrator.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound
from forkyard.orchestrator.state import SandboxTable
from forkyard.orchestrator.store import SandboxRecord
from forkyard.orchestrator.teardown import Teardown
from forkyard.repository.snapshots import SnapshotStore

log = logging.getLogger("forkyard.orchestrator")


@dataclass(eq=False, repr=False)
class Handover:
    """Sandboxes and images moving between nodes.

    Args:
        settings: ``max_disk_mb``, ``default_disk_mb`` (an adopted record's disk bound).
        table: the sandboxes.
        snapshots: the shared repository.
        teardown: removes a forgotten sandbox that still runs here.
    """

    settings: Settings
    table: SandboxTable
    snapshots: SnapshotStore
    teardown: Teardown

    async def adopt(self, rec: SandboxRecord) -> SandboxRecord:
        """Take over a paused sandbox whose node is gone or draining (its state is a
        committed ``pause`` snapshot in the shared repository): a ``paused`` row with no
        slot; ``resume``/``connect`` then restore it here. Idempotent.

        Raises:
            BadRequest: ``rec`` is not paused or has no pause image.
            NotFound: its pause image is not in the repository.
            Conflict: this node holds the sandbox in another state.
        """
        if rec.state != "paused" or not rec.image_id:
            raise BadRequest(f"only a paused sandbox with a pause image can be adopted (got {rec.state})")
        table = self.table
        async with table.locks[rec.id]:
            cur = table.store.get(rec.id)
            if cur is not None:
                if cur.state != "paused":
                    raise Conflict(f"sandbox {rec.id} is {cur.state} on this node")
                return cur
            meta = await asyncio.to_thread(self.snapshots.get, rec.image_id)
            if meta is None:
                raise NotFound(f"paused state {rec.image_id} of sandbox {rec.id} is not in the repository")
            if meta.kind != "pause":
                raise BadRequest(f"{rec.image_id} is a {meta.kind} image, not a pause image")
            if not 0 < rec.disk_mb <= self.settings.max_disk_mb:  # a record never lifts the disk bound
                rec.disk_mb = meta.disk_mb or self.settings.default_disk_mb
            rec.slot = None
            table.store.put(rec)
            log.info("adopted paused sandbox %s (image %s)", rec.id, rec.image_id)
            return rec

    async def forget(self, sandbox_id: str) -> None:
        """Drop a sandbox the cluster has given to another node (or reported gone while
        this node was unreachable): a running one is destroyed, a paused one only loses
        its row here — its pause image stays in the repository for its new node."""
        table = self.table
        async with table.locks[sandbox_id]:
            await table.settle(sandbox_id)
            rec = table.store.get(sandbox_id)
            if rec is None:
                return
            log.warning("sandbox %s belongs to another node now (or was reported gone); dropping it here", sandbox_id)
            if rec.state != "paused" or rec.slot is not None:  # running, or paused but still frozen here
                await self.teardown.destroy(rec.id, rec.slot)
            table.store.delete(rec.id)
        table.locks.pop(sandbox_id, None)

    async def delete_image(self, snapshot_id: str) -> bool:
        """Delete a ``fork`` image exported for other nodes' children (the gateway
        calls this once they all run). Returns False when there is no such fork image."""
        meta = await asyncio.to_thread(self.snapshots.get, snapshot_id)
        if meta is None or meta.kind != "fork":
            return False
        return await asyncio.to_thread(self.snapshots.delete, snapshot_id)
