"""Sandbox logs as E2B's ``SandboxLogEntry`` records (``timestamp``, ``level``,
``message``, ``fields``), from two sources kept apart (issue 25 item 5):

* **forkyard's own entries** (``fields.source = "forkyard"``): what the node itself
  recorded about the sandbox (:mod:`forkyard.runtime.events`: it started, from what, a
  start failed) — a host file nothing inside the sandbox can write — plus, for a sandbox
  that died, the cause (:mod:`.tombstones`). Their levels are forkyard's.
* **the sandbox's console** (``fields.source = "sandbox"``): every line of its
  ``console.log`` — envd's log, and anything a process inside wrote to envd's stdio
  (``/proc/1/fd/2``), which root inside can do, so nothing there is forkyard's word.
  These lines are all ``info``: the sandbox cannot pick a level. envd logs with Go's
  ``log`` package in UTC with microseconds and an ``envd: `` prefix (``2026/12/01
  03:41:03.123456 envd: process 12 started: sh -c …``), including every process it
  starts and how it ended; such a line's time, and ``pid``/``event`` in its fields, are
  as the line says (the sandbox's claim); other lines carry the time of the line before.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from pathlib import Path

from forkyard.ids import rfc3339
from forkyard.runtime import events
from forkyard.runtime.events import rotated

#: At most this many bytes from the end of a console log are read.
MAX_READ_BYTES = 2 << 20
#: Longest message kept of one console line (characters; the rest is cut, marked "…").
MAX_LINE_CHARS = 4096
LEVELS = ("debug", "info", "warn", "error")

_ENVD = re.compile(r"^(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d{6}) envd: (.*)$")
_PROC = re.compile(r"^process (\d+) (started|ended): (.*)$")


def _console_tail(path: Path) -> tuple[bytes, int | None]:
    """The last :data:`MAX_READ_BYTES` of console ``path`` and its older half, and the
    time (ms) the older of the two was last changed (None: neither exists)."""
    parts, start_ms = [], None
    for p in (rotated(path), path):
        try:
            with open(p, "rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - MAX_READ_BYTES))
                parts.append(f.read())
                if start_ms is None:
                    start_ms = int(Path(p).stat().st_ctime * 1000)
        except FileNotFoundError:
            continue
    raw = b"".join(parts)
    if len(raw) > MAX_READ_BYTES:
        raw = raw[-MAX_READ_BYTES:].split(b"\n", 1)[-1]  # drop the partial first line
    return raw, start_ms


def _sandbox_entries(path: Path) -> list[dict]:
    raw, start_ms = _console_tail(path)
    out, last_ms = [], start_ms or 0
    for line in raw.decode(errors="replace").splitlines():
        if not line.strip():
            continue
        fields = {"source": "sandbox"}
        message = line
        m = _ENVD.match(line)
        if m:
            try:
                t = datetime.strptime(m.group(1), "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
                last_ms = int(t.timestamp() * 1000)
                message = m.group(2)
            except ValueError:
                pass
            p = _PROC.match(message)
            if p:
                fields.update(pid=p.group(1), event=p.group(2))
        if len(message) > MAX_LINE_CHARS:
            message = message[:MAX_LINE_CHARS] + "…"
        out.append(_entry(last_ms, "info", message, fields))
    return out


def _entry(ms: int, level: str, message: str, fields: dict) -> dict:
    return {"timestampUnixMs": ms, "timestamp": rfc3339(ms / 1000, "milliseconds"),
            "level": level, "message": message, "fields": fields}


def read_entries(path: Path) -> list[dict]:
    """Entries of the sandbox whose console log is ``path`` (``<workdir>/console.log``;
    its events beside it): forkyard's own and the console's, by time (stable: file order
    within each). Each: ``timestampUnixMs`` (int), ``timestamp`` (ISO 8601 UTC),
    ``level``, ``message``, ``fields`` (``source``: forkyard|sandbox; ``pid``/``event``
    for envd's process lines). Empty when neither exists. Blocking (reads ≤ 2 MiB)."""
    own = [_entry(e["ts_ms"], e["level"], e["message"], {"source": "forkyard"})
           for e in events.read(Path(path).parent)]
    return sorted(own + _sandbox_entries(Path(path)), key=lambda e: e["timestampUnixMs"])


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
