"""Sandbox logs: the lines envd (the sandbox's init) and the runtime wrote to the
sandbox's console log since it last started or resumed, as E2B's ``SandboxLogEntry``
records (``timestamp``, ``level``, ``message``, ``fields``).

envd logs with Go's ``log`` package in UTC with microseconds and an ``envd: `` message
prefix (``2026/12/01 03:41:03.123456 envd: process 12 started: sh -c …``), including
every process it starts and how it ended. Other lines (the runtime's) carry the time of
the envd line before them (or the file's start) and ``fields.source = "runtime"``.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from forkyard.ids import rfc3339

#: At most this many bytes from the end of a console log are read.
MAX_READ_BYTES = 4 << 20
LEVELS = ("debug", "info", "warn", "error")

_ENVD = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{6}) envd: (.*)$")
_PROC = re.compile(r"^process (\d+) (started|ended): (.*)$")
_ERROR = re.compile(r"\b(error|panic|failed|fatal)\b", re.IGNORECASE)


def read_entries(path: Path) -> list[dict]:
    """Entries of console log ``path`` in file order (empty when it does not exist).
    Each: ``timestampUnixMs`` (int), ``timestamp`` (ISO 8601 UTC), ``level``,
    ``message``, ``fields`` (``source``: envd|runtime; ``pid``/``event`` for process
    lines)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            f.seek(max(0, size - MAX_READ_BYTES))
            raw = f.read()
        start_ms = int(path.stat().st_ctime * 1000)
    except FileNotFoundError:
        return []
    if size > MAX_READ_BYTES:
        raw = raw.split(b"\n", 1)[-1]  # drop the partial first line
    out, last_ms = [], start_ms
    for line in raw.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        m = _ENVD.match(line)
        if m:
            t = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            last_ms = int(t.timestamp() * 1000)
            message, fields = m.group(2), {"source": "envd"}
            p = _PROC.match(message)
            if p:
                fields.update(pid=p.group(1), event=p.group(2))
        else:
            message, fields = line, {"source": "runtime"}
        level = "error" if _ERROR.search(message) else ("info" if fields["source"] == "envd" else "warn")
        if fields.get("event") == "ended" and not message.endswith("exit status 0"):
            level = "warn"
        out.append({"timestampUnixMs": last_ms, "timestamp": rfc3339(last_ms / 1000, "milliseconds"),
                    "level": level, "message": message, "fields": fields})
    return out


def select(entries: list[dict], cursor_ms: int | None, limit: int, direction: str = "forward",
           level: str | None = None, search: str | None = None) -> list[dict]:
    """E2B v2 logs selection: entries at or after ``cursor_ms`` oldest first
    (``forward``), or at or before it newest first (``backward``; no cursor: from the
    newest); at least ``level`` (debug < info < warn < error); containing ``search``;
    at most ``limit``."""
    floor = LEVELS.index(level) if level else 0
    picked = [e for e in entries if LEVELS.index(e["level"]) >= floor and (not search or search in e["message"])]
    if direction == "backward":
        picked = [e for e in reversed(picked) if cursor_ms is None or e["timestampUnixMs"] <= cursor_ms]
    else:
        picked = [e for e in picked if cursor_ms is None or e["timestampUnixMs"] >= cursor_ms]
    return picked[:limit]
