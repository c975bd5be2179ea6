"""The node → scheduler messages, built in one place (issue 26).

:class:`~.agent.NodeAgent` sends them and the control-plane benchmark's simulated nodes
(``tests/_fleet.py``, ``bench/bench_control_plane.py``) import the same builders, so a
change of the protocol changes both. Shapes (JSON; the scheduler's models in
:mod:`.scheduler` validate them):

* ``POST /v1/nodes/{id}/heartbeat`` :func:`heartbeat_body` (:class:`HeldSync` decides
  whether it lists the held ids or only their digest);
* ``POST /v1/nodes/{id}/publish`` :func:`publish_body` of :func:`published_record` rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

from forkyard.cluster.types import NODE_DRAINING, NODE_UP, NodeReport

#: States a client can see; rows in other states are not (or no longer) bound.
HIDDEN = ("creating", "killing")
#: Heartbeats between two that carry the held ids whatever the digests say.
FULL_EVERY = 30


def heartbeat_path(node_id: str) -> str:
    """The heartbeat route of ``node_id``."""
    return f"/v1/nodes/{node_id}/heartbeat"


def publish_path(node_id: str) -> str:
    """The publish route of ``node_id``."""
    return f"/v1/nodes/{node_id}/publish"


def node_report(rows: list, **host) -> NodeReport:
    """The :class:`~.types.NodeReport` of a node holding ``rows`` (``SandboxRecord``s:
    ``state``, ``vcpus``); ``host`` gives the rest of its fields (``vcpus``,
    ``memory_mb``, ``max_sandboxes``, ``free_slots``, ``cache_bytes``, ``load1``,
    ``runtime``, ``cached_snapshots``, ``boot``, ``drain_done``). Sandboxes still being
    created count as running: their placement may predate the last heartbeat, so the
    scheduler's placing count no longer covers them."""
    running = [r for r in rows if r.state not in ("paused", "killing")]
    return NodeReport(running=len(running), paused=sum(1 for r in rows if r.state == "paused"),
                      vcpus_reserved=sum(r.vcpus for r in running), **host)


def held_digest(ids) -> str:
    """Digest of a set of sandbox ids: XOR of the first 64 bits of each id's SHA-1, as
    16 hex chars — the same the scheduler's scripts keep for a node's bindings
    (:data:`forkyard.cluster.scripts.LUA_DIGEST`), changed incrementally there."""
    a = b = 0
    for sid in ids:
        h = hashlib.sha1(sid.encode()).hexdigest()
        a ^= int(h[:8], 16)
        b ^= int(h[8:16], 16)
    return f"{a:08x}{b:08x}"


def heartbeat_body(url: str, report: NodeReport, rows: list, acked: set[str], draining: bool,
                   full: bool = True) -> dict:
    """A heartbeat: where gateways reach the node, its ``report``, the digest of the ids
    of ``rows`` it holds and — when ``full`` — those ids (the paused ones listed again),
    the placement ids whose calls have ended (``acked``: their rows are in ``report``)
    and its own view of its status."""
    shown = [r for r in rows if r.state not in HIDDEN]
    body = {"url": url, "report": report.to_dict(), "digest": held_digest(r.id for r in shown),
            "placements": sorted(acked), "status": NODE_DRAINING if draining else NODE_UP}
    if full:
        body["held"] = [r.id for r in shown]
        body["paused"] = [r.id for r in shown if r.state == "paused"]
    return body


class HeldSync:
    """Whether a heartbeat carries the node's held ids or only their digest, so its cost
    follows what changed (issue 26): the ids go when they changed since the last full
    heartbeat, when the scheduler answered ``resend`` (its bindings of the node differ:
    a move, a declaration), and every :data:`FULL_EVERY` beats anyway."""

    def __init__(self):
        self._last: str | None = None
        self._since = 0
        self.resend = True

    def body(self, url: str, report: NodeReport, rows: list, acked: set[str], draining: bool) -> dict:
        """The next heartbeat's body (:func:`heartbeat_body`)."""
        shown = [r.id for r in rows if r.state not in HIDDEN]
        full = self.resend or self._since >= FULL_EVERY or held_digest(shown) != self._last
        return heartbeat_body(url, report, rows, acked, draining, full=full)

    def answered(self, body: dict, answer: dict) -> None:
        """Record the scheduler's ``answer`` to ``body``."""
        if "held" in body:
            self._last, self._since, self.resend = body["digest"], 0, False
        else:
            self._since += 1
        if answer.get("resend"):
            self.resend = True


def published_record(rec, committed: bool) -> dict:
    """A ``SandboxRecord`` as a binding holds it; ``committed`` False keeps a paused
    sandbox on its node until its image is in the shared repository."""
    return {**asdict(rec), "committed": committed}


def publish_body(records: list[dict], deleted: list[str], deaths: dict[str, str]) -> dict:
    """A publish: upserted ``records`` (:func:`published_record`), ``deleted`` ids and
    why some of them died (``{id: "it was killed: …"}``)."""
    return {"records": records, "deleted": deleted, "deaths": deaths}
