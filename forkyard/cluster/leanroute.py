"""One JSON route answered in front of FastAPI (issue 26: the scheduler's placements).

At hundreds of placements a second FastAPI's request path (routing, dependency
resolution, the body read and validated through its own machinery, the answer through
``jsonable_encoder``) cost more of the scheduler's CPU than the placement itself:
~1.5 ms of ~2.1 ms per ``POST /v1/placements`` measured in-process. :class:`LeanRoute`
answers one method and path itself — the body bounded while it is read
(:func:`~forkyard.relay.body.read_body`), validated by the route's pydantic model
(pydantic-core parsing the JSON directly), the handler's dict sent as a ``JSONResponse`` —
and passes every other request on. It sits after the scheduler's guard (path rule,
credential, announced length) and its observability middleware, so the request is
checked, logged and traced as before. Errors are the scheduler's: ``{"code", "message"}``
with the status of an ``HTTPException`` the handler raises, 413 for a body over the
bound, 422 for one that does not validate, 503 while Redis is away.
"""

from __future__ import annotations

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from forkyard.cluster.store import ClusterStoreUnavailable
from forkyard.relay.body import BodyTooLarge, read_body


def error_response(status: int, message: str) -> JSONResponse:
    """The control plane's error answer: ``{"code": status, "message": message}``."""
    return JSONResponse({"code": status, "message": message}, status_code=status)


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
                return await error_response(422, problem(e, self.what))(scope, receive, send)
            out = await self.handler(body)
        except BodyTooLarge as e:
            resp = error_response(413, str(e))
        except HTTPException as e:
            resp = error_response(e.status_code, str(e.detail))
        except ClusterStoreUnavailable as e:
            resp = error_response(503, f"{e}; retry when Redis is back")
        else:
            resp = JSONResponse(out)
        await resp(scope, receive, send)
