"""E2B volumes in a cluster (issue 23 item 5): real redis-server, scheduler, gateway and
two node processes sharing one volumes directory (``FORKYARD_VOLUMES_DIR``), real gVisor
sandboxes, the official e2b SDK's ``Volume`` and ``Sandbox`` pointed at the gateway.

A volume is reachable from every node; its ext4 image is mounted by one node at a time
(the node holding its lease, :mod:`forkyard.cluster.volumes`). A sampler reads
``/proc/mounts`` all along and checks that no two nodes ever mount one volume at once.
"""

from __future__ import annotations

import concurrent.futures
import os
import secrets
import shutil
import threading
import time

import httpx
import pytest
import redis
from e2b import Sandbox, Volume

from _cluster import Cluster
from conftest import TEST_ROOT
from test_cluster import assert_clean, only_on, wait_for

IDLE_S = 2


class MountWatch:
    """Samples ``/proc/mounts`` every 10 ms: which nodes mount each volume (by id)."""

    def __init__(self, c: Cluster):
        self.dirs = {f"node{i}": n.env["FORKYARD_DATA_DIR"] for i, n in enumerate(c.nodes)}
        self.worst: dict[str, set[str]] = {}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def now(self) -> dict[str, set[str]]:
        """``{volume id: {node, …}}`` mounting it now."""
        out: dict[str, set[str]] = {}
        for line in open("/proc/self/mounts"):
            mnt = line.split()[1]
            for node, d in self.dirs.items():
                if mnt.startswith(d + "/volumes/") and mnt.endswith("/data"):
                    out.setdefault(mnt.split("/")[-2], set()).add(node)
        return out

    def _run(self):
        while not self._stop.is_set():
            for vid, nodes in self.now().items():
                if len(nodes) > len(self.worst.get(vid, ())):
                    self.worst[vid] = set(nodes)
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._t.join()

    def assert_never_twice(self) -> None:
        twice = {v: n for v, n in self.worst.items() if len(n) > 1}
        assert not twice, f"volumes mounted by two nodes at once: {twice}"


@pytest.fixture
def vcluster(base_template, monkeypatch):
    """Two nodes sharing ``<root>/volumes``; node0 runs at most 2 sandboxes; idle volumes
    go back after 2 s; a node declared down loses its leases at once."""
    root = TEST_ROOT / f"cluster-vol-{os.getpid()}"
    c = Cluster(root, nodes=2, max_sandboxes={0: 2},
                env={"FORKYARD_VOLUMES_DIR": str(root / "volumes"), "FORKYARD_VOLUME_IDLE_S": str(IDLE_S),
                     "FORKYARD_VOLUME_TAKEOVER_S": "0"})
    watch = None
    try:
        c.start()
        for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_VOLUME_API_URL"):
            monkeypatch.setenv(k, c.gateway_url)
        monkeypatch.setenv("E2B_API_KEY", c.api_key)
        c.watch = watch = MountWatch(c)
        yield c
        watch.assert_never_twice()
    finally:
        if watch:
            watch.close()
        c.close()
        shutil.rmtree(root / "volumes", ignore_errors=True)
        assert_clean(c)


def holder(c: Cluster, volume_id: str) -> str | None:
    """The node holding the volume's lease, as Redis says."""
    got = redis.Redis.from_url(c.redis_url).get(f"fy:vlease:{volume_id}")
    return got.decode() if got else None


