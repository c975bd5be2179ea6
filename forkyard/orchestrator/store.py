"""SQLite persistence for sandboxes.

One row per sandbox, written on every state transition (``synchronous=FULL``, WAL) so a
restarted server knows every sandbox. Timestamps are UNIX seconds (float, UTC).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (
    id TEXT PRIMARY KEY,
    template_id TEXT NOT NULL,
    state TEXT NOT NULL,
    slot INTEGER,
    vcpus INTEGER NOT NULL,
    memory_mb INTEGER NOT NULL,
    started_at REAL NOT NULL,
    end_at REAL NOT NULL,
    auto_pause INTEGER NOT NULL,
    metadata TEXT NOT NULL,
    env_vars TEXT NOT NULL,
    envd_access_token TEXT,
    client_id TEXT NOT NULL DEFAULT 'forkyard',
    image_id TEXT,
    timeout_s INTEGER NOT NULL DEFAULT 300,
    paused_at REAL,
    disk_mb INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sandboxes_state ON sandboxes(state);
"""

#: Lifecycle states (shared/DESIGN.md §4). Only ``running``/``paused`` are shown by the API.
STATES = ("creating", "running", "pausing", "paused", "resuming", "snapshotting", "forking", "killing")
#: Columns added after the first schema, with their SQL type (migrated on open).
_ADDED = {"image_id": "TEXT", "timeout_s": "INTEGER NOT NULL DEFAULT 300", "paused_at": "REAL",
          "auto_resume": "INTEGER NOT NULL DEFAULT 0", "egress": "TEXT", "traffic_token": "TEXT",
          "mask_host": "TEXT", "disk_mb": "INTEGER NOT NULL DEFAULT 0",
          "auto_pause_memory": "INTEGER", "default_user": "TEXT", "default_workdir": "TEXT",
          "auto_pause_default": "INTEGER NOT NULL DEFAULT 0", "volume_mounts": "TEXT"}


@dataclass
class SandboxRecord:
    """Persisted sandbox. ``started_at``/``end_at`` are UNIX seconds; ``slot`` is the
    network slot index (None while not allocated)."""

    id: str
    template_id: str
    state: str
    slot: int | None
    vcpus: int
    memory_mb: int
    started_at: float
    end_at: float
    auto_pause: bool
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    envd_access_token: str | None = None
    client_id: str = "forkyard"
    #: snapshot the runtime state came from (fork/snapshot/resume) or, while paused,
    #: the pause snapshot holding the sandbox's state.
    image_id: str | None = None
    #: the timeout (s) given at create/connect; a resume runs for this long again.
    timeout_s: int = 300
    #: UNIX seconds when the sandbox was paused (retention), else None.
    paused_at: float | None = None
    #: E2B ``autoResume.enabled``: traffic through the proxy resumes it when paused.
    auto_resume: bool = False
    #: egress policy ``{"allowOut": [CIDR...], "denyOut": [CIDR...]}`` (see
    #: :mod:`forkyard.network.egress`); empty: unfiltered.
    egress: dict = field(default_factory=dict)
    #: E2B ``trafficAccessToken`` (``network.allowPublicTraffic: false``): requests to the
    #: sandbox's user ports must carry it in ``e2b-traffic-access-token``.
    traffic_token: str | None = None
    #: E2B ``network.maskRequestHost``: the Host user-port requests reach the sandbox
    #: with (``${PORT}`` replaced by the port).
    mask_host: str | None = None
    #: disk size (MiB) of its writable layer; 0 = unbounded (rows from before disks).
    disk_mb: int = 0
    #: E2B ``autoPauseMemory``: False = the timeout auto-pause keeps the filesystem
    #: only (resume cold-boots); None (unset) and True = a full memory pause.
    auto_pause_memory: bool | None = None
    #: user and working directory of envd requests that name none, when a template
    #: build set them (None: envd's defaults, ``user`` and its home); a cold boot
    #: (filesystem-only resume) sends them to the new envd.
    default_user: str | None = None
    default_workdir: str | None = None
    #: ``auto_pause`` came from the node's default, not from the creator (see
    #: :attr:`~forkyard.config.Settings.short_timeout_kill_s`).
    auto_pause_default: bool = False
    #: E2B ``volumeMounts``: ``[{"id": volume id, "name": its name, "path": guest path}]``
    #: (:mod:`forkyard.orchestrator.volumes`), bind-mounted at every start, resume and restore.
    volume_mounts: list[dict] = field(default_factory=list)


