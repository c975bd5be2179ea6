"""Placement clients in a process of their own (``bench_control_plane.py``'s ``Placer``).

The bench's own process runs the simulated fleet (N nodes heartbeating every second); a
client sharing its event loop waited for those heartbeats, so the placement latencies it
measured were mostly the bench's queue. Here ``CLIENTS`` concurrent clients, each on one
keep-alive connection to a scheduler replica (``URLS`` taken in turn), send ``POST
/v1/placements`` until ``TOTAL`` are answered (0: until each is refused for capacity) and
print one JSON line per answer on stdout — ``{"ms": latency, "t": time.monotonic(),
"placements": [...]}`` or ``{"refused": 1}``, after a first ``{"start": time.monotonic()}``
once the clients are ready (the bench's wall time starts there, not at this process's
start-up) — which the bench reads to start the placed sandboxes on its simulated nodes.
The cluster secret comes on stdin, never on the command line.

The clients are as cheap as a client can be — one prebuilt request written on a raw
connection, the answer parsed by httptools (the parser uvicorn uses), uvloop — because
on a 2-core host every millisecond a client spends is taken from the schedulers being
measured: httpx cost ~2.4 ms of CPU per placement here, more than a scheduler did.

Usage: ``python bench/_placer.py URLS(comma-separated) TOTAL CLIENTS < secret``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit

import httptools

from forkyard.cluster.config import SECRET_HEADER

BODY = b'{"kind":"create","snapshot":"base"}'


class _Answer:
    """httptools callbacks: one response's body and whether it is complete."""

    def __init__(self):
        self.body, self.done = [], False

    def on_body(self, b: bytes) -> None:
        self.body.append(b)

    def on_message_complete(self) -> None:
        self.done = True


async def main(urls: list[str], total: int, clients: int, secret: str) -> int:
    """Run the clients; returns the exit status (1: an answer other than 200 or 503)."""
    left = [total]
    out = sys.stdout

    async def client(k: int) -> None:
        u = urlsplit(urls[k % len(urls)])
        reader, writer = await asyncio.open_connection(u.hostname, u.port)
        request = (f"POST /v1/placements HTTP/1.1\r\nHost: {u.netloc}\r\n{SECRET_HEADER}: {secret}\r\n"
                   f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n").encode() + BODY
        try:
            while total == 0 or left[0] > 0:
                left[0] -= 1
                t0 = time.perf_counter()
                writer.write(request)
                answer = _Answer()
                parser = httptools.HttpResponseParser(answer)
                while not answer.done:
                    data = await reader.read(65536)
                    if not data:
                        raise RuntimeError("the scheduler closed the connection")
                    parser.feed_data(data)
                ms = (time.perf_counter() - t0) * 1000
                status, text = parser.get_status_code(), b"".join(answer.body)
                if status == 503:
                    out.write('{"refused":1}\n')
                    if total == 0:
                        return
                    continue
                if status != 200:
                    raise RuntimeError(f"placement: {status} {text[:300]!r}")
                out.write(json.dumps({"ms": ms, "t": time.monotonic(), "placements": json.loads(text)["placements"]})
                          + "\n")
        finally:
            writer.close()

    out.write(json.dumps({"start": time.monotonic()}) + "\n")
    await asyncio.gather(*(client(k) for k in range(clients)))
    out.flush()
    return 0


if __name__ == "__main__":
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    sys.exit(asyncio.run(main(sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3]), sys.stdin.readline().strip())))