def test_a_volume_is_reachable_from_every_node_and_mounted_by_one(vcluster):
    c = vcluster
    vol = Volume.create("shared-" + secrets.token_hex(3))
    assert Volume.get_info(vol.volume_id).token == vol.token
    assert vol.volume_id in {v.volume_id for v in Volume.list()}
    # The content API through the gateway: a node (the lowest id up) takes the lease.
    vol.write_file("/seed.txt", "from-the-content-api")
    assert holder(c, vol.volume_id) == "node0" and c.watch.now().get(vol.volume_id) == {"node0"}
    # Sandboxes mounting it go to its holder; real work writes there.
    a = Sandbox.create("base", timeout=120, volume_mounts={"/mnt": vol})
    assert c.owner(a.sandbox_id) == "node0"
    a.files.write("/home/user/gen.py", "import hashlib, sys\n"
                  "d = hashlib.sha256(b'x' * 10**6).hexdigest()\n"
                  "open(sys.argv[1] + '/out.txt', 'w').write(d)\n")
    assert a.commands.run("python3 /home/user/gen.py /mnt && cat /mnt/seed.txt").stdout == "from-the-content-api"
    digest = a.commands.run("cat /mnt/out.txt").stdout
    with c.api() as api:
        # node0 has room for one more: fork children of a sandbox mounting volumes do not
        # spill to node1, where the volume is not mounted.
        r = api.post(f"/sandboxes/{a.sandbox_id}/fork", json={"count": 2})
        assert r.status_code == 503 and "mounted on node node0" in r.json()["message"], r.text
    (child,) = a.fork(count=1, timeout=120)
    assert c.owner(child.sandbox_id) == "node0" and child.commands.run("cat /mnt/out.txt").stdout == digest
    vol2 = Volume.create("other-" + secrets.token_hex(3))
    with c.api() as api:
        # node0 is full: a sandbox mounting its volume waits for room there.
        r = api.post("/sandboxes", json={"templateID": "base", "volumeMounts": [{"name": vol.name, "path": "/mnt"}]})
        assert r.status_code == 503 and "mounted on node node0" in r.json()["message"], r.text
        d = Sandbox.create("base", timeout=120, volume_mounts={"/mnt": vol2})  # only node1 has room
        assert c.owner(d.sandbox_id) == "node1" and holder(c, vol2.volume_id) == "node1"
        r = api.post("/sandboxes", json={"templateID": "base", "volumeMounts": [
            {"name": vol.name, "path": "/mnt"}, {"name": vol2.name, "path": "/srv"}]})
        assert r.status_code == 409 and "mounted on different nodes" in r.json()["message"], r.text
    for s in (a, child, d):
        s.kill()
    # No sandbox mounts it any more: the holder unmounts it and gives the lease back.
    wait_for(lambda: holder(c, vol.volume_id) is None and vol.volume_id not in c.watch.now(), 30,
             "the idle volume to be given back")
    # Mounted on the other node now, which reads what the first wrote.
    with only_on(c, "node1"):
        e = Sandbox.create("base", timeout=120, volume_mounts={"/opt": vol})
    assert c.owner(e.sandbox_id) == "node1" and holder(c, vol.volume_id) == "node1"
    assert e.commands.run("cat /opt/out.txt").stdout == digest
    e.commands.run("echo from-the-other-node > /opt/b.txt")
    # The content API follows the holder (node0, the lowest id, is up again: it would
    # refuse the call, the volume being mounted on node1).
    assert vol.read_file("/b.txt").strip() == "from-the-other-node"
    assert sorted(x.name for x in vol.list("/")) == ["b.txt", "lost+found", "out.txt", "seed.txt"]
    assert c.watch.now().get(vol.volume_id) == {"node1"}
    with c.api() as api:  # mounted by a sandbox: not destroyed
        assert api.delete(f"/volumes/{vol.volume_id}").status_code == 409
    e.kill()
    assert Volume.destroy(vol.volume_id) is True and Volume.destroy(vol2.volume_id) is True
    assert vol.volume_id not in {v.volume_id for v in Volume.list()}


def test_concurrent_mounts_from_two_nodes_never_double_mount(vcluster):
    c = vcluster
    vol = Volume.create("race-" + secrets.token_hex(3))
    auth = {"Authorization": f"Bearer {vol.token}"}
    # Both nodes asked at once, straight (not through the gateway): one mounts, one is refused.
    for _ in range(4):
        wait_for(lambda: holder(c, vol.volume_id) is None, 30, "the volume to be idle")

        def ask(url):
            return httpx.get(f"{url}/volumecontent/{vol.volume_id}/dir", params={"path": "/"}, headers=auth,
                             timeout=30, trust_env=False)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(ask, c.node_urls))
        codes = sorted(r.status_code for r in got)
        assert codes == [200, 409], [r.text for r in got]
        refused = next(r for r in got if r.status_code == 409)
        assert "mounted on node" in refused.json()["message"]
        assert refused.headers["x-forkyard-volume-holder"] == holder(c, vol.volume_id)
    # Two creates at once through the gateway: both run, on the one node that mounts it.
    wait_for(lambda: holder(c, vol.volume_id) is None, 30, "the volume to be idle")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sbxs = list(pool.map(lambda p: Sandbox.create("base", timeout=120, volume_mounts={p: vol}),
                             ["/mnt", "/srv"]))
    try:
        owners = {c.owner(s.sandbox_id) for s in sbxs}
        assert owners == {holder(c, vol.volume_id)}, owners
        sbxs[0].commands.run("echo one > /mnt/one.txt")
        assert sbxs[1].commands.run("cat /srv/one.txt").stdout.strip() == "one"
    finally:
        for s in sbxs:
            s.kill()


