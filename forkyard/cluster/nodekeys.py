"""Per-node credentials: the cluster secret stays on the control plane (issue 25 item 6).

The scheduler and the gateway hold the cluster's *master* secret
(``FORKYARD_CLUSTER_SECRET(_FILE)``). A node holds only its own key, derived from the
master and bound to the node's id and the URL it is reached at::

    key(id, url) = "fynk_" + hex(HMAC-SHA256(master, "forkyard-node-key\\0" id "\\0" url))

minted by an operator with ``forkyard cluster node-key ID --url URL --out FILE`` (a
0600 file, ``FORKYARD_NODE_KEY_FILE`` on that node). What follows:

* the scheduler takes a node's heartbeat, publish and restart notice only with
  ``key(id, url)`` for the id in the path and the URL the node sends
  (:data:`NODE_URL_HEADER`; the heartbeat's ``url`` must be the same): another node's
  key, a key for another URL or the master itself is refused (403). Every other
  scheduler route takes only the master;
* the scheduler stores beside a node's URL in Redis the :func:`binding_tag` of its key,
  and the scheduler and the gateway use a node record only when the tag checks
  (:meth:`NodeKeys.tag_ok`): a record written into Redis by anyone without the master
  (a node, a Redis client) cannot point a node id at another URL;
* the gateway calls a node with that node's own key (never the master), and only at the
  URL the key is bound to: a node learns nothing it could use as another node.

The node reads its key with :func:`forkyard.cluster.config.load_node_key`. This module
needs only the standard library (deploy scripts mint keys with it before any install).
HMAC-SHA256: RFC 2104 / FIPS 198-1 (Python's :mod:`hmac`). Rotating the master
invalidates every node key at once (mint them again); a node whose URL changes needs a
key for the new URL.
"""

from __future__ import annotations

import hashlib
import hmac

#: Every node key starts with this, so a node refuses to be given the master instead.
NODE_KEY_PREFIX = "fynk_"
#: Header on a node's calls to the scheduler: the URL its key is bound to (its advertise URL).
NODE_URL_HEADER = "x-forkyard-node-url"
_KEY_LABEL = b"forkyard-node-key\0"
_TAG_LABEL = b"forkyard-node-binding"
_P2P_LABEL = b"forkyard-p2p-endpoint\0"


def normal_url(url: str) -> str:
    """``url`` as keys bind it: surrounding spaces and trailing slashes removed."""
    return url.strip().rstrip("/")


def node_key(master: str, node_id: str, url: str) -> str:
    """Node ``node_id``'s key for ``url`` under ``master`` (``fynk_`` + 64 hex chars)."""
    msg = _KEY_LABEL + node_id.encode() + b"\0" + normal_url(url).encode()
    return NODE_KEY_PREFIX + hmac.new(master.encode(), msg, hashlib.sha256).hexdigest()


def binding_tag(key: str) -> str:
    """The tag stored in Redis beside a node's URL: HMAC-SHA256 of a fixed label under
    the node's key (64 hex chars). Computable only from that key, which only the master
    (or the node itself, for its own URL) yields."""
    return hmac.new(key.encode(), _TAG_LABEL, hashlib.sha256).hexdigest()


class NodeKeys:
    """The control plane's view of node keys, from the ``master`` secret."""

    #: Derived (key, tag) pairs kept, at most; past it the memo starts over. Every heartbeat
    #: checks its node's key and tags its binding (two HMACs, ~6 % of a scheduler's CPU
    #: at 300 nodes when derived each time).
    MEMO = 4096

    def __init__(self, master: str):
        self._master = master
        self._memo: dict[tuple[str, str], tuple[str, str]] = {}

    def _derived(self, node_id: str, url: str) -> tuple[str, str]:
        got = self._memo.get((node_id, url))
        if got is None:
            key = node_key(self._master, node_id, url)
            got = (key, binding_tag(key))
            if len(self._memo) >= self.MEMO:
                self._memo.clear()
            self._memo[(node_id, url)] = got
        return got

    def key(self, node_id: str, url: str) -> str:
        """:func:`node_key` of ``node_id`` at ``url`` (memoized)."""
        return self._derived(node_id, url)[0]

    def tag(self, node_id: str, url: str) -> str:
        """:func:`binding_tag` of ``node_id`` at ``url`` (memoized)."""
        return self._derived(node_id, url)[1]

    def tag_ok(self, node_id: str, url: str, tag: str | None) -> bool:
        """Whether ``tag`` (as read from Redis) binds ``node_id`` to ``url`` (constant time)."""
        return bool(tag) and hmac.compare_digest(tag.encode(), self.tag(node_id, url).encode())

    def p2p_tag(self, node_id: str, endpoint_id: str) -> str:
        """HMAC-SHA256 under the master of ``node_id``'s P2P endpoint id (64 hex chars),
        stored beside its report: a Redis writer cannot swap in an endpoint of its own."""
        return hmac.new(self._master.encode(), _P2P_LABEL + node_id.encode() + b"\0" + endpoint_id.encode(),
                        hashlib.sha256).hexdigest()

    def p2p_tag_ok(self, node_id: str, endpoint_id: str, tag: str | None) -> bool:
        """Whether ``tag`` (as read from Redis) binds ``endpoint_id`` to ``node_id``."""
        return bool(tag) and hmac.compare_digest(tag.encode(), self.p2p_tag(node_id, endpoint_id).encode())

    def check(self, node_id: str, url: str | None, got: str | None) -> tuple[int, str] | None:
        """Check a node's credential ``got`` for ``node_id`` at ``url``. Returns None when
        it is that node's key, else ``(status, message)``: 401 when the key or URL is
        missing, 403 when it is the master or any other key."""
        if not got:
            return 401, "missing node key (x-forkyard-cluster-secret)"
        if not url:
            return 401, f"missing {NODE_URL_HEADER}: a node sends the URL its key is bound to"
        if hmac.compare_digest(got.encode(), self._master.encode()):
            return 403, ("the cluster secret is not accepted from nodes: each node authenticates with its own key "
                         f"(forkyard cluster node-key {node_id[:100]} --url URL)")
        if not hmac.compare_digest(got.encode(), self.key(node_id, url).encode()):
            nid, u = node_id[:100], normal_url(url)[:200]
            return 403, (f"this is not node {nid}'s key for {u}: mint one with "
                         f"`forkyard cluster node-key {nid} --url {u}` on a control-plane host")
        return None
