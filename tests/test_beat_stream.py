"""Heartbeats over one WebSocket (forkyard/cluster/beatstream.py, FORKYARD_BEAT_STREAM=on;
issue 26: heartbeat CPU), against real ``forkyard scheduler`` replicas and a real Redis
(tests/_fleet.py), and in a real cluster of gVisor nodes: beats on the stream are
recorded and answered as over HTTP; the stream is refused without the node's key, bad
messages are answered or close it, a node holds one stream, and a node whose stream
cannot be opened sends its heartbeat over HTTP and opens the stream on the replica that
answered."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

import httpx
import pytest
from _cluster import Cluster
from _fleet import ControlPlane, SimNode
from conftest import TEST_ROOT, free_port
from e2b import Sandbox
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from forkyard.cluster import beatstream
from forkyard.cluster.beatstream import stream_path
from forkyard.cluster.config import SECRET_HEADER
from forkyard.cluster.messages import heartbeat_body
from forkyard.cluster.nodekeys import NODE_URL_HEADER, node_key
from forkyard.obs import logs


def _stream_messages(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.split()[1]) for line in text.splitlines()
               if line.startswith("forkyard_heartbeat_stream_messages_total"))


def _ws(cp: ControlPlane, node_id: str, url: str, key: str | None = None, replica: int = 0, **kw):
    base = cp.scheduler_urls[replica].replace("http", "ws", 1)
    return connect(base + stream_path(node_id), compression=None, max_size=None, proxy=None, **kw,
                   additional_headers={NODE_URL_HEADER: url, SECRET_HEADER: key or node_key(cp.secret, node_id, url)})


def _body(node: SimNode) -> str:
    return json.dumps(heartbeat_body(node.url, node.report(), [], set(), False, full=True))


async def test_heartbeats_go_over_one_stream_and_are_answered_as_over_http(plane):
    """A node's beats go over one WebSocket: each answered with the HTTP route's fields,
    the node listed by the scheduler with its report, the messages counted."""
    before = _stream_messages(plane.scheduler_urls[0])
    node = SimNode("st0", 7, plane.scheduler_urls, plane.secret, stream=True)
    plain = SimNode("st1", 7, plane.scheduler_urls, plane.secret)
    try:
        outs = [await node.beat() for _ in range(4)]
        ws = node.stream._ws
        outs.append(await node.beat())
        assert node.streamed == node.beats == 5 and node.stream._ws is ws  # one connection
        over_http = await plain.beat()
        assert all(set(o) == set(over_http) and o["status"] == "up" for o in outs), (outs, over_http)
        assert plain.streamed == 0
    finally:
        for n in (node, plain):
            if n.stream is not None:
                await n.stream.close()
            await n.client.aclose()
    with httpx.Client(headers={SECRET_HEADER: plane.secret}) as c:
        nodes = {n["nodeID"]: n for n in c.get(f"{plane.scheduler_urls[1]}/v1/nodes", timeout=10).json()}
    assert nodes["st0"]["report"]["max_sandboxes"] == 7 and nodes["st0"]["status"] == "up", nodes.get("st0")
    assert _stream_messages(plane.scheduler_urls[0]) - before >= 5


async def test_the_stream_is_refused_without_the_nodes_key(plane):
    """No upgrade without the node's own key for the URL it sends (checked before the
    upgrade, answered as HTTP with the guard's status and message); the master secret is
    refused on a node route too; nothing is registered. A WebSocket to any other path is
    refused by the scheduler's guard, not left to what routes lie behind it."""
    url = "http://127.0.0.1:9/x"
    for key in ("fynk_" + "0" * 64, plane.secret):
        with pytest.raises(InvalidStatus) as e:
            async with _ws(plane, "intruder", url, key=key):
                pass
        assert e.value.response.status_code in (401, 403), e.value.response
        assert b"message" in e.value.response.body, e.value.response.body
    with pytest.raises(InvalidStatus):  # a key minted for another URL
        async with _ws(plane, "intruder", url, key=node_key(plane.secret, "intruder", "http://127.0.0.1:9/y")):
            pass
    with httpx.Client(headers={SECRET_HEADER: plane.secret}) as c:
        assert "intruder" not in {n["nodeID"] for n in c.get(f"{plane.scheduler_urls[0]}/v1/nodes").json()}
    # any other WebSocket path meets the scheduler's guard first (no route behind it is open)
    with pytest.raises(InvalidStatus) as e:
        async with connect(plane.scheduler_urls[0].replace("http", "ws", 1) + "/v1/nodes", proxy=None):
            pass
    assert e.value.response.status_code == 401 and b"cluster secret" in e.value.response.body, e.value.response