def test_a_dead_nodes_lease_ends_with_its_heartbeats(vcluster):
    c = vcluster
    vol = Volume.create("dead-" + secrets.token_hex(3))
    with only_on(c, "node0"):
        vol.write_file("/kept.txt", "kept")  # node0 is the only node up: it takes the lease
    assert holder(c, vol.volume_id) == "node0"
    with c.api() as api:
        r = api.get(f"/volumes/{vol.volume_id}")
        assert r.status_code == 200 and r.json()["name"] == vol.name
    c.nodes[0].stop(sig_kill=True)
    # As when its host is gone: the host's mount of the image goes with it.
    mnt = f"{c.nodes[0].env['FORKYARD_DATA_DIR']}/volumes/{vol.volume_id}/data"
    assert os.system(f"umount {mnt}") == 0
    wait_for(lambda: c.node_states().get("node0") == "down", 60, "node0 to be declared down")
    assert vol.read_file("/kept.txt") == "kept"  # node1 took the lease over
    assert holder(c, vol.volume_id) == "node1"
    assert Volume.destroy(vol.volume_id) is True


def test_a_restarted_node_gives_back_what_it_held(vcluster):
    """A node killed while it holds an idle volume finds it mounted at its next start and
    gives it back once idle; a node restarted while its paused sandbox mounts a volume
    keeps the lease (the volume unmounted meanwhile) until that sandbox is gone."""
    c = vcluster
    vol = Volume.create("crash-" + secrets.token_hex(3))
    vol.write_file("/kept.txt", "kept")
    assert holder(c, vol.volume_id) == "node0" and c.watch.now().get(vol.volume_id) == {"node0"}
    c.nodes[0].stop(sig_kill=True)
    c.nodes[0].start()
    wait_for(lambda: holder(c, vol.volume_id) is None and vol.volume_id not in c.watch.now(), 60,
             "the restarted node to unmount the idle volume and give its lease back")
    with only_on(c, "node0"):
        s = Sandbox.create("base", timeout=120, volume_mounts={"/mnt": vol})
    s.commands.run("echo paused-here > /mnt/p.txt")
    assert s.pause() is True
    c.nodes[0].stop()  # a restart: the paused sandbox's volume is unmounted, its lease kept
    c.nodes[0].start()
    time.sleep(IDLE_S + 2)
    assert holder(c, vol.volume_id) == "node0" and vol.volume_id not in c.watch.now()
    Sandbox.kill(s.sandbox_id)
    wait_for(lambda: holder(c, vol.volume_id) is None and vol.volume_id not in c.watch.now(), 60,
             "the volume to be given back once its paused sandbox is gone")
    with only_on(c, "node1"):
        t = Sandbox.create("base", timeout=60, volume_mounts={"/mnt": vol})
    try:
        assert c.owner(t.sandbox_id) == "node1"
        assert t.commands.run("cat /mnt/kept.txt; echo; cat /mnt/p.txt").stdout.split() == ["kept", "paused-here"]
    finally:
        t.kill()
    assert Volume.destroy(vol.volume_id) is True


def test_a_paused_sandbox_moved_by_a_drain_takes_its_volume_along(vcluster):
    """Drained, node0 pauses the sandbox; a connect resumes it on node1, which mounts the
    volume once node0 has given it back (the restore waits for the lease)."""
    c = vcluster
    vol = Volume.create("moved-" + secrets.token_hex(3))
    with only_on(c, "node0"):
        s = Sandbox.create("base", timeout=300, volume_mounts={"/mnt": vol})
    s.commands.run("echo before-the-drain > /mnt/d.txt")
    with c.sched() as api:
        assert api.post("/v1/nodes/node0/drain").status_code == 200
    try:
        wait_for(lambda: s.get_info().state.value == "paused", 120, "the drain to pause the sandbox")
        s = Sandbox.connect(s.sandbox_id, timeout=300)
        assert c.owner(s.sandbox_id) == "node1" and holder(c, vol.volume_id) == "node1"
        assert s.commands.run("cat /mnt/d.txt").stdout.strip() == "before-the-drain"
        assert c.watch.now().get(vol.volume_id) == {"node1"}
    finally:
        with c.sched() as api:
            api.post("/v1/nodes/node0/undrain")
        s.kill()
    assert Volume.destroy(vol.volume_id) is True
