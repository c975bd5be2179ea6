"""Cluster settings shared by ``forkyard node|scheduler|gateway`` (environment first,
CLI options override).

=================================  ==========================================================
``FORKYARD_REDIS_URL``             cluster state (scheduler, gateway); default
                                   ``redis://127.0.0.1:6379/0``
``FORKYARD_SCHEDULER_URL``         where nodes and gateways reach the scheduler; default
                                   ``http://127.0.0.1:9090``; several replicas comma-separated
                                   (tried in turn: :class:`~.schedclient.SchedulerClient`)
``FORKYARD_CLUSTER_SECRET``        the secret node ↔ scheduler ↔ gateway calls carry (not the
``FORKYARD_CLUSTER_SECRET_FILE``   users' API key); or a file holding it, mode 0600
``FORKYARD_NODE_ID``               this node's name (default: the host name)
``FORKYARD_ADVERTISE_URL``         where the gateway reaches this node (default
                                   ``http://HOST:PORT`` of the node's listener)
``FORKYARD_NODE_MAX_SANDBOXES``    sandboxes this node runs at once, enforced by its admission (default: what its memory admits of 512 MiB sandboxes)
``FORKYARD_REDIS_MAX_CONNECTIONS`` Redis connections a scheduler or gateway opens at most (64);
``FORKYARD_REDIS_POOL_WAIT_S``     calls beyond wait for one, at most this long (5 s), then 503
                                   (:class:`~forkyard.config.ControlPlaneSettings`)
=================================  ==========================================================
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from forkyard.api.auth import CLUSTER_SECRET_HEADER as SECRET_HEADER  # noqa: F401 — re-exported

#: Header on a gateway → node call that starts sandboxes the scheduler placed: the
#: placement id, acknowledged in the node's next heartbeat once the call has ended.
PLACEMENT_HEADER = "x-forkyard-placement"
#: Header on a draining node's 409 to a ``connect``/``resume``: the sandbox is paused and
#: resumes on another node (the gateway moves it and tries again there).
DRAINING_HEADER = "x-forkyard-draining"
from forkyard.api.auth import cluster_secret_ok as secret_ok  # noqa: F401 — re-exported

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SCHEDULER_URL = "http://127.0.0.1:9090"


class ClusterConfigError(Exception):
    """A cluster setting is missing or unsafe; the message says which and what to do."""


def load_secret(env: dict[str, str] | None = None) -> str:
    """The cluster secret from ``FORKYARD_CLUSTER_SECRET`` or the file named by
    ``FORKYARD_CLUSTER_SECRET_FILE``.

    Raises:
        ClusterConfigError: neither is set, the file is missing/empty, readable by group
            or others, or the secret is shorter than 16 characters.
    """
    env = os.environ if env is None else env
    value = env.get("FORKYARD_CLUSTER_SECRET", "").strip()
    path = env.get("FORKYARD_CLUSTER_SECRET_FILE", "").strip()
    if not value and path:
        p = Path(path)
        try:
            mode = p.stat().st_mode
            value = p.read_text().strip()
        except OSError as e:
            raise ClusterConfigError(f"cannot read FORKYARD_CLUSTER_SECRET_FILE {path}: {e}") from e
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ClusterConfigError(f"{path} is readable by other users; run: chmod 600 {path}")
    if not value:
        raise ClusterConfigError("a cluster needs a shared secret: set FORKYARD_CLUSTER_SECRET_FILE to a 0600 file "
                                 "(e.g. `openssl rand -hex 32 > /etc/forkyard/cluster_secret`) or "
                                 "FORKYARD_CLUSTER_SECRET, the same on every node, scheduler and gateway")
    if len(value) < 16:
        raise ClusterConfigError("the cluster secret must be at least 16 characters")
    return value


def redis_url(env: dict[str, str] | None = None) -> str:
    """``FORKYARD_REDIS_URL`` or the default."""
    env = os.environ if env is None else env
    return env.get("FORKYARD_REDIS_URL") or DEFAULT_REDIS_URL


def scheduler_url(env: dict[str, str] | None = None) -> str:
    """``FORKYARD_SCHEDULER_URL`` or the default (no trailing slash): all of it, which
    may list several replicas separated by commas (:func:`scheduler_urls`)."""
    env = os.environ if env is None else env
    return ",".join(scheduler_urls(env.get("FORKYARD_SCHEDULER_URL") or DEFAULT_SCHEDULER_URL))


def scheduler_urls(value: str) -> list[str]:
    """The scheduler replicas' URLs in ``value`` (comma-separated; no trailing slashes).

    Raises:
        ClusterConfigError: one of them is not an ``http(s)://`` URL.
    """
    urls = [u.strip().rstrip("/") for u in value.split(",") if u.strip()]
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise ClusterConfigError(f"scheduler URL {u!r} must start with http:// or https:// "
                                     "(FORKYARD_SCHEDULER_URL / --scheduler; several: comma-separated)")
    if not urls:
        raise ClusterConfigError("no scheduler URL given (FORKYARD_SCHEDULER_URL / --scheduler)")
    return urls
