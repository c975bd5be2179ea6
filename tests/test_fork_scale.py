"""Issue 10: a fork of 100 (E2B's maximum) works on one node.

100 children of a 512 MiB template do not fit this kind of host's memory admission
(100 × 512 MiB > 23 GB), so the server runs with ``FORKYARD_MEMORY_OVERCOMMIT=2.5`` for
this test (an idle fork child uses ~25 MiB of host memory: docs/runtime.md). Every child
must run and hold the source's in-memory state; then all are killed and nothing is left
on the host (netns, veths, mounts, runsc processes).

Takes ~60-120 s on a shared 2-core host (100 restores, 16 at a time): it is the one test
of E2B's maximum fan-out, so it is kept despite its length.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from conftest import CLEAN
from e2b import Sandbox
from test_lifecycle import value, with_counter

N = 100


@pytest.mark.timeout(600)  # 100 restores and reads; ~2 min alone, far more beside other work
def test_fork_of_100_on_one_node(server):
    server.kill_all()
    with server.restarted_with(FORKYARD_MEMORY_OVERCOMMIT="2.5"):
        src = Sandbox.create("base", timeout=600)
        kids: list[str] = []
        try:
            with_counter(src)
            assert value(server, src, set_to=77) == 77
            # The e2b SDK caps one fork call at 20 children (its MAX_FORK_COUNT); the API's
            # maximum is 100, so this goes through REST.
            with server.api() as c:
                c.timeout = 600
                t = time.perf_counter()
                r = c.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": N, "timeout": 600})
                fork_s = time.perf_counter() - t
                assert r.status_code == 201, r.text
                kids = [e["sandbox"]["sandboxID"] for e in r.json() if "sandbox" in e]
                assert [e for e in r.json() if "error" in e] == []
                assert len(set(kids)) == N
                assert {c.get(f"/sandboxes/{k}").json()["state"] for k in kids} == {"running"}
            # Every child runs and has the source's memory state (the counter process's value).
            def read(k: str):
                try:
                    return value(server, SimpleNamespace(sandbox_id=k))
                except AssertionError as e:
                    return e

            with ThreadPoolExecutor(8) as ex:
                got = list(ex.map(read, kids))
            bad = [(k, g) for k, g in zip(kids, got) if g != 77]
            for k, g in bad[:3]:  # diagnostics
                out = Sandbox.connect(k).commands.run("ss -ltnp 2>&1 | head; ps aux | head -20", timeout=30)
                print("BAD", k, g, out.stdout, "LATER:", read(k))
            assert not bad, (len(bad), bad[:3])
            assert Sandbox.connect(kids[-1]).commands.run("echo alive").stdout.strip() == "alive"
            print(f"fork x{N}: {fork_s:.1f} s until every child answered ({r.headers.get('server-timing')})")
        finally:
            with server.api() as c, ThreadPoolExecutor(8) as ex:
                list(ex.map(lambda k: c.delete(f"/sandboxes/{k}"), kids))
            src.kill()
        deadline = time.time() + 60
        while server.leftovers() != CLEAN and time.time() < deadline:
            time.sleep(0.5)
        assert server.leftovers() == CLEAN
