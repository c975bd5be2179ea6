"""API key handling.

The key comes from ``FORKYARD_API_KEY`` or, when unset, from a 0600 file under the data
dir, generated on first start. Clients send it as ``X-API-Key`` (E2B SDK header).
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from fastapi import HTTPException, Request

from forkyard.config import api_key_from_env


def load_or_create_key(path: Path) -> str:
    """Return the API key: ``$FORKYARD_API_KEY`` if set
    (:func:`forkyard.config.api_key_from_env`), else the content of ``path``, creating
    it (mode 0600, ``e2b_`` + 40 hex chars, the shape of E2B keys) when absent."""
    env = api_key_from_env()
    if env:
        return env.strip()
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    key = "e2b_" + secrets.token_hex(20)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return key


#: Header carrying the control plane's credential: the cluster secret (gateway → scheduler)
#: or a node's own key (gateway → node, node → scheduler; forkyard.cluster.nodekeys). Never forwarded into a sandbox: the gateway sends it only on REST calls,
#: and the node's proxy strips it from sandbox traffic.
CLUSTER_SECRET_HEADER = "x-forkyard-cluster-secret"


def cluster_secret_ok(headers, secret: str | None) -> bool:
    """True when ``headers`` (any case-insensitive mapping) carry ``secret`` in
    :data:`CLUSTER_SECRET_HEADER` (constant-time compare); False when ``secret`` is unset."""
    if not secret:
        return False
    got = headers.get(CLUSTER_SECRET_HEADER, "")
    return bool(got) and hmac.compare_digest(got.encode(), secret.encode())


def require_key(request: Request) -> None:
    """FastAPI dependency: 401 unless ``X-API-Key`` matches the server's key — or, on a
    cluster node, the request carries this node's key (the gateway's calls;
    ``app.state.cluster_secret``, see :mod:`forkyard.cluster.config`)."""
    expected: str = request.app.state.api_key
    got = request.headers.get("x-api-key", "")
    if cluster_secret_ok(request.headers, getattr(request.app.state, "cluster_secret", None)):
        return
    if not got or not hmac.compare_digest(got.encode(), expected.encode()):
        raise HTTPException(status_code=401, detail="Invalid API key, set X-API-Key header")
