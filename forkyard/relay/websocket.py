"""WebSocket sessions relayed frame by frame to an upstream (the ``websockets`` client)."""

from __future__ import annotations

import asyncio
import logging

import websockets

from forkyard.relay.headers import target_path

log = logging.getLogger("forkyard.proxy")


async def relay_ws(scope, receive, send, base: str, headers: list[tuple[str, str]]) -> None:
    """Relay a WebSocket session to ``base`` (``ws://host:port``) + the request's path,
    frame by frame in both directions, until either side closes."""
    url = base + target_path(scope)
    msg = await receive()
    if msg["type"] != "websocket.connect":
        return
    try:
        upstream = await websockets.connect(url, additional_headers=headers, subprotocols=scope.get("subprotocols") or None,
                                            open_timeout=5, max_size=None)
    except Exception as e:  # noqa: BLE001 — any failure to reach the sandbox
        log.info("websocket to %s failed: %r", url, e)
        return await send({"type": "websocket.close", "code": 1011})
    await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})

    async def client_to_up():
        while True:
            m = await receive()
            if m["type"] == "websocket.disconnect":
                await upstream.close()
                return
            if m.get("bytes") is not None:
                await upstream.send(m["bytes"])
            elif m.get("text") is not None:
                await upstream.send(m["text"])

    async def up_to_client():
        try:
            async for m in upstream:
                if isinstance(m, bytes):
                    await send({"type": "websocket.send", "bytes": m})
                else:
                    await send({"type": "websocket.send", "text": m})
        finally:
            await send({"type": "websocket.close", "code": upstream.close_code or 1000})

    tasks = [asyncio.create_task(client_to_up()), asyncio.create_task(up_to_client())]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await upstream.close()
