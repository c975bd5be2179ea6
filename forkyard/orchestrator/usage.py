"""Sandbox CPU use measured on the host, for ``GET /sandboxes/{id}/metrics``.

Under gVisor a sandbox's ``/proc/stat`` is all zeros (measured), so envd cannot see its
own CPU use; the runtime's cgroup counts it (:meth:`RuntimeDriver.usage`). The share is
computed like E2B envd's (gopsutil ``cpu.Percent``): CPU time used since the previous
sample over the wall time × the CPUs the sandbox may use, in percent (0-100).
"""

from __future__ import annotations

import asyncio
import time

from forkyard.runtime.base import RuntimeDriver

#: A previous sample younger than this is too short a window; one older is stale.
MIN_WINDOW_S = 0.2
MAX_WINDOW_S = 60.0
#: Window sampled when there is no usable previous sample (s).
FRESH_WINDOW_S = 0.5


class CpuMeter:
    """Per-sandbox CPU share from successive host-side samples.

    Args:
        driver: the runtime whose :meth:`~RuntimeDriver.usage` gives CPU time.
    """

    def __init__(self, driver: RuntimeDriver):
        self._driver = driver
        self._last: dict[str, tuple[float, int]] = {}

    async def percent(self, sandbox_id: str) -> tuple[float, float] | None:
        """``(cpu_used_pct, cpu_limit)`` of a running sandbox, or None when the runtime
        has no host-side figure. The share covers the time since the previous call
        (between 0.2 and 60 s ago), else a fresh 0.5 s window (the call then takes
        that long)."""
        now = time.monotonic()
        cur = await self._driver.usage(sandbox_id)
        if cur is None:
            self._last.pop(sandbox_id, None)
            return None
        prev = self._last.get(sandbox_id)
        if prev is None or not (MIN_WINDOW_S <= now - prev[0] <= MAX_WINDOW_S) or cur.cpu_ns < prev[1]:
            prev = (now, cur.cpu_ns)
            await asyncio.sleep(FRESH_WINDOW_S)
            now = time.monotonic()
            cur = await self._driver.usage(sandbox_id)
            if cur is None:
                return None
        self._last[sandbox_id] = (now, cur.cpu_ns)
        for sid in [k for k, (t, _) in self._last.items() if now - t > 2 * MAX_WINDOW_S]:
            del self._last[sid]  # sandboxes nobody asked about lately (or gone)
        wall_ns = (now - prev[0]) * 1e9
        pct = (cur.cpu_ns - prev[1]) / (wall_ns * cur.cpu_limit) * 100 if wall_ns > 0 else 0.0
        return round(min(max(pct, 0.0), 100.0), 2), cur.cpu_limit
