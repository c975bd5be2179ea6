"""The web console: plain HTML/JS/CSS served at ``/console`` by node and gateway (no
build step, no third-party frontend code). The page talks to the same E2B REST API the
SDKs use, with the API key from ``sessionStorage`` in ``X-API-Key`` (never in a URL);
serving the files themselves needs no key (they hold no data)."""

from __future__ import annotations

from pathlib import Path

from starlette.responses import JSONResponse, Response

_DIR = Path(__file__).resolve().parent
#: URL path → (file, media type); nothing else under /console is served.
FILES = {
    "/console": ("index.html", "text/html; charset=utf-8"),
    "/console/": ("index.html", "text/html; charset=utf-8"),
    "/console/console.js": ("console.js", "text/javascript; charset=utf-8"),
    "/console/console.css": ("console.css", "text/css; charset=utf-8"),
}
#: Same-origin only, no inline script, not framable (the page handles the API key).
HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


async def serve(scope, receive, send) -> None:
    """Answer a ``/console…`` request: one of :data:`FILES` (GET/HEAD), else 404/405 JSON."""
    entry = FILES.get(scope["path"])
    if scope.get("method") not in ("GET", "HEAD"):
        resp = JSONResponse({"code": 405, "message": "the console is read with GET"}, status_code=405)
    elif entry is None:
        resp = JSONResponse({"code": 404, "message": f"no console file at {scope['path']}"}, status_code=404)
    else:
        body = (_DIR / entry[0]).read_bytes()
        resp = Response(body if scope["method"] == "GET" else b"", media_type=entry[1], headers=HEADERS)
    await resp(scope, receive, send)
