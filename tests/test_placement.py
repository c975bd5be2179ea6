"""Placement (filter → score → pick) on made-up cluster states: the real function, no
runtime needed. The cluster tests check the same rules end to end."""

from __future__ import annotations

import pytest

from forkyard.cluster.placement import NoCapacity, place
from forkyard.cluster.types import NODE_DOWN, NODE_DRAINING, NODE_UP, NodeInfo, NodeReport

NOW = 1_000_000.0


def node(nid: str, running: int = 0, max_sbx: int = 10, vcpus: int = 8, load: float = 0.0,
         status: str = NODE_UP, age: float = 0.5, cached: list[str] | None = None) -> NodeInfo:
    return NodeInfo(node_id=nid, url=f"http://{nid}", status=status, last_seen=NOW - age,
                    report=NodeReport(vcpus=vcpus, max_sandboxes=max_sbx, running=running,
                                      vcpus_reserved=2 * running, load1=load, cached_snapshots=cached or []))


def ids(plan) -> list[tuple[str, int]]:
    return [(n.node_id, k) for n, k in plan]


def test_least_loaded_wins_and_ties_go_to_lower_id():
    assert ids(place([node("b", running=1), node("a", running=3)], {}, NOW)) == [("b", 1)]
    assert ids(place([node("b"), node("a")], {}, NOW)) == [("a", 1)]


def test_placements_since_the_last_heartbeat_count():
    # "a" is emptier by its report, but 3 sandboxes were placed on it since
    assert ids(place([node("a", running=0), node("b", running=2)], {"a": 3}, NOW)) == [("b", 1)]


def test_a_burst_spreads_over_nodes():
    assert sorted(ids(place([node("a"), node("b"), node("c")], {}, NOW, count=6))) == [("a", 2), ("b", 2), ("c", 2)]


def test_down_draining_silent_and_full_nodes_are_filtered():
    nodes = [node("a", status=NODE_DRAINING), node("b", status=NODE_DOWN), node("c", age=60),
             node("d", running=10), node("e", running=9)]
    assert ids(place(nodes, {}, NOW)) == [("e", 1)]
    with pytest.raises(NoCapacity, match="no node has room"):
        place(nodes, {}, NOW, count=2)


def test_snapshot_locality_beats_a_slightly_busier_node():
    nodes = [node("a", running=1), node("b", running=2, cached=["snap1"])]
    assert ids(place(nodes, {}, NOW, snapshot_id="snap1")) == [("b", 1)]
    assert ids(place(nodes, {}, NOW, snapshot_id="other")) == [("a", 1)]


def test_fork_fills_the_source_node_first_then_the_rest():
    nodes = [node("src", running=1, max_sbx=17), node("x"), node("y")]
    plan = ids(place(nodes, {}, NOW, count=24, prefer="src"))
    assert plan[0] == ("src", 16)
    assert sum(k for _, k in plan) == 24 and {n for n, _ in plan[1:]} == {"x", "y"}


def test_exclude():
    assert ids(place([node("a"), node("b", running=5)], {}, NOW, exclude={"a"})) == [("b", 1)]


def test_only_the_node_holding_the_volumes():
    # a sandbox mounting a volume node "b" holds goes there, busier or not, or nowhere
    nodes = [node("a"), node("b", running=8), node("c")]
    assert ids(place(nodes, {}, NOW, only="b")) == [("b", 1)]
    assert ids(place(nodes, {}, NOW, count=2, prefer="b", only="b")) == [("b", 2)]
    with pytest.raises(NoCapacity):
        place(nodes, {}, NOW, count=3, prefer="b", only="b")  # fork children never spill
    with pytest.raises(NoCapacity):
        place([node("a"), node("b", status=NODE_DRAINING)], {}, NOW, only="b")