async def test_bad_messages_are_answered_or_close_the_stream(plane):
    """A message that is no heartbeat gets a 422 answer and the stream stays; a body whose
    URL is not the key's gets a 403 answer and the stream is closed (1008); a message over
    the scheduler's body bound in bytes (8 MiB, however few characters) closes it (1009)."""
    node = SimNode("st2", 3, plane.scheduler_urls, plane.secret)
    async with _ws(plane, "st2", node.url) as ws:
        await ws.send("{not json")
        out = json.loads(await ws.recv())
        assert out["code"] == 422 and "heartbeat" in out["message"], out
        await ws.send(_body(node))
        assert json.loads(await ws.recv())["status"] == "up"  # still open
        other = json.loads(_body(node))
        other["url"] = "http://127.0.0.1:9/elsewhere"
        await ws.send(json.dumps(other))
        out = json.loads(await ws.recv())
        assert out["code"] == 403, out
        with pytest.raises(ConnectionClosed) as e:
            await ws.recv()
        assert e.value.rcvd is not None and e.value.rcvd.code == 1008
    for big in ("x" * ((8 << 20) + 1), "\u00e9" * ((4 << 20) + 1)):  # over 8 MiB in bytes, either way
        async with _ws(plane, "st2", node.url) as ws:
            with pytest.raises(ConnectionClosed) as e:
                await ws.send(big)
                await ws.recv()
            assert e.value.rcvd is not None and e.value.rcvd.code == 1009, e.value
    await node.client.aclose()


async def test_a_node_holds_one_stream_the_newer_closes_the_older(plane):
    """A second stream of the same node ends the first (1000) and is answered."""
    node = SimNode("st3", 3, plane.scheduler_urls, plane.secret)
    async with _ws(plane, "st3", node.url) as first:
        await first.send(_body(node))
        assert json.loads(await first.recv())["status"] == "up"
        async with _ws(plane, "st3", node.url) as second:
            with pytest.raises(ConnectionClosed) as e:
                await asyncio.wait_for(first.recv(), 10)
            assert e.value.rcvd is not None and e.value.rcvd.code == 1000
            await second.send(_body(node))
            assert json.loads(await second.recv())["status"] == "up"
    await node.client.aclose()


