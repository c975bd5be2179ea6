"""Which request paths a relay lets through: one rule for REST request paths, applied
where a request enters the gateway and a node (:func:`path_problem`), and envd's routes
that only the orchestrator may call (:func:`orchestrator_only`).

Every routing and auth decision is made on the decoded path (``scope["path"]``), while
what goes on to a node is the raw target (``scope["raw_path"]``) — and on the way httpx
removes dot segments (RFC 3986 §5.2.4), a node decodes percent-escapes again, and a
proxy in front may fold backslashes or repeated slashes. A path on which any two of
those could disagree (``/template-files/../v2/sandboxes``: a key-less upload route to
the check, the node's sandbox list once forwarded — issue 25, item 1) is refused with
400 instead of being rewritten: no E2B client sends one (the SDKs build REST paths from
ids, names and hashes: ``[A-Za-z0-9_:-]``, UUIDs and hex).

Refused (:func:`path_problem`): a target that is not origin-form (``*``,
``http://…``), ``.``/``..`` segments in any spelling (``%2e``), empty segments (``//``;
a trailing ``/`` is allowed), backslashes, percent-encoded ``/`` ``\\`` ``.`` ``%``
and NUL (one decoding must give the path every hop sees), malformed escapes, and bytes
outside printable ASCII. Sandbox traffic is not subject to it: it is routed on its
headers or Host, and its path belongs to the program in the sandbox (envd's
orchestrator-only routes have their own check, :func:`orchestrator_only`).
"""

from __future__ import annotations

import posixpath
import re
import urllib.parse

from forkyard.config import ENVD_PORT

#: Escapes that would decode into a separator, a dot, an escape or NUL (any case).
_ENCODED = {"%2f": "an encoded '/'", "%5c": "an encoded '\\'", "%2e": "an encoded '.'",
            "%25": "an encoded '%'", "%00": "an encoded NUL"}
_BAD_ESCAPE = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def path_problem(scope) -> str | None:
    """Why the request target of ``scope`` (an ASGI http/websocket scope) cannot be
    routed safely, or None when it can. The message names the first problem found;
    callers answer 400 with it."""
    raw = scope.get("raw_path")
    if raw is None:
        raw = urllib.parse.quote(scope.get("path", "")).encode()
    raw = bytes(raw).split(b"?", 1)[0]
    if not raw.startswith(b"/"):
        return "the request target must be a path starting with '/'"
    if any(b < 0x21 or b > 0x7E for b in raw):
        return "the request path may hold printable ASCII only (percent-encode the rest)"
    if b"\\" in raw:
        return "backslashes are not allowed in the request path"
    low = raw.lower()
    for esc, what in _ENCODED.items():
        if esc.encode() in low:
            return f"the request path holds {what} ({esc.upper()})"
    if _BAD_ESCAPE.search(raw):
        return "the request path holds a malformed percent-escape"
    path = scope.get("path", "")
    if path != urllib.parse.unquote(raw.decode("ascii")):
        return "the request path does not decode to the routed path"
    segments = path.split("/")[1:]
    for i, seg in enumerate(segments):
        if seg in (".", ".."):
            return f"dot segments ({seg!r}) are not allowed in the request path"
        if seg == "" and i != len(segments) - 1:
            return "empty segments ('//') are not allowed in the request path"
    return None


#: envd routes only the orchestrator may call (it reaches envd directly, never through
#: a proxy): ``/init`` sets the access token, env vars and default user, so a caller
#: reaching it could lock the owner out or plant their own token (issue 11, item 6).
ORCHESTRATOR_ONLY_PATHS = frozenset({"/init"})


def orchestrator_only(scope, port: int) -> bool:
    """True when a request for envd (``port`` = :data:`ENVD_PORT`) targets one of
    :data:`ORCHESTRATOR_ONLY_PATHS`, in any spelling envd's Go router would accept:
    percent-encoded, with repeated slashes, dot segments, a trailing slash or an
    absolute-form target (``http://host/init``); compared case-insensitively."""
    if port != ENVD_PORT:
        return False
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    candidates = {scope.get("path", ""), urllib.parse.unquote(raw.decode("latin-1").split("?")[0])}
    for path in candidates:
        if "://" in path:
            path = urllib.parse.urlsplit(path).path
        clean = posixpath.normpath("/" + urllib.parse.unquote(path)).lower()
        if clean.startswith("//"):
            clean = "/" + clean.lstrip("/")
        if clean in ORCHESTRATOR_ONLY_PATHS:
            return True
    return False
