"""Composition root of a node: the one place that picks the runtime driver, the network,
the snapshot repository and the state store, builds the :class:`Orchestrator` over them
and the ASGI app over that.

Nothing else in forkyard names a driver (import-linter contract ``one-driver-root``):
the orchestrator sees only :class:`~forkyard.runtime.base.RuntimeDriver`, and the API
only the orchestrator. A second driver (docs/architecture.md, "Adding a runtime") is a
package under ``forkyard/runtime/`` plus a branch in :func:`build_orchestrator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forkyard.api.app import create_app
from forkyard.config import PackageCacheSettings, Settings
from forkyard.network.firewall import HostServices, NetworkError
from forkyard.network.slots import NetnsNetwork
from forkyard.orchestrator.manager import Orchestrator
from forkyard.pkgcache import PORTS, PackageCache, PackageCacheError
from forkyard.orchestrator.store import Store
from forkyard.repository.snapshots import SnapshotStore
from forkyard.runtime.gvisor.driver import GVisorDriver


@dataclass
class Node:
    """A node's parts, built by :func:`build_node`.

    Attributes:
        orchestrator: owns every sandbox on the node; starts and stops with ``app``'s
            lifespan.
        app: the ASGI app (sandbox proxy in front of the REST API; the FastAPI
            instance at ``app.fastapi``).
    """

    orchestrator: Orchestrator
    app: Any

    def preflight(self) -> None:
        """Check the host before serving: the outer range must not overlap a host route
        of anything but this node's own links (another forkyard node's sandboxes, a VPN,
        Docker), which :meth:`~forkyard.network.slots.NetnsNetwork.setup_host` would
        refuse later with a traceback in the startup log.

        Also that the package cache, when on, has what it needs.

        Raises:
            ValueError: the range overlaps (the message names the route and the setting),
                or the package cache lacks a part (one line saying what to do).
        """
        try:
            self.orchestrator.network.check_host()
        except NetworkError as e:
            raise ValueError(f"FORKYARD_OUTER_NET: {e}; another forkyard node on this host, or other "
                             "software, routes that range: give this node a range no host route uses") from e
        if self.orchestrator.package_cache is not None:
            try:
                self.orchestrator.package_cache.check()
            except PackageCacheError as e:
                raise ValueError(str(e)) from e


def build_orchestrator(settings: Settings) -> Orchestrator:
    """The orchestrator of a node configured by ``settings``: the gVisor driver, network
    slots in network namespaces (``settings.outer_net``, ``settings.net_prefix``), the
    snapshot repository of ``<data>/snapshots`` and the SQLite store.

    With ``FORKYARD_PACKAGE_CACHE=on`` also the package cache (:mod:`forkyard.pkgcache`),
    whose address and ports the network opens to sandboxes.

    Raises:
        ValueError: a malformed network setting (``FORKYARD_NET_PREFIX``/``_OUTER_NET``)
            or package cache setting (the message names it).
        RepositoryConfigError: unusable repository settings (the message names them).
    """
    driver = GVisorDriver(settings)
    cache_settings = PackageCacheSettings()
    cache = services = None
    if cache_settings.enabled:
        try:
            cache = PackageCache(cache_settings, settings.data_dir)
        except PackageCacheError as e:
            raise ValueError(str(e)) from e
        services = HostServices(cache.address, PORTS)
    network = NetnsNetwork(settings, outer_net=settings.outer_net, prefix=settings.net_prefix, services=services)
    if network.attachment is not driver.attachment:  # a pairing error of this file, not a setting
        raise TypeError(f"{type(driver).__name__} takes {driver.attachment.__name__} slots, "
                        f"{type(network).__name__} makes {network.attachment.__name__}")
    store = Store(settings.db_path)
    return Orchestrator(settings, driver, network, store, SnapshotStore(settings.data_dir / "snapshots"), cache)


def build_node(settings: Settings) -> Node:
    """A node for ``settings``: :func:`build_orchestrator` and the app serving it.

    Raises:
        as :func:`build_orchestrator`.
    """
    orchestrator = build_orchestrator(settings)
    app = create_app(settings, orchestrator)
    cache = orchestrator.package_cache
    if cache is not None:  # after the orchestrator's start (the network's address), before its stop
        app.fastapi.state.on_start.append(cache.start)
        app.fastapi.state.on_stop.append(cache.stop)
    return Node(orchestrator, app)