class Store:
    """Thread-safe SQLite store of :class:`SandboxRecord` rows.

    ``listeners`` are called as ``f(sandbox_id)`` after every :meth:`put` and
    :meth:`delete` (on the caller's thread; they must be quick and never raise): a
    cluster node mirrors its sandboxes to the cluster state store through them.

    Raises :class:`sqlite3.Error` on I/O failure; callers treat it as a 500.
    """

    def __init__(self, path: Path):
        self.listeners: list = []
        path.parent.mkdir(parents=True, exist_ok=True)
        # It holds envd tokens and users' env vars: 0600, and SQLite gives the WAL and
        # SHM files the database file's mode (older data dirs: fixed here too).
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        for p in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
            if p.exists():
                p.chmod(0o600)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
            have = {r[1] for r in self._db.execute("PRAGMA table_info(sandboxes)")}
            for col, sqltype in _ADDED.items():
                if col not in have:
                    self._db.execute(f"ALTER TABLE sandboxes ADD COLUMN {col} {sqltype}")

    def close(self) -> None:
        """Close the database connection."""
        with self._lock:
            self._db.close()

    @staticmethod
    def _row(row: sqlite3.Row) -> SandboxRecord:
        d = dict(row)
        d["auto_pause"] = bool(d["auto_pause"])
        d["auto_resume"] = bool(d.get("auto_resume"))
        d["auto_pause_default"] = bool(d.get("auto_pause_default"))
        apm = d.get("auto_pause_memory")
        d["auto_pause_memory"] = None if apm is None else bool(apm)
        d["egress"] = json.loads(d["egress"]) if d.get("egress") else {}
        d["metadata"] = json.loads(d["metadata"])
        d["env_vars"] = json.loads(d["env_vars"])
        d["volume_mounts"] = json.loads(d["volume_mounts"]) if d.get("volume_mounts") else []
        return SandboxRecord(**d)

    def put(self, rec: SandboxRecord) -> None:
        """Insert or replace the whole row."""
        d = asdict(rec)
        d["auto_pause"] = int(rec.auto_pause)
        d["auto_resume"] = int(rec.auto_resume)
        d["auto_pause_default"] = int(rec.auto_pause_default)
        d["auto_pause_memory"] = None if rec.auto_pause_memory is None else int(rec.auto_pause_memory)
        d["egress"] = json.dumps(rec.egress) if rec.egress else None
        d["metadata"] = json.dumps(rec.metadata)
        d["env_vars"] = json.dumps(rec.env_vars)
        d["volume_mounts"] = json.dumps(rec.volume_mounts) if rec.volume_mounts else None
        cols = ", ".join(d)
        marks = ", ".join(f":{k}" for k in d)
        with self._lock:
            self._db.execute(f"INSERT OR REPLACE INTO sandboxes ({cols}) VALUES ({marks})", d)
        self._notify(rec.id)

    def _notify(self, sandbox_id: str) -> None:
        for listener in self.listeners:
            listener(sandbox_id)

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        """Row for ``sandbox_id`` or None."""
        with self._lock:
            row = self._db.execute("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,)).fetchone()
        return self._row(row) if row else None

    def all(self) -> list[SandboxRecord]:
        """Every row, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM sandboxes ORDER BY started_at").fetchall()
        return [self._row(r) for r in rows]

    def delete(self, sandbox_id: str) -> None:
        """Remove the row (no error when absent)."""
        with self._lock:
            self._db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        self._notify(sandbox_id)
