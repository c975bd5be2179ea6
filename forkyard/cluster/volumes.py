"""E2B volumes in a cluster: reachable from every node, mounted by one node at a time.

Every node names the same shared directory in ``FORKYARD_VOLUMES_DIR`` (NFS or another
shared mount): the volumes' images and rows live there
(:mod:`forkyard.orchestrator.volumes.store`), so every node sees every volume, its name
and its token. An ext4 image must never be mounted by two hosts at once, so a node
mounts one only while it holds the volume's **lease** in Redis (``fy:vlease:<id>``,
:mod:`.store`):

* the node asks the scheduler for it before every mount and every sandbox start that
  binds the volume (:class:`SchedulerLeases`, ``POST /v1/nodes/{id}/volumes/{vid}/lease``);
  it is granted when no live node holds it (one Lua script: two nodes asking at once get
  one lease and one 409);
* the node gives it back only after it has unmounted the image, once no sandbox of the
  node, running or paused, mounts the volume and no content call used it for
  ``FORKYARD_VOLUME_IDLE_S`` (at once while the node drains); the agent checks every
  heartbeat (:meth:`~forkyard.orchestrator.volumes.store.Volumes.release_idle`);
* a lease is valid while its node is registered and not declared down, and for
  ``FORKYARD_VOLUME_TAKEOVER_S`` (300) after the scheduler declared it down (silent past
  the heartbeat timeout while the control plane was healthy, and not answering its
  health check): a node process that died leaves its sandboxes running on its host,
  still writing to the volumes they mount, until the node is back and stops them — so a
  dead node's leases end like its heartbeats, after that margin. Never on a timer while
  the node is heard: an outage of Redis or of the scheduler frees no lease (while they
  are away no lease can be granted either: a start that binds a volume answers 503).
  Redis must keep its append-only file (docs/deploy.md): one that lost its data has lost
  the leases, and nodes do not claim theirs again.

Placement follows the leases (:mod:`.placement`): a create whose ``volumeMounts`` name a
held volume goes to its holder, two volumes held by different nodes are a 409, and the
fork children of a sandbox that mounts volumes stay on its node. The gateway sends
``/volumes/{id}`` and the content API (``/volumecontent/{id}/…``) to the holder, or to
any node when none holds it.
"""

from __future__ import annotations

import httpx

from forkyard.cluster.config import SECRET_HEADER, scheduler_urls
from forkyard.cluster.nodekeys import NODE_URL_HEADER
from forkyard.ids import is_name
from forkyard.orchestrator.volumes.store import LeaseUnavailable

#: Timeout of one lease call (s).
LEASE_CALL_S = 5.0


def _check_id(volume_id: str) -> None:
    """A volume id goes into the URL path: httpx removes its dot segments, so an id such
    as ``../../<node>/volumes/<other>`` would ask for another volume's lease."""
    if not is_name(volume_id):
        raise LeaseUnavailable(f"volume id {volume_id!r} is not a name: no lease is asked for it")


class SchedulerLeases:
    """The node's side of the volume leases (:class:`~forkyard.orchestrator.volumes.store.Leases`):
    blocking calls to the scheduler replicas with the node's own key.

    Args:
        urls: the scheduler replicas (comma-separated); key: this node's key
            (:mod:`.nodekeys`); node_id, node_url: this node's id and the URL its key
            is bound to.
    """

    def __init__(self, urls: str, key: str, node_id: str, node_url: str):
        self.urls, self.node_id = scheduler_urls(urls), node_id
        self._headers = {SECRET_HEADER: key, NODE_URL_HEADER: node_url}
        self._i = 0

    def _post(self, path: str, body: dict) -> dict:
        last: Exception | None = None
        for k in range(len(self.urls)):
            i = (self._i + k) % len(self.urls)
            try:
                r = httpx.post(self.urls[i] + path, json=body, headers=self._headers, trust_env=False,
                               timeout=httpx.Timeout(LEASE_CALL_S, connect=1.0))
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                last = e
                continue
            except httpx.HTTPError as e:
                raise LeaseUnavailable(f"the scheduler did not answer a volume lease call: {e!r}") from e
            if r.status_code != 200:
                raise LeaseUnavailable(f"the scheduler answered {r.status_code} to a volume lease call: {r.text[:300]}")
            self._i = i
            return r.json()
        raise LeaseUnavailable(f"no scheduler replica could be reached for a volume lease ({last!r}); "
                               "volumes are mounted only with a lease: retry when the scheduler is back")

    def acquire(self, volume_id: str, name: str) -> str | None:
        """Take or keep ``volume_id``'s lease: None when granted, else the holder's id.

        Raises:
            LeaseUnavailable: the scheduler could not be asked, or this node is not
                registered or is declared down (it gets no lease until it is heard).
        """
        _check_id(volume_id)
        out = self._post(f"/v1/nodes/{self.node_id}/volumes/{volume_id}/lease", {"name": name})
        if out.get("granted"):
            return None
        if not out.get("holder"):
            raise LeaseUnavailable(out.get("message") or f"volume {name!r}: lease refused")
        return str(out["holder"])

    def release(self, volume_id: str) -> None:
        """Give ``volume_id``'s lease back (nothing when this node does not hold it).

        Raises:
            LeaseUnavailable: the scheduler could not be told.
        """
        _check_id(volume_id)
        self._post(f"/v1/nodes/{self.node_id}/volumes/{volume_id}/release", {})
