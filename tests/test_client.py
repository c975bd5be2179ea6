"""forkyard.client against a real server: REST calls, fork, rollout with per-child results."""

from __future__ import annotations

import os

import pytest

from forkyard.client import (
    ApiError,
    AsyncForkyard,
    ChildResult,
    ForkError,
    NotFound,
    ServerUnreachable,
    fork,
    rollout,
)
from forkyard.client.config import resolve


@pytest.fixture
async def fy(server):
    async with AsyncForkyard() as c:
        made: list[str] = []
        c.made = made  # sandboxes to clean up
        yield c
        for sid in made:
            try:
                await c.kill(sid)
            except NotFound:
                pass


async def _leftover_children(fy, parent_id: str) -> list[str]:
    return [s.sandbox_id for s in await fy.list_sandboxes()
            if s.metadata.get("forkyard.parentSandboxID") == parent_id]


async def test_rest_basics(fy):
    assert fy.url == resolve().url and await fy.health()
    src = await fy.create("base", timeout=120, metadata={"suite": "client", "k": "a b&c"})
    fy.made.append(src.sandbox_id)
    info = await fy.get_sandbox(src.sandbox_id)
    assert info.state == "running" and info.template_id == "base" and info.metadata["suite"] == "client"
    listed = await fy.list_sandboxes(metadata={"k": "a b&c"})
    assert [s.sandbox_id for s in listed] == [src.sandbox_id]
    assert await fy.list_sandboxes(metadata={"k": "other"}) == []
    r = await src.commands.run("echo hello")
    assert r.stdout.strip() == "hello"
    assert "base" in [t.template_id for t in await fy.list_templates()]
    with pytest.raises(NotFound):
        await fy.get_sandbox("no-such-sandbox")
    with pytest.raises(NotFound):
        await fy.kill("no-such-sandbox")


async def test_server_unreachable():
    async with AsyncForkyard(url="http://127.0.0.1:9", api_key="x") as c:
        with pytest.raises(ServerUnreachable) as ei:
            await c.list_sandboxes()
    assert "cannot reach server at http://127.0.0.1:9" in str(ei.value)
    assert "deploy/up.sh" in ei.value.hint


async def test_fork_children_run_independently(fy):
    src = await fy.create("base", timeout=180)
    fy.made.append(src.sandbox_id)
    await src.files.write("/home/user/seed.txt", "from parent")
    children = await fork(src, 2, timeout=120, client=fy)
    fy.made += [c.sandbox_id for c in children if not isinstance(c, ForkError)]
    assert not [c for c in children if isinstance(c, ForkError)], children
    for i, child in enumerate(children):
        assert await child.files.read("/home/user/seed.txt") == "from parent"
        await child.files.write("/home/user/seed.txt", f"child {i}")
    assert [await c.files.read("/home/user/seed.txt") for c in children] == ["child 0", "child 1"]
    assert await src.files.read("/home/user/seed.txt") == "from parent"


async def test_fork_over_100_is_split_into_calls_of_at_most_100(fy):
    """README / ``fork_info``: the server takes at most 100 children per fork call, so the
    client splits larger counts. A real server cannot start 250 children on a CI host, so
    the splitting is checked against a recording HTTP transport (the client is under
    test, not the server), and against the real server that its first call asks for
    exactly 100 (its admission names the count it refused)."""
    import json as _json

    import httpx

    counts: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.method == "POST" and request.url.path == "/sandboxes/src1/fork"
        body = _json.loads(request.content)
        assert body["timeout"] == 77
        counts.append(body["count"])
        base = sum(counts[:-1])
        return httpx.Response(201, json=[{"sandbox": {"sandboxID": f"kid{base + i}", "templateID": "base",
                                                      "clientID": "x", "envdVersion": "0.6.4"}}
                                         for i in range(body["count"])])

    async with AsyncForkyard(url="http://stub.invalid", api_key="k") as stub:
        await stub._http.aclose()
        stub._http = httpx.AsyncClient(base_url="http://stub.invalid", transport=httpx.MockTransport(handler))
        kids = await stub.fork_info("src1", 250, timeout=77)
        assert counts == [100, 100, 50]
        assert [k.sandbox_id for k in kids] == [f"kid{i}" for i in range(250)]
        counts.clear()
        assert len(await stub.fork_info("src1", 100, timeout=77)) == 100 and counts == [100]
        counts.clear()
        assert len(await stub.fork_info("src1", 101, timeout=77)) == 101 and counts == [100, 1]

    node = (await fy._http.get("/metrics/node")).json()
    src = await fy.create("base", timeout=60)
    fy.made.append(src.sandbox_id)
    info = await fy.get_sandbox(src.sandbox_id)
    if 100 * info.memory_mb <= node["capacity"]["memoryMB"]:
        pytest.skip("this host could admit 100 children: not asking it to start them")
    with pytest.raises(ApiError, match=r"no room for 100 sandbox\(es\)"):
        await fy.fork_info(src.sandbox_id, 101, timeout=60)
    assert await _leftover_children(fy, src.sandbox_id) == []


