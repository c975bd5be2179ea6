"""Hot pause: the frozen runtime of a paused sandbox is kept on its node for a while, so
a resume is an unfreeze (``runsc resume``, ~10-20 ms) instead of a restore from the
checkpoint image (~200 ms and more).

The pause stays durable all the same: the sandbox is frozen first (nothing runs past
that point), checkpointed with ``--leave-running`` (it stays frozen) and the image is
committed as for any pause, so a crash, a restart or an eviction loses nothing — the
next resume then restores from the image. Kept copies are dropped when their grace
period ends, when more than ``max_kept`` are kept (oldest first), when the host's
available memory falls under ``min_available_pct`` (oldest first, one per check), and
when the node stops. A node in a cluster keeps none: a paused sandbox may resume on
another node there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from forkyard.network.base import Slot


def available_memory_pct() -> float | None:
    """``MemAvailable`` as a percentage of ``MemTotal`` (``/proc/meminfo``), or None."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0])
        return 100.0 * info["MemAvailable"] / info["MemTotal"]
    except (OSError, KeyError, ValueError, ZeroDivisionError):
        return None


@dataclass
class HotPaused:
    """The frozen sandboxes a node keeps, by id, with the network slot each still holds.

    Attributes:
        grace_s: seconds a paused sandbox stays frozen (``FORKYARD_HOT_PAUSE_S``); 0
            disables hot pause.
        max_kept: most sandboxes kept at once (``FORKYARD_HOT_PAUSE_MAX``).
        min_available_pct: below this share of available host memory (%), the oldest
            kept sandbox is dropped at each check.
    """

    grace_s: float
    max_kept: int
    min_available_pct: float = 10.0
    _kept: dict[str, tuple[Slot, float]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.grace_s > 0 and self.max_kept > 0

    def keep(self, sandbox_id: str, slot: Slot) -> None:
        """Record that ``sandbox_id`` is paused but still frozen in ``slot``."""
        self._kept[sandbox_id] = (slot, time.monotonic())

    def take(self, sandbox_id: str) -> Slot | None:
        """Forget ``sandbox_id`` and return its slot (None if it is not kept)."""
        entry = self._kept.pop(sandbox_id, None)
        return entry[0] if entry else None

    def slot(self, sandbox_id: str) -> Slot | None:
        """The slot ``sandbox_id`` is kept in (None if it is not kept); it stays kept."""
        entry = self._kept.get(sandbox_id)
        return entry[0] if entry else None

    def __contains__(self, sandbox_id: str) -> bool:
        return sandbox_id in self._kept

    def __len__(self) -> int:
        return len(self._kept)

    def ids(self) -> list[str]:
        """Kept ids, oldest first."""
        return sorted(self._kept, key=lambda sid: self._kept[sid][1])

    def due(self, available_pct: float | None = None) -> list[str]:
        """Ids to drop now, oldest first: past their grace period, beyond ``max_kept``,
        and (when ``available_pct`` is under ``min_available_pct``) the oldest one."""
        now = time.monotonic()
        order = self.ids()
        out = [sid for sid in order if now - self._kept[sid][1] >= self.grace_s]
        rest = [sid for sid in order if sid not in out]
        out += rest[:max(0, len(rest) - self.max_kept)]
        rest = [sid for sid in rest if sid not in out]
        if rest and available_pct is not None and available_pct < self.min_available_pct:
            out.append(rest[0])
        return out
