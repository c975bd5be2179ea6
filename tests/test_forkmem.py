"""Issue 21: fork children share their source's unchanged memory with it on the host
(runsc patch 0020, ``--share-restored-pages``; by default for fork children only,
``FORKYARD_SHARE_RESTORED_PAGES=all`` for every restore; docs/runtime.md "Memory").

A process in the source holds 96 MiB of random bytes; every child, grandchild and
resumed child must read back exactly those bytes (SHA-1 of the whole buffer, taken by
the process in that sandbox), while a child's own memory file (its cgroup's shmem) stays
far below the buffer until it writes — and so does the source's after the fork: the
unchanged pages are the host page cache of the image, one copy for all. A child's writes stay its own, a guest ``fork()`` over shared
pages sees them too, and pausing / forking a child (whose image must hold its shared
pages) loses nothing. Without the patch every child holds its own ≥ 96 MiB copy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from e2b import Sandbox

MIB = 1 << 20
SIZE_MIB = 96
HOLDER = r"""
import hashlib, os, random, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
n = int(sys.argv[1]) << 20
buf = bytearray(n)
rnd = random.Random(int(sys.argv[2]))
for i in range(0, n, 1 << 20):
    buf[i:i + (1 << 20)] = rnd.randbytes(1 << 20)

class H(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/write":  # change every page
            for i in range(0, n, 4096):
                buf[i] ^= 0xFF
        if self.path == "/forksum":  # the sum as a forked child process reads it
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.write(w, hashlib.sha1(buf).hexdigest().encode())
                os._exit(0)
            os.waitpid(pid, 0)
            out = os.read(r, 100)
        else:
            out = hashlib.sha1(buf).hexdigest().encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass

HTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def ask(server, sandbox_id: str, path: str = "/sum") -> str:
    """What the holder in ``sandbox_id`` answers on ``path`` (through the proxy)."""
    deadline = time.time() + 60
    while True:
        try:
            r = httpx.get(f"{server.url}{path}", headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8000"},
                          timeout=60)
            if r.status_code == 200:
                return r.text
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise AssertionError(f"holder in {sandbox_id} did not answer {path}")
        time.sleep(0.2)


def shmem_mib(sandbox_id: str) -> float:
    """The sandbox's memory-file pages on the host (its memory cgroup's shmem), MiB."""
    for line in Path(f"/sys/fs/cgroup/memory/forkyard/{sandbox_id}/memory.stat").read_text().splitlines():
        if line.startswith("total_shmem "):
            return int(line.split()[1]) / MIB
    raise AssertionError("no total_shmem")


def start_holder(server, seed: int) -> tuple[str, str]:
    """A new ``base`` sandbox whose :data:`HOLDER` keeps :data:`SIZE_MIB` MiB of random
    bytes from ``seed``; returns ``(its id, the holder's SHA-1 of them)``."""
    src = Sandbox.create("base", timeout=600)
    src.files.write("/home/user/holder.py", HOLDER)
    src.commands.run(f"python3 /home/user/holder.py {SIZE_MIB} {seed}", background=True, timeout=0)
    return src.sandbox_id, ask(server, src.sandbox_id)


def test_fork_children_share_unchanged_memory_and_keep_their_writes(server):
    server.kill_all()
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="0", FORKYARD_SHARE_RESTORED_PAGES="1"), server.api() as c:
        # (hot pause off: pauses write images)
        c.timeout = 300
        assert c.get("/metrics/node").json()["sharesRestoredPages"] == "all", "runsc lacks patch 0020"
        sid, want = start_holder(server, 21)
        assert shmem_mib(sid) >= SIZE_MIB  # the source's own copy

        r = c.post(f"/sandboxes/{sid}/fork", json={"count": 3, "timeout": 600})
        assert r.status_code == 201 and all("sandbox" in e for e in r.json()), r.text
        kids = [e["sandbox"]["sandboxID"] for e in r.json()]
        assert [ask(server, k) for k in kids] == [want] * 3  # each child read its whole buffer
        for k in [*kids, sid]:  # … from the shared image, not from a copy of its own; the source too
            assert shmem_mib(k) < SIZE_MIB / 3, (k, shmem_mib(k))

        # A child's writes are its own (copied on write); the others still see the source's.
        changed = ask(server, kids[0], "/write")
        assert changed != want and ask(server, kids[0]) == changed
        assert shmem_mib(kids[0]) >= SIZE_MIB * 0.9
        assert ask(server, kids[1]) == want and ask(server, sid) == want
        # The source forks again (its shared pages go into the new image first).
        r = c.post(f"/sandboxes/{sid}/fork", json={"count": 1, "timeout": 600})
        assert r.status_code == 201 and "sandbox" in r.json()[0], r.text
        assert ask(server, r.json()[0]["sandbox"]["sandboxID"]) == want and ask(server, sid) == want
        # A process forked inside a child reads the shared pages too.
        assert ask(server, kids[1], "/forksum") == want

        # Forking a child saves its shared pages into the grandchild's image.
        r = c.post(f"/sandboxes/{kids[1]}/fork", json={"count": 1, "timeout": 600})
        assert r.status_code == 201 and "sandbox" in r.json()[0], r.text
        grandkid = r.json()[0]["sandbox"]["sandboxID"]
        assert ask(server, grandkid) == want and ask(server, kids[1]) == want
        assert shmem_mib(grandkid) < SIZE_MIB / 3
        # So does pausing one: after a cold resume it reads the same bytes, shared again.
        assert c.post(f"/sandboxes/{kids[2]}/pause").status_code == 204
        assert c.post(f"/sandboxes/{kids[2]}/resume", json={"timeout": 600}).status_code == 201
        assert ask(server, kids[2]) == want
        assert shmem_mib(kids[2]) < SIZE_MIB / 3
        assert ask(server, kids[0]) == changed
        server.kill_all()