async def test_a_node_whose_stream_fails_beats_over_http_then_streams_to_the_replica_that_answered(plane, monkeypatch):
    """The first replica named is down: the stream cannot open there, that heartbeat goes
    over HTTP within the call's bound (the client fails over to the live replica), so do
    the beats of the back-off after a failure, and then the stream opens to the replica
    that answered. A redirect answering the upgrade is refused, not followed (the upgrade
    carries the node's key)."""
    monkeypatch.setattr(beatstream, "FAILED_S", 1.0)
    dead = f"http://127.0.0.1:{free_port()}"
    node = SimNode("st4", 3, [dead, plane.scheduler_urls[1]], plane.secret, stream=True)
    try:
        t0 = time.monotonic()
        first = await node.beat()
        assert first["status"] == "up" and node.streamed == 0 and time.monotonic() - t0 < 3
        await node.beat()
        assert node.streamed == 0  # backing off
        await asyncio.sleep(1.1)
        await node.beat()
        await node.beat()
        assert node.streamed == 2 and node.stream._ws_url.startswith(plane.scheduler_urls[1].replace("http", "ws", 1))
    finally:
        await node.stream.close()
        await node.client.aclose()
    hits = []

    async def redirect(scope, receive, send):  # answers every request with a redirect elsewhere
        if scope["type"] == "lifespan":
            return
        hits.append(dict(scope["headers"]))
        await send({"type": "http.response.start", "status": 307,
                    "headers": [(b"location", f"{plane.scheduler_urls[1]}/v1/nodes/st5/beats".encode()),
                                (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(redirect, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    node = SimNode("st5", 3, [f"http://127.0.0.1:{port}", plane.scheduler_urls[1]], plane.secret, stream=True)
    try:
        before = _stream_messages(plane.scheduler_urls[1])
        assert await node.stream.call(_beat_of(node), 2.0) is None  # refused: no stream
        assert _stream_messages(plane.scheduler_urls[1]) == before  # the redirect was not followed
        assert len(hits) == 1
    finally:
        await node.client.aclose()
        server.should_exit = True
        await task


def _beat_of(node: SimNode) -> dict:
    return heartbeat_body(node.url, node.report(), [], set(), False, full=True)


def test_a_cluster_whose_nodes_beat_over_streams_runs_sandboxes(base_template):
    """Real nodes with FORKYARD_BEAT_STREAM=on: they are listed alive, a sandbox created
    through the gateway runs a program, and the scheduler counts the nodes' stream
    messages."""
    env = {"FORKYARD_BEAT_STREAM": "on"}
    with Cluster(TEST_ROOT / f"beatstream-{os.getpid()}", nodes=2, env=env).running() as c:
        urls = c.scheduler_urls.split(",")
        time.sleep(3)
        assert sum(_stream_messages(u) for u in urls) >= 2
        sbx = Sandbox.create("base", timeout=120, **c.sdk)
        try:
            r = sbx.commands.run("printf 'int main(){return 7;}' > /tmp/a.c && gcc /tmp/a.c -o /tmp/a && "
                                 "/tmp/a; echo $?", timeout=60)
            assert r.stdout.strip().endswith("7"), r
        finally:
            sbx.kill()
        with c.sched() as s:
            nodes = s.get("/v1/nodes").json()
        assert {n["nodeID"] for n in nodes if n["status"] == "up"} == {"node0", "node1"}, nodes


async def test_a_beat_cancelled_before_its_answer_aborts_the_stream(plane):
    """A heartbeat call cancelled after its message went out (the agent bounds some beats
    with ``wait_for``) leaves no unread answer behind: the stream is aborted, and the
    next beat opens a new one and reads its own answer."""
    node = SimNode("st7", 3, plane.scheduler_urls, plane.secret, stream=True)
    try:
        await node.beat()
        first = node.stream._ws
        task = asyncio.create_task(node.stream.call(_beat_of(node), 5.0))
        await asyncio.sleep(0.005)  # sent; the answer waits for the scheduler's batch window (50 ms)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not node.stream.open
        node.stream._refused_until = 0.0  # (no back-off after a cancel is needed for this check)
        out = await node.stream.call(_beat_of(node), 5.0)
        assert out is not None and out["status"] == "up" and node.stream._ws is not first
    finally:
        await node.stream.close()
        await node.client.aclose()


def test_log_lines_carry_no_credential():
    """What websockets logs of an upgrade at debug level (every header) and other
    credential shapes reach the log with the value replaced; other lines are unchanged."""
    key = "fynk_" + "ab" * 32
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    h = Keep()
    h.addFilter(logs._Redact())
    lg = logging.getLogger("test.redact")
    lg.addHandler(h)
    lg.propagate = False
    try:
        lg.warning("> x-forkyard-cluster-secret: %s", key)
        lg.warning("headers %s", {"X-API-Key": "e2b_secret1", "authorization": "Bearer tok"})
        lg.warning("node key %s in a sentence", key)
        lg.warning("plain %d", 42)
    finally:
        lg.removeHandler(h)
    assert not any(x in line for line in seen for x in (key, "e2b_secret1", "tok")), seen
    assert seen[-1] == "plain 42"
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup("scheduler", "debug", "text")
        assert any(isinstance(f, logs._Redact) for h in root.handlers for f in h.filters)
        assert logging.getLogger("websockets").getEffectiveLevel() >= logging.WARNING
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