async def test_rollout_command_with_one_failing_child(fy):
    src = await fy.create("base", timeout=240)
    fy.made.append(src.sandbox_id)
    await src.files.write("/home/user/task.txt", "task-7")
    cmd = ('echo "child $FORKYARD_CHILD $(cat task.txt)"; echo "r$FORKYARD_CHILD" > reward.txt; '
           'echo warn >&2; [ "$FORKYARD_CHILD" != 1 ] || exit 5')
    results = await rollout(src, 3, cmd, concurrency=2, then="kill", timeout=120,
                            collect_files=["/home/user/reward.txt", "/home/user/missing.txt"], client=fy)
    assert [r.index for r in results] == [0, 1, 2]
    for r in results:
        assert isinstance(r, ChildResult) and r.sandbox_id and r.error is None, r
        assert r.stdout.strip() == f"child {r.index} task-7" and r.stderr.strip() == "warn"
        assert r.files["/home/user/reward.txt"] == f"r{r.index}\n".encode()
        assert "/home/user/missing.txt" in r.file_errors
        assert r.cleanup_error is None
    assert [r.exit_code for r in results] == [0, 5, 0]
    assert [r.ok for r in results] == [True, False, True]
    # then="kill": no child remains; the source is untouched.
    assert await _leftover_children(fy, src.sandbox_id) == []
    assert (await fy.get_sandbox(src.sandbox_id)).state == "running"


async def test_rollout_callable_errors_are_per_child_and_pause(fy):
    src = await fy.create("base", timeout=240)
    fy.made.append(src.sandbox_id)

    async def step(child, index):
        if index == 0:
            raise RuntimeError("policy crashed")
        r = await child.commands.run(f"echo step {index} > out.txt; cat out.txt")
        return r

    results = await rollout(src, 2, step, then="pause", collect_files=["/home/user/out.txt"],
                            timeout=120, client=fy)
    try:
        bad, good = results
        assert bad.error == "RuntimeError: policy crashed" and isinstance(bad.exception, RuntimeError)
        assert not bad.ok and bad.sandbox_id and "/home/user/out.txt" in bad.file_errors
        assert good.error is None and good.ok and good.exit_code == 0
        assert good.stdout.strip() == "step 1" and good.files["/home/user/out.txt"] == b"step 1\n"
        assert good.value.stdout.strip() == "step 1"
        for r in results:  # then="pause": children are kept, paused
            assert (await fy.get_sandbox(r.sandbox_id)).state == "paused"
    finally:
        for r in results:
            await fy.kill(r.sandbox_id)
    assert await _leftover_children(fy, src.sandbox_id) == []


async def test_rollout_concurrency_step_timeout_and_keep(fy):
    """``concurrency`` bounds the steps in flight (and they do overlap), ``step_timeout``
    turns a slow step into that child's error, ``then="keep"`` leaves children running."""
    import asyncio

    src = await fy.create("base", timeout=240)
    fy.made.append(src.sandbox_id)
    running, peak = 0, 0

    async def step(child, index):
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(30 if index == 2 else 1.5)
        finally:
            running -= 1
        return await child.commands.run("echo kept")

    results = await rollout(src, 3, step, concurrency=2, step_timeout=5, then="keep", timeout=120, client=fy)
    try:
        assert peak == 2, peak
        assert [r.ok for r in results] == [True, True, False]
        assert results[2].error == "step timed out after 5 s" and isinstance(results[2].exception, TimeoutError)
        for r in results:  # then="keep": every child still runs
            assert (await fy.get_sandbox(r.sandbox_id)).state == "running"
    finally:
        for r in results:
            await fy.kill(r.sandbox_id)
    assert await _leftover_children(fy, src.sandbox_id) == []


def test_url_falls_back_to_the_servers_port_setting(monkeypatch, tmp_path, server):
    """With no URL given anywhere, the client (and so the CLI) uses FORKYARD_PORT — the
    setting the server itself reads — and reaches a server started with it."""
    import subprocess
    import sys

    for var in ("FORKYARD_URL", "E2B_API_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FORKYARD_CONFIG", str(tmp_path / "none.toml"))
    monkeypatch.setenv("FORKYARD_PORT", str(server.port))
    assert resolve().url == server.url
    p = subprocess.run([sys.executable, "-m", "forkyard.cli.main", "ls"], capture_output=True, text=True,
                       env={**os.environ, "E2B_API_KEY": server.api_key}, timeout=60)
    assert p.returncode == 0, p.stderr
