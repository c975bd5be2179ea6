"""Issue 25, item 9: a build step printing without newlines cannot stall the server.

The build's line buffer had no bound and was re-copied on every chunk on the event loop
(200 MB of output ran > 600 s at 100 % CPU, ``/health`` took up to 1.8 s, killing the
build sandbox did not stop it). Lines are now cut at 8 KiB and a build keeps at most
16 MiB of log messages."""

from __future__ import annotations

import secrets
import time

import httpx

from test_sec_bombs import _PeakRss


def _build_sandbox(c, template_id: str) -> str | None:
    for s in c.get("/v2/sandboxes").json():
        if (s.get("metadata") or {}).get("forkyard.template") == template_id and \
                "forkyard.templateBuild" in s["metadata"]:
            return s["sandboxID"]
    return None


def test_endless_line_keeps_the_server_responsive_and_killing_the_sandbox_ends_the_build(server):
    with server.api() as c:
        r = c.post("/v3/templates", json={"name": "endless-" + secrets.token_hex(3)})
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        steps = [{"type": "RUN", "args": ["yes xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx | tr -d '\\n'", "root"]}]
        with _PeakRss(server.proc.pid) as peak:
            assert c.post(f"/v2/templates/{tid}/builds/{bid}", json={"steps": steps}).status_code == 202
            deadline = time.time() + 60
            while (sid := _build_sandbox(c, tid)) is None and time.time() < deadline:
                time.sleep(0.5)
            assert sid, "the build sandbox did not start"
            time.sleep(3)  # output is flowing
            worst = 0.0
            until = time.time() + 10
            with httpx.Client(timeout=10) as h:
                while time.time() < until:
                    t0 = time.perf_counter()
                    assert h.get(f"{server.url}/health").status_code == 200
                    worst = max(worst, time.perf_counter() - t0)
                    time.sleep(0.1)
            st = c.get(f"/templates/{tid}/builds/{bid}/status", params={"logsOffset": 0, "limit": 100}).json()
            assert st["status"] == "building", st
            assert all(len(e["message"]) <= 8192 for e in st["logEntries"])
            # Killing the build sandbox ends the build promptly.
            t0 = time.time()
            assert c.delete(f"/sandboxes/{sid}").status_code == 204
            while time.time() - t0 < 30:
                st = c.get(f"/templates/{tid}/builds/{bid}/status").json()
                if st["status"] != "building":
                    break
                time.sleep(0.5)
            ended = time.time() - t0
        print(f"/health worst {worst * 1000:.0f} ms while a step printed one endless line; build ended "
              f"{ended:.1f} s after its sandbox was killed; server memory +{peak.growth >> 20} MiB")
        assert worst < 0.5, f"/health took {worst:.2f} s"
        assert st["status"] == "error", st
        assert ended < 20
        assert peak.growth < 150 << 20, f"server memory grew by {peak.growth >> 20} MiB"
        c.delete(f"/templates/{tid}")
