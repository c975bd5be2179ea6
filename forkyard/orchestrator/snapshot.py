"""User snapshots: running → snapshotting → running (``checkpoint --leave-running``, or
a filesystem-only export), committed as a reusable ``snapshot`` image (usable as a
``templateID``); listing and deleting them.
"""

from __future__ import annotations
from dataclasses import dataclass

from forkyard.config import Settings
from forkyard.ids import is_name
from forkyard.obs import metrics
from forkyard.orchestrator import images
from forkyard.orchestrator.errors import BadRequest, Conflict, NotFound
from forkyard.orchestrator.holds import hold
from forkyard.orchestrator.staging import Stager, meta_for
from forkyard.orchestrator.state import SandboxTable
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore, new_snapshot_id


@dataclass(eq=False, repr=False)
class Snapshotter:
    """Takes, lists and deletes user snapshots.

    Args:
        settings: where templates are (a snapshot name may not be a template's).
        table: the sandboxes.
        stager: stages and commits the image.
        snapshots: the repository.
    """

    settings: Settings
    table: SandboxTable
    stager: Stager
    snapshots: SnapshotStore

    @metrics.timed("snapshot")
    async def snapshot(self, sandbox_id: str, name: str | None = None, memory: bool = True) -> SnapshotMeta:
        """Persist the running sandbox's memory + filesystem as a reusable snapshot
        (usable as ``templateID``); the sandbox is stopped only for the checkpoint.
        A ``name`` already in use moves to the new snapshot (E2B semantics).
        ``memory`` False (E2B ``memory: false``): the filesystem only — the sandbox is
        frozen just while its writable layer is exported (``freeze`` + ``export``
        phases); sandboxes created from it cold-boot over those files.

        Raises:
            NotFound, Conflict (paused/busy), BadRequest (bad name),
            FsImageTooLarge (``memory`` False and the files exceed
            :meth:`Stager.fs_image_limit`; 409, the sandbox keeps running),
            CreateFailed (runsc failed; the sandbox keeps running).
        """
        if name is not None and not is_name(name):
            raise BadRequest("snapshot name must be 1-64 of a-z, 0-9, '-' and '_', starting with a letter or digit")
        if name is not None and images.resolve(self.settings, name) is not None:
            raise Conflict(f"{name!r} is a template; choose another snapshot name")
        table = self.table
        async with table.locks[sandbox_id]:
            rec = table.running(sandbox_id)
            if rec.volume_mounts:
                raise Conflict(f"sandbox {sandbox_id} mounts volumes: snapshots of such sandboxes are not "
                               "supported yet (a sandbox made from one would restore without them)")
            rec.state = "snapshotting"
            table.store.put(rec)
            try:
                sid = new_snapshot_id()
                staging = await (self.stager.stage(rec, sid) if memory else self.stager.stage_fs(rec, sid, thaw=True))
                await hold("snapshot.staged", rec.id)
                return await self.stager.commit(staging, meta_for(rec, "snapshot", sid, [name] if name else [],
                                                                  memory=memory))
            finally:
                rec.state = "running"
                table.store.put(rec)

    def list_snapshots(self, sandbox_id: str | None = None, name: str | None = None) -> list[SnapshotMeta]:
        """User-visible snapshots, oldest first, filtered by source sandbox / name."""
        out = [m for m in self.snapshots.list("snapshot") if not images.is_template_build(m)]
        if sandbox_id:
            out = [m for m in out if m.source_sandbox_id == sandbox_id]
        if name:
            out = [m for m in out if name in m.names or m.snapshot_id == name]
        return out

    def delete_snapshot(self, ref: str) -> None:
        """Delete a user-visible snapshot (id or name).

        Raises:
            NotFound: no such snapshot.
            Conflict: it is a built template's own snapshot (delete the template).
        """
        meta = self.snapshots.find(ref)
        if meta is not None and images.is_template_build(meta):
            raise Conflict(f"{ref!r} is the build of template {meta.metadata[images.TEMPLATE_KEY]!r}, not a snapshot; "
                           "delete the template instead (`forkyard template rm`, E2B `Template.delete`)")
        if meta is None or not self.snapshots.delete(meta.snapshot_id):
            raise NotFound(f"snapshot {ref!r} not found")
