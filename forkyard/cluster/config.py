"""Cluster settings shared by ``forkyard node|scheduler|gateway`` (environment first,
CLI options override).

=================================  ==========================================================
``FORKYARD_REDIS_URL``             cluster state (scheduler, gateway); default
                                   ``redis://127.0.0.1:6379/0``; a password in it
                                   (``redis://:PASS@host``) is never printed
``FORKYARD_REDIS_PASSWORD_FILE``   or a 0600 file holding the Redis password (or the
                                   ``requirepass PASS`` line of a Redis config)
``FORKYARD_SCHEDULER_URL``         where nodes and gateways reach the scheduler; default
                                   ``http://127.0.0.1:9090``; several replicas comma-separated
                                   (tried in turn: :class:`~.schedclient.SchedulerClient`)
``FORKYARD_CLUSTER_SECRET``        the control plane's master secret (scheduler, gateway, the
``FORKYARD_CLUSTER_SECRET_FILE``   operator's ``forkyard node ls|drain``; not the users' API
                                   key); or a file holding it, mode 0600. Never on a node
``FORKYARD_NODE_KEY``              a node's own key, bound to its id and URL
``FORKYARD_NODE_KEY_FILE``         (``forkyard cluster node-key``, :mod:`.nodekeys`); or a
                                   0600 file holding it
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

import stat
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from forkyard.api.auth import CLUSTER_SECRET_HEADER as SECRET_HEADER  # noqa: F401 — re-exported

#: Header on a gateway → node call that starts sandboxes the scheduler placed: the
#: placement id, acknowledged in the node's next heartbeat once the call has ended.
PLACEMENT_HEADER = "x-forkyard-placement"
#: Header on a draining node's 409 to a ``connect``/``resume``: the sandbox is paused and
#: resumes on another node (the gateway moves it and tries again there).
DRAINING_HEADER = "x-forkyard-draining"
from forkyard.api.auth import cluster_secret_ok as secret_ok  # noqa: F401 — re-exported
from forkyard.cluster.nodekeys import NODE_KEY_PREFIX
from forkyard.config import ControlPlaneEnv

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SCHEDULER_URL = "http://127.0.0.1:9090"


class ClusterConfigError(Exception):
    """A cluster setting is missing or unsafe; the message says which and what to do."""


def _value_or_private_file(value: str, path: str, name: str) -> str:
    """``value`` (the variable ``name``), else the content of the file ``path`` (the
    variable ``name + "_FILE"``), which must be private (no group/other bits); "" when
    neither is set.

    Raises:
        ClusterConfigError: the file is unreadable or readable by other users.
    """
    return value or (_read_private(f"{name}_FILE", path) if path else "")


def _read_private(setting: str, path: str) -> str:
    """The stripped content of ``path`` (named by ``setting``), a file no group or other
    user may read.

    Raises:
        ClusterConfigError: unreadable, or readable by other users (with the chmod to run).
    """
    try:
        mode = Path(path).stat().st_mode
        value = Path(path).read_text().strip()
    except OSError as e:
        raise ClusterConfigError(f"cannot read {setting} {path}: {e}") from e
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterConfigError(f"{path} is readable by other users; run: chmod 600 {path}")
    return value


def load_secret(env: dict[str, str] | None = None) -> str:
    """The cluster secret from ``FORKYARD_CLUSTER_SECRET`` or the file named by
    ``FORKYARD_CLUSTER_SECRET_FILE``.

    Raises:
        ClusterConfigError: neither is set, the file is missing/empty, readable by group
            or others, or the secret is shorter than 16 characters.
    """
    given = ControlPlaneEnv.read(env)
    value = _value_or_private_file(given.cluster_secret, given.cluster_secret_file, "FORKYARD_CLUSTER_SECRET")
    if not value:
        raise ClusterConfigError("a cluster needs a shared secret: set FORKYARD_CLUSTER_SECRET_FILE to a 0600 file "
                                 "(e.g. `openssl rand -hex 32 > /etc/forkyard/cluster_secret`) or "
                                 "FORKYARD_CLUSTER_SECRET, the same on every scheduler and gateway (nodes get "
                                 "their own keys: forkyard cluster node-key)")
    if len(value) < 16:
        raise ClusterConfigError("the cluster secret must be at least 16 characters")
    return value


def load_node_key(env: dict[str, str] | None = None) -> str:
    """This node's key from ``FORKYARD_NODE_KEY`` or the 0600 file named by
    ``FORKYARD_NODE_KEY_FILE``.

    Raises:
        ClusterConfigError: neither is set (the message says how to mint one), the file is
            unreadable or readable by group/others, or the value is not a node key
            (e.g. the cluster's master secret, which a node must not hold).
    """
    given = ControlPlaneEnv.read(env)
    value = _value_or_private_file(given.node_key, given.node_key_file, "FORKYARD_NODE_KEY")
    if not value:
        raise ClusterConfigError("a cluster node needs its own key: on a host holding the cluster secret run "
                                 "`forkyard cluster node-key NODE_ID --url ADVERTISE_URL --out node.key`, copy the file "
                                 "to this node (mode 0600) and set FORKYARD_NODE_KEY_FILE to it. Nodes no longer take "
                                 "FORKYARD_CLUSTER_SECRET: it stays on the scheduler and gateway hosts")
    if not value.startswith(NODE_KEY_PREFIX) or len(value) != len(NODE_KEY_PREFIX) + 64:
        raise ClusterConfigError("FORKYARD_NODE_KEY(_FILE) does not hold a node key (fynk_…): a node holds only "
                                 "its own key (`forkyard cluster node-key`), never the cluster secret")
    return value


def cluster_secret_given(env: dict[str, str] | None = None) -> bool:
    """Whether ``FORKYARD_CLUSTER_SECRET`` or ``FORKYARD_CLUSTER_SECRET_FILE`` is set (a
    node warns: it must not hold it)."""
    given = ControlPlaneEnv.read(env)
    return bool(given.cluster_secret or given.cluster_secret_file)


def redis_url(env: dict[str, str] | None = None, url: str | None = None) -> str:
    """``url`` (``--redis``), else ``FORKYARD_REDIS_URL``, else the default, with the password read from the 0600 file
    named by ``FORKYARD_REDIS_PASSWORD_FILE`` put in it when that is set (the URL's own
    password, ``redis://:PASS@host``, otherwise). Show it only through :func:`redacted_url`.

    Raises:
        ClusterConfigError: the password file is unreadable, empty, or readable by
            group or others.
    """
    given = ControlPlaneEnv.read(env)
    url = url or given.redis_url or DEFAULT_REDIS_URL
    path = given.redis_password_file
    if not path:
        return url
    password = _read_private("FORKYARD_REDIS_PASSWORD_FILE", path)
    conf = [ln.split(None, 1) for ln in password.splitlines() if ln.startswith("requirepass ")]
    if conf:  # a Redis config holding it (`requirepass PASS`, as deploy/ writes redis-secret.conf)
        password = conf[0][1].strip()
    if not password:
        raise ClusterConfigError(f"FORKYARD_REDIS_PASSWORD_FILE {path} is empty")
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"))


def redacted_url(url: str) -> str:
    """``url`` without its password (``redis://:secret@host`` → ``redis://:***@host``)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user.partition(':')[0]}:***@{host}"))


def scheduler_url(env: dict[str, str] | None = None) -> str:
    """``FORKYARD_SCHEDULER_URL`` or the default (no trailing slash): all of it, which
    may list several replicas separated by commas (:func:`scheduler_urls`)."""
    return ",".join(scheduler_urls(ControlPlaneEnv.read(env).scheduler_url or DEFAULT_SCHEDULER_URL))


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
