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
from forkyard.config import Settings
from forkyard.network.firewall import NetworkError
from forkyard.network.slots import NetnsNetwork
from forkyard.orchestrator.manager import Orchestrator
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

        Raises:
            ValueError: the range overlaps (the message names the route and the setting).
        """
        try:
            self.orchestrator.network.check_host()
        except NetworkError as e:
            raise ValueError(f"FORKYARD_OUTER_NET: {e}; another forkyard node on this host, or other "
                             "software, routes that range: give this node a range no host route uses") from e


def build_orchestrator(settings: Settings) -> Orchestrator:
    """The orchestrator of a node configured by ``settings``: the gVisor driver, network
    slots in network namespaces (``settings.outer_net``, ``settings.net_prefix``), the
    snapshot repository of ``<data>/snapshots`` and the SQLite store.

    Raises:
        ValueError: a malformed network setting (``FORKYARD_NET_PREFIX``/``_OUTER_NET``).
        RepositoryConfigError: unusable repository settings (the message names them).
    """
    driver = GVisorDriver(settings)
    network = NetnsNetwork(settings, outer_net=settings.outer_net, prefix=settings.net_prefix)
    if network.attachment is not driver.attachment:  # a pairing error of this file, not a setting
        raise TypeError(f"{type(driver).__name__} takes {driver.attachment.__name__} slots, "
                        f"{type(network).__name__} makes {network.attachment.__name__}")
    store = Store(settings.db_path)
    return Orchestrator(settings, driver, network, store, SnapshotStore(settings.data_dir / "snapshots"))


def build_node(settings: Settings) -> Node:
    """A node for ``settings``: :func:`build_orchestrator` and the app serving it.

    Raises:
        as :func:`build_orchestrator`.
    """
    orchestrator = build_orchestrator(settings)
    return Node(orchestrator, create_app(settings, orchestrator))
