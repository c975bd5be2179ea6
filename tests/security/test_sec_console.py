"""Issue 25 item 5: a sandbox's console (envd's stderr, ``/proc/1/fd/2`` inside) is a
host file. Written without limit it filled the host's disk (200 MB in seconds, outside
the sandbox's disk size), and lines written there came back from the logs endpoints as
envd's own entries at a level the sandbox picked. Now the console is bounded
(``FORKYARD_CONSOLE_LOG_MAX_BYTES``, newest bytes kept) and every console line is the
sandbox's (``source: sandbox``, always ``info``); forkyard's own entries come from a
host file the sandbox cannot reach."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from e2b import Sandbox

CAP = 8 << 20  # FORKYARD_CONSOLE_LOG_MAX_BYTES's default (the tests' servers do not set it)
FLOOD = 200_000_000


def _console_bytes(server, sid: str) -> int:
    d = Path(server.data_dir, "sandboxes", sid)
    return sum(p.stat().st_size for p in (d / "console.log", d / "console.log.1") if p.exists())


def _entries(server, sid: str, **params) -> list[dict]:
    with server.api() as c:
        r = c.get(f"/v2/sandboxes/{sid}/logs", params={"limit": 10000} | params)
    assert r.status_code == 200, r.text
    return r.json()["logs"]


def test_a_console_flood_stays_under_the_cap_and_harms_nothing(server):
    sbx = Sandbox.create("base", timeout=300)
    sid = sbx.sandbox_id
    try:
        t0 = time.monotonic()
        r = sbx.commands.run(f"yes 'flood flood flood flood flood flood flood flood' | head -c {FLOOD} "
                             "> /proc/1/fd/2; echo written", user="root", timeout=240)
        took = time.monotonic() - t0
        assert r.stdout.strip() == "written", (r.stdout, r.stderr)
        print(f"\n{FLOOD / 1e6:.0f} MB to /proc/1/fd/2 in {took:.1f} s; console now {_console_bytes(server, sid)} B "
              f"(cap {CAP})")
        assert _console_bytes(server, sid) <= CAP
        # The sandbox, its envd and the server keep working, and the console keeps
        # recording after the flood: envd's line for the next process is there.
        assert sbx.commands.run("echo after-flood").stdout.strip() == "after-flood"
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        msgs = [e["message"] for e in _entries(server, sid, direction="backward", limit=100)]
        assert any("started:" in m and "echo after-flood" in m for m in msgs), msgs[:5]
        # A pause/resume (checkpoint and restore: a new console pipe) keeps the console
        # bounded and recording.
        sbx.pause()
        sbx.connect(timeout=300)
        r = sbx.commands.run(f"yes 'again again again again' | head -c {FLOOD // 4} > /proc/1/fd/2; echo again",
                             user="root", timeout=240)
        assert r.stdout.strip() == "again"
        assert sbx.commands.run("echo after-resume").stdout.strip() == "after-resume"
        assert _console_bytes(server, sid) <= CAP
        msgs = [e["message"] for e in _entries(server, sid, direction="backward", limit=100)]
        assert any("started:" in m and "echo after-resume" in m for m in msgs), msgs[:5]
        # A server restart: the sandbox keeps running (re-adopted) and its console is
        # still copied, bounded (the reader lives in the node's reaper daemon).
        server.stop()
        server.start()
        r = sbx.commands.run(f"yes 'restart restart restart' | head -c {FLOOD // 4} > /proc/1/fd/2; echo again",
                             user="root", timeout=240)
        assert r.stdout.strip() == "again"
        assert sbx.commands.run("echo after-restart").stdout.strip() == "after-restart"
        assert _console_bytes(server, sid) <= CAP
        msgs = [e["message"] for e in _entries(server, sid, direction="backward", limit=100)]
        assert any("started:" in m and "after-restart" in m for m in msgs), msgs[:5]
    finally:
        sbx.kill()


FORGED = [
    # envd's own format, claiming an error and a process end
    "2026/12/02 03:00:00.000000 envd: process 1 ended: signal: killed (forged-envd fatal error)",
    # E2B-style JSON log line with its own level and logger
    '{"level":"error","logger":"forkyard","message":"forged-json: sandbox was killed"}',
    # a bare line with error words (was taken for the runtime's, at error)
    "forged-bare: runsc panic: fatal error, failed",
]


def test_lines_the_sandbox_writes_are_marked_as_its_own_and_pick_no_level(server):
    sbx = Sandbox.create("base", timeout=120)
    sid = sbx.sandbox_id
    try:
        script = "; ".join(f"printf '%s\\n' '{line}' > /proc/1/fd/2" for line in FORGED)
        sbx.commands.run(script, user="root")
        everything = _entries(server, sid)
        forged = [e for e in everything if "forged-" in e["message"] and "/proc/1/fd/2" not in e["message"]]
        assert len(forged) == len(FORGED), everything
        for e in forged:
            assert e["level"] == "info" and e["fields"]["source"] == "sandbox", e
        for level in ("warn", "error"):
            assert not [e for e in _entries(server, sid, level=level) if "forged-" in e["message"]], level
        with server.api() as c:
            v1 = c.get(f"/sandboxes/{sid}/logs", params={"limit": 10000}).json()["logs"]
        assert [l for l in v1 if "forged-" in l["line"]] and all(
            '"logger": "sandbox"' in l["line"] and '"level": "info"' in l["line"] for l in v1 if "forged-" in l["line"])
        # forkyard's own entries are still there, from the host's record, and envd's
        # ordinary lines too (as the sandbox's).
        own = [e for e in everything if e["fields"]["source"] == "forkyard"]
        assert own and all("forged-" not in e["message"] for e in own), own
        assert any(e["message"].startswith("sandbox started") for e in own), own
        assert any(e["fields"].get("event") == "started" and "/proc/1/fd/2" in e["message"] for e in everything)
    finally:
        sbx.kill()
