"""Process-wide settings with embedded defaults: where forkyard reads its environment.

Every value can be overridden by an environment variable (listed per field). Paths are
absolute; sizes are MiB; durations are seconds. Source of defaults: the E2B API
(timeout 300 s, envd port 49983) and ``shared/DESIGN.md``.

In :mod:`.node`: a node's own settings —

* :class:`Settings`: a node (the server); :class:`AdmissionSettings`: what its host admits.
* :class:`GVisorSettings`: the gVisor driver's tunables; envd's port and version, the guest's addresses.
* :class:`PackageCacheSettings`: the node's package cache for sandboxes (pip, npm, apt).

In :mod:`.cluster`: the cluster —

* :class:`ClusterSettings`: how ``forkyard node`` joins a cluster;
  :class:`ControlPlaneSettings`: timings the control plane and the node agent share;
  :class:`ControlPlaneEnv`: its credentials and addresses as given.
* :class:`P2PSettings`: the peer-to-peer chunk transport between cluster nodes.

In :mod:`.process`: what every kind of process reads —

* :class:`ObsSettings`: logs, tracing and the metrics token (node, gateway, scheduler).
* :class:`ClientSettings`: where :mod:`forkyard.client` and the CLI find a server.
* :class:`ProxySettings`: bounds on client connections of every HTTP server.
* :class:`RepositorySettings`: where snapshots are committed, the node cache's bound.

Each is read when it is made (``Settings()`` …), so a process that changes its
environment sees the change at the next one. Secrets are kept out of their ``repr``.
Every name is importable from ``forkyard.config`` itself; the readers of single
variables are in :mod:`._env`.
"""

from forkyard.config.cluster import ClusterSettings, ControlPlaneEnv, ControlPlaneSettings, P2PSettings
from forkyard.config.node import (
    DEFAULT_POOL,
    DEFAULT_RUNSC,
    ENVD_PORT,
    ENVD_VERSION,
    GUEST_GATEWAY,
    GUEST_IP,
    GUEST_PREFIXLEN,
    POOL_MAX_PER_TEMPLATE,
    SHARE_ALL,
    SHARE_FORKS,
    SHARE_OFF,
    AdmissionSettings,
    GVisorSettings,
    PackageCacheSettings,
    Settings,
    api_key_from_env,
    hold_dir,
    parse_pool,
)
from forkyard.config.process import ClientSettings, ObsSettings, ProxySettings, RepositorySettings, user_cache_dir

__all__ = [
    "DEFAULT_POOL", "DEFAULT_RUNSC", "ENVD_PORT", "ENVD_VERSION", "GUEST_GATEWAY", "GUEST_IP", "GUEST_PREFIXLEN",
    "POOL_MAX_PER_TEMPLATE", "SHARE_ALL", "SHARE_FORKS", "SHARE_OFF", "AdmissionSettings", "ClientSettings", "ClusterSettings", "ControlPlaneEnv", "ControlPlaneSettings",
    "GVisorSettings", "ObsSettings", "PackageCacheSettings", "P2PSettings", "ProxySettings", "RepositorySettings", "Settings",
    "api_key_from_env", "hold_dir", "parse_pool", "user_cache_dir",
]
