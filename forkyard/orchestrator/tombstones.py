"""Why recently dead sandboxes died, for the clients that ask about them afterwards.

A sandbox that forkyard removes because its runtime stopped by itself (the host's OOM
killer ended it; envd, its init, exited) has no row any more; without a record its
client would only read "not found". E2B's answers stay as they are — the proxy's 502
"The sandbox … was not found" (which the SDKs raise as ``SandboxNotRunningException``),
the API's 404 — and carry the cause after them: "…: it was killed: out of memory
(limit 512 MiB), at 2026-12-01T05:53:12Z".

Kept in memory only, per node: at most :data:`MAX_ENTRIES` sandboxes (oldest dropped
first), each for :data:`KEEP_S` seconds; a server restart forgets them (the answer is
then the plain "not found").
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import datetime, timezone

from forkyard.ids import rfc3339

#: Sandboxes remembered at once (the oldest is forgotten first).
MAX_ENTRIES = 1024
#: How long a death is remembered (s).
KEEP_S = 3600.0
#: Log entries kept of each dead sandbox (its last ones, plus the death's own).
MAX_LOG_ENTRIES = 200


@dataclass
class Tombstone:
    """One dead sandbox.

    Attributes:
        sandbox_id: its id.
        reason: the cause, e.g. ``"out of memory (limit 512 MiB)"``.
        at: when forkyard found it dead (Unix time, s).
        logs: its last log entries (``forkyard.orchestrator.logs`` records), the last
            one saying why it died.
    """

    sandbox_id: str
    reason: str
    at: float
    logs: list[dict] = field(default_factory=list)

    @property
    def iso(self) -> str:
        """:attr:`at` as ISO 8601 UTC to the second (``2026-12-01T05:53:12Z``)."""
        return rfc3339(self.at, "seconds")

    def describe(self) -> str:
        """What a client is told: ``"it was killed: <reason>, at <iso>"``."""
        return f"it was killed: {self.reason}, at {self.iso}"


#: Longest log message kept per entry (characters): a sandbox writes its own console.
MAX_MESSAGE_CHARS = 2048


def _capped(entry: dict) -> dict:
    """``entry`` with its message cut to :data:`MAX_MESSAGE_CHARS` (the rest marked)."""
    msg = entry.get("message")
    if isinstance(msg, str) and len(msg) > MAX_MESSAGE_CHARS:
        return {**entry, "message": msg[:MAX_MESSAGE_CHARS] + " …[cut]"}
    return entry


class Tombstones:
    """A bounded, expiring record of dead sandboxes (see the module docstring)."""

    def __init__(self, max_entries: int = MAX_ENTRIES, keep_s: float = KEEP_S):
        self.max_entries = max_entries
        self.keep_s = keep_s
        self._dead: OrderedDict[str, Tombstone] = OrderedDict()

    def add(self, sandbox_id: str, reason: str, logs: list[dict] | None = None) -> Tombstone:
        """Record that ``sandbox_id`` died of ``reason`` now; ``logs`` are its last log
        entries (at most :data:`MAX_LOG_ENTRIES` are kept), to which an ``error`` entry
        naming the reason is added. Returns the record."""
        now = time.time()
        ms = int(now * 1000)
        entry = {"timestampUnixMs": ms,
                 "timestamp": datetime.fromtimestamp(now, tz=timezone.utc).isoformat(timespec="milliseconds")
                 .replace("+00:00", "Z"),
                 "level": "error", "message": f"sandbox {sandbox_id} was killed: {reason}",
                 "fields": {"source": "forkyard", "event": "killed", "reason": reason}}
        kept = [_capped(e) for e in (logs or [])[-(MAX_LOG_ENTRIES - 1):]]
        tomb = Tombstone(sandbox_id, reason, now, [*kept, entry])
        self._dead.pop(sandbox_id, None)
        self._dead[sandbox_id] = tomb
        while len(self._dead) > self.max_entries:
            self._dead.popitem(last=False)
        return tomb

    def get(self, sandbox_id: str) -> Tombstone | None:
        """The record of ``sandbox_id`` when it died within :attr:`keep_s`, else None."""
        self._expire()
        return self._dead.get(sandbox_id)

    def discard(self, sandbox_id: str) -> None:
        """Forget ``sandbox_id`` (e.g. its id is live again on this node)."""
        self._dead.pop(sandbox_id, None)

    def _expire(self) -> None:
        cutoff = time.time() - self.keep_s
        while self._dead:
            oldest = next(iter(self._dead.values()))
            if oldest.at >= cutoff:
                return
            self._dead.popitem(last=False)

    def __len__(self) -> int:
        self._expire()
        return len(self._dead)
