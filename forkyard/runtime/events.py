"""forkyard's own log entries about a sandbox, kept apart from what the sandbox writes.

A sandbox's console (``console.log``: envd's log and anything written to its stdio
inside) is the sandbox's output — root inside can write any line there, so nothing in
it is taken as forkyard's word (:mod:`forkyard.orchestrator.logs`). What forkyard itself
has to say about a sandbox (it started, from what; a start failed) goes to
``<workdir>/events.log``, a host file no process inside the sandbox can open: one JSON
object per line, ``{"ts_ms": int, "level": "debug"|"info"|"warn"|"error",
"message": str}``, written by the runtime driver. Bounded: past :data:`MAX_BYTES` the
file is renamed ``events.log.1`` (replacing the older one) and started anew.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "events.log"
#: Size (bytes) past which ``events.log`` starts anew (the previous one kept as ``.1``).
MAX_BYTES = 256 << 10
LEVELS = ("debug", "info", "warn", "error")


def rotated(console: Path) -> Path:
    """The older half of console log ``console`` (``console.log.1``): a driver that
    bounds its console (:mod:`forkyard.runtime.gvisor.console`) renames the full half
    there; the logs read both."""
    return console.with_name(console.name + ".1")


def path(workdir: Path) -> Path:
    """The events file of the sandbox whose directory is ``workdir``."""
    return Path(workdir) / FILE


def record(workdir: Path, level: str, message: str) -> None:
    """Append one entry (``level`` one of :data:`LEVELS`; now, in ms). Never raises: a
    failure is logged (an entry is not worth failing a start)."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} not one of {LEVELS}")
    p = path(workdir)
    line = json.dumps({"ts_ms": int(time.time() * 1000), "level": level, "message": message}) + "\n"
    try:
        try:
            if p.stat().st_size > MAX_BYTES:
                os.replace(p, p.with_name(FILE + ".1"))
        except FileNotFoundError:
            pass
        with open(p, "a", encoding="utf-8") as f:
            f.write(line)
    except OSError as e:
        log.warning("cannot record %r for %s: %s", message, Path(workdir).name, e)


def read(workdir: Path) -> list[dict]:
    """Every entry of ``workdir``'s events (older file first), as written; lines that do
    not parse are skipped."""
    out = []
    for p in (path(workdir).with_name(FILE + ".1"), path(workdir)):
        try:
            text = p.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            try:
                e = json.loads(line)
                if e.get("level") in LEVELS:
                    out.append({"ts_ms": int(e["ts_ms"]), "level": e["level"], "message": str(e["message"])})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
    return out
