"""The node → scheduler messages, built in one place (issue 26).

:class:`~.agent.NodeAgent` sends them and the control-plane benchmark's simulated nodes
(``tests/_fleet.py``, ``bench/bench_control_plane.py``) import the same builders, so a
change of the protocol changes both. Shapes (JSON; the scheduler's models in
:mod:`.scheduler` validate them):

* ``POST /v1/nodes/{id}/heartbeat`` :func:`heartbeat_body`;
* ``POST /v1/nodes/{id}/publish`` :func:`publish_body` of :func:`published_record` rows.
"""

from __future__ import annotations

from dataclasses import asdict

from forkyard.cluster.types import NODE_DRAINING, NODE_UP, NodeReport

#: States a client can see; rows in other states are not (or no longer) bound.
HIDDEN = ("creating", "killing")


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


def heartbeat_body(url: str, report: NodeReport, rows: list, acked: set[str], draining: bool) -> dict:
    """A heartbeat: where gateways reach the node, its ``report``, the ids of ``rows``
    it holds (the paused ones listed again), the placement ids whose calls have ended
    (``acked``: their rows are in ``report``) and its own view of its status."""
    shown = [r for r in rows if r.state not in HIDDEN]
    return {"url": url, "report": report.to_dict(), "held": [r.id for r in shown],
            "paused": [r.id for r in shown if r.state == "paused"], "placements": sorted(acked),
            "status": NODE_DRAINING if draining else NODE_UP}


def published_record(rec, committed: bool) -> dict:
    """A ``SandboxRecord`` as a binding holds it; ``committed`` False keeps a paused
    sandbox on its node until its image is in the shared repository."""
    return {**asdict(rec), "committed": committed}


def publish_body(records: list[dict], deleted: list[str], deaths: dict[str, str]) -> dict:
    """A publish: upserted ``records`` (:func:`published_record`), ``deleted`` ids and
    why some of them died (``{id: "it was killed: …"}``)."""
    return {"records": records, "deleted": deleted, "deaths": deaths}