def test_image_written_without_sharing_restores_shared(server):
    """An image written by a node without sharing — the build without patch 0020 when
    ``FORKYARD_TEST_RUNSC_WITHOUT_SHARING`` names one (the patch is restore-compatible:
    same version stamp), else this build with ``FORKYARD_SHARE_RESTORED_PAGES=0`` (stock
    save and restore paths) — resumes on a sharing node with every byte, shared, and forks."""
    old = os.environ.get("FORKYARD_TEST_RUNSC_WITHOUT_SHARING")
    env = {"FORKYARD_RUNSC": old} if old else {"FORKYARD_SHARE_RESTORED_PAGES": "0"}
    server.kill_all()
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="0", **env), server.api() as c:
        c.timeout = 300
        assert c.get("/metrics/node").json()["sharesRestoredPages"] is False
        sid, want = start_holder(server, 7)
        assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="0", FORKYARD_SHARE_RESTORED_PAGES="1"), server.api() as c:
        c.timeout = 300
        assert c.get("/metrics/node").json()["sharesRestoredPages"] == "all", "runsc lacks patch 0020"
        r = c.post(f"/sandboxes/{sid}/resume", json={"timeout": 600})
        assert r.status_code == 201, r.text
        assert ask(server, sid) == want
        assert shmem_mib(sid) < SIZE_MIB / 3, shmem_mib(sid)  # mapped from the image, not copied
        r = c.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 600})
        assert r.status_code == 201 and all("sandbox" in e for e in r.json()), r.text
        assert [ask(server, e["sandbox"]["sandboxID"]) for e in r.json()] == [want] * 2
        server.kill_all()


def test_by_default_only_fork_children_share_their_image(server):
    """The default scope (``forks``): a fork's children and its source map the fork's
    image and read every byte from it, while a sandbox's own pause image and a snapshot
    another sandbox is created from are copied as stock runsc does (no physical pages
    shared between sandboxes that are not one fork's)."""
    server.kill_all()
    with server.restarted_with(FORKYARD_HOT_PAUSE_S="0", FORKYARD_SHARE_RESTORED_PAGES=""), server.api() as c:
        c.timeout = 300
        assert c.get("/metrics/node").json()["sharesRestoredPages"] == "forks", "runsc lacks patch 0020"
        sid, want = start_holder(server, 5)
        r = c.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 600})
        assert r.status_code == 201 and all("sandbox" in e for e in r.json()), r.text
        kids = [e["sandbox"]["sandboxID"] for e in r.json()]
        assert [ask(server, k) for k in kids] == [want] * 2
        for k in [*kids, sid]:
            assert shmem_mib(k) < SIZE_MIB / 3, (k, shmem_mib(k))
        # a snapshot (leave-running, not a fork): the source copies its pages back
        snap = Sandbox.connect(sid).create_snapshot(name="not-shared")
        assert ask(server, sid) == want and shmem_mib(sid) >= SIZE_MIB * 0.9, shmem_mib(sid)
        other = Sandbox.create(snap.snapshot_id, timeout=600)
        assert ask(server, other.sandbox_id) == want
        assert shmem_mib(other.sandbox_id) >= SIZE_MIB * 0.9, shmem_mib(other.sandbox_id)
        # a pause and a cold resume of a fork child: its own image, copied
        assert c.post(f"/sandboxes/{kids[0]}/pause").status_code == 204
        assert c.post(f"/sandboxes/{kids[0]}/resume", json={"timeout": 600}).status_code == 201
        assert ask(server, kids[0]) == want and shmem_mib(kids[0]) >= SIZE_MIB * 0.9, shmem_mib(kids[0])
        assert ask(server, kids[1]) == want and ask(server, sid) == want
        server.kill_all()
