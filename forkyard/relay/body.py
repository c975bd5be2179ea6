"""Reading a whole ASGI request body under a size bound (the control plane's JSON
routes: the scheduler's heartbeat route, :mod:`forkyard.cluster.beats`, and the
gateway's create and fork, :mod:`forkyard.cluster.gateway`). The bound is checked
while the body is read, so a client cannot make the server hold more than ``limit``
bytes whatever its ``Content-Length`` says (ASGI spec, "HTTP" → "Request")."""

from __future__ import annotations


class BodyTooLarge(Exception):
    """The body went over ``limit`` bytes while it was read (answer 413)."""

    def __init__(self, limit: int):
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


async def read_body(receive, limit: int) -> bytes | None:
    """The request body: every ``http.request`` message's ``body`` joined, at most
    ``limit`` bytes; None when the client disconnected before the last message.

    Raises:
        BodyTooLarge: more than ``limit`` bytes arrived (the rest is not read).
    """
    chunks, size = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return None
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
        if not msg.get("more_body"):
            return b"".join(chunks)
