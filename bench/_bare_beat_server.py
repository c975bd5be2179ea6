"""The floor under a heartbeat (issue 26): a bare ASGI app on uvicorn, started with the
scheduler's own server options (uvloop and httptools where installed, keep-alive 75 s, no
access log), that reads a ``POST`` body and answers what an unchanged heartbeat is
answered — no key check, no validation, no Redis. ``bench_control_plane.py`` drives it
with the same simulated fleet and reports the scheduler's CPU per heartbeat beside this
server's CPU per request.

Usage: ``python bench/_bare_beat_server.py PORT``.
"""

from __future__ import annotations

import sys

import uvicorn

ANSWER = b'{"status":"up","foreign":[],"missing":[],"adopt":[]}'
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def app(scope, receive, send):
    """Read the whole body, answer :data:`ANSWER` (200)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})


if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=75,
                access_log=False, lifespan="off")
