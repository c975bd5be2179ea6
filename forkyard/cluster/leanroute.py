"""One JSON route answered in front of FastAPI (issue 26: the scheduler's placements).

At hundreds of placements a second FastAPI's request path (routing, dependency
resolution, the body read and validated through its own machinery, the answer through
``jsonable_encoder``) cost more of the scheduler's CPU than the placement itself:
~1.5 ms of ~2.1 ms per ``POST /v1/placements`` measured in-process. :class:`LeanRoute`
answers one method and path itself — the body bounded while it is read
(:func:`~forkyard.relay.body.read_body`), validated by the route's pydantic model
(pydantic-core parsing the JSON directly), the handler's dict sent with ``json.dumps`` —
and passes every other request on. It sits after the scheduler's guard (path rule,
credential, announced length) and its observability middleware, so the request is
checked, logged and traced as before. Errors are the scheduler's: ``{"code", "message"}``
with the status of an ``HTTPException`` the handler raises, 413 for a body over the
bound, 422 for one that does not validate, 503 while Redis is away.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from forkyard.cluster.store import ClusterStoreUnavailable
from forkyard.relay.body import BodyTooLarge, read_body


async def send_json(send, status: int, obj: dict) -> None:
    """Send ``obj`` as a JSON answer with ``status``."""
    body = json.dumps(obj, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def problem(e: ValidationError, what: str) -> str:
    """A validation error as one line: ``invalid <what>: loc: msg; …`` (first five)."""
    parts = [f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors()[:5]]
    return f"invalid {what}: " + "; ".join(parts)


class LeanRoute:
    """ASGI app: ``method path`` answered by ``handler`` (see the module docstring),
    every other request passed to ``app``.

    Args:
        app: the FastAPI app (which keeps the same route, for its schema and tests).
        method, path: the route (an exact path).
        model: the pydantic model of the body; ``handler(body) -> dict`` the answer (200).
        max_body: the largest body read (bytes).
        what: the body's name in a 422 message.
    """

    def __init__(self, app, method: str, path: str, model: type[BaseModel], handler, max_body: int, what: str):
        self.app, self.method, self.path, self.model = app, method, path, model
        self.handler, self.max_body, self.what = handler, max_body, what

    def __getattr__(self, name):  # the wrapped app's attributes
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != self.method or scope["path"] != self.path:
            return await self.app(scope, receive, send)
        try:
            raw = await read_body(receive, self.max_body)
            if raw is None:
                return
            try:
                body = self.model.model_validate_json(raw)
            except ValidationError as e:
                return await send_json(send, 422, {"code": 422, "message": problem(e, self.what)})
            out = await self.handler(body)
        except BodyTooLarge as e:
            return await send_json(send, 413, {"code": 413, "message": str(e)})
        except HTTPException as e:
            return await send_json(send, e.status_code, {"code": e.status_code, "message": str(e.detail)})
        except ClusterStoreUnavailable as e:
            return await send_json(send, 503, {"code": 503, "message": f"{e}; retry when Redis is back"})
        await send_json(send, 200, out)
