"""P2P read path benchmark (issue 24): repository bytes read and restore latency, P2P
off vs on, with the repository an S3 server slowed to 1 Gbit/s.

The repository is a local MinIO (``tests/_minio.py``; ``$FORKYARD_MINIO`` or
``$FORKYARD_TEST_DATA_DIR/bin/minio``) in a network namespace of its own, reached over a
veth pair whose two ends are shaped to 1 Gbit/s with ``tc`` (``tbf``, each direction):
``10.239.0.1/30`` on the host, ``10.239.0.2/30`` in the namespace (clear of the ranges
tests/_slot.py lists). Namespace, link, qdiscs, server and its data are removed at the
end, also on failure.

For each mode a fresh cluster (``tests/_cluster.py``: real redis, scheduler, gateway,
3 node processes, all with ``FORKYARD_REPO=s3://…`` on that server) with
``FORKYARD_P2P`` off / on; node0 has room for 2 sandboxes. Per round:

Each step starts from its own sandbox on node0 holding ``--blob-mb`` MiB of fresh random
data in ``/dev/shm`` (so no step finds another's chunks in a cache):

* **resume elsewhere**: it is paused (committed to S3; node0's cache keeps the image)
  and resumed with node0 drained (on node1);
* **fan-out**: it takes a snapshot (committed; node0 keeps the image) and is removed;
  one sandbox is created from the snapshot on node1, then on node2 (the others
  drained, nothing running there) — the image spread over all 3 nodes;
* **fork spill-over**: it forks 3 children: 1 fits on node0, 2 go to node1/node2 and
  start from the fork's exported checkpoint (the timing includes node0's export).

Each is timed through the gateway (until envd answers); every child and the resumed
sandbox must hold the source's blob (sha256 compared, outside the timing). Summed over
all nodes: the stored bytes read from the repository and from peers
(``/metrics/repository``), and the bytes the S3 server sent over the shaped link (its
``tc`` counters: every GET, manifests included). The 1-min load is printed per figure.

Usage: ``python bench/bench_p2p.py [-n 2] [--blob-mb 64]`` (root; data under
``$FORKYARD_TEST_DATA_DIR`` or ``/var/lib/forkyard-test``, ``base`` built there if missing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests")]
from _common import pct  # noqa: E402

import httpx  # noqa: E402
from e2b import Sandbox  # noqa: E402

NETNS, HOST_IF, NS_IF = "fyp2pbench", "fyp2pb0", "fyp2pb1"
HOST_IP, NS_IP = "10.239.0.1", "10.239.0.2"
RATE = "1gbit"
BUCKET = "p2pbench"
MB = 1 << 20


def sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, check=check, capture_output=True, text=True).stdout


class ShapedNetns:
    """A network namespace joined to the host by a veth pair shaped to :data:`RATE` in
    both directions; removed by :meth:`close` (idempotent)."""

    def __enter__(self) -> ShapedNetns:
        self.close()  # a run killed before its cleanup left these
        sh("ip", "netns", "add", NETNS)
        sh("ip", "link", "add", HOST_IF, "type", "veth", "peer", "name", NS_IF, "netns", NETNS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", HOST_IF)
        sh("ip", "link", "set", HOST_IF, "up")
        sh("ip", "-n", NETNS, "addr", "add", f"{NS_IP}/30", "dev", NS_IF)
        sh("ip", "-n", NETNS, "link", "set", NS_IF, "up")
        sh("ip", "-n", NETNS, "link", "set", "lo", "up")
        # tbf: 1 Gbit/s, a 256 KiB bucket (≥ rate/HZ), at most 20 ms queued
        tbf = ["root", "tbf", "rate", RATE, "burst", "256kb", "latency", "20ms"]
        sh("tc", "qdisc", "add", "dev", HOST_IF, *tbf)  # host → S3 (uploads, requests)
        sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", NS_IF, *tbf)  # S3 → host (reads)
        return self

    def sent_bytes(self) -> int:
        """Bytes the S3 side has sent to the host so far (its qdisc's counter)."""
        out = sh("ip", "netns", "exec", NETNS, "tc", "-s", "qdisc", "show", "dev", NS_IF)
        return int(out.split("Sent ", 1)[1].split(" bytes", 1)[0])

    def close(self) -> None:
        for pid in sh("ip", "netns", "pids", NETNS, check=False).split():
            subprocess.run(["kill", "-9", pid], check=False)
        subprocess.run(["ip", "link", "del", HOST_IF], check=False, capture_output=True)  # its qdisc and peer too
        subprocess.run(["ip", "netns", "del", NETNS], check=False, capture_output=True)

    def __exit__(self, *exc) -> None:
        self.close()


def only_on(c, node: str):
    """Context: every node but ``node`` drained (undrained after)."""

    class _Ctx:
        def __enter__(self):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    if f"node{i}" != node:
                        s.post(f"/v1/nodes/node{i}/drain")
            time.sleep(0.6)  # the gateway reuses its node list for 0.5 s

        def __exit__(self, *exc):
            with c.sched() as s:
                for i in range(len(c.nodes)):
                    s.post(f"/v1/nodes/node{i}/undrain")

    return _Ctx()


def reads(c, net: ShapedNetns) -> tuple[int, int, int]:
    """``(repository bytes, peer bytes, S3 wire bytes)`` read so far: stored bytes the
    nodes read for restores from the repository and from peers, bytes S3 sent."""
    repo = peers = 0
    for url in c.node_urls:
        m = httpx.get(f"{url}/metrics/repository", headers={"X-API-Key": c.api_key}, timeout=10).json()
        repo += m["restore"]["bytes_fetched"]
        peers += m.get("p2p", {}).get("bytes_from_peers", 0)
    return repo, peers, net.sent_bytes()


def source(c, blob_mb: int) -> tuple[Sandbox, str]:
    """A ``base`` sandbox holding ``blob_mb`` MiB of fresh random data in ``/dev/shm``, and its sha256."""
    src = Sandbox.create("base", timeout=600, **c.sdk)
    src.commands.run(f"head -c {blob_mb}M /dev/urandom > /dev/shm/blob", timeout=120)
    return src, blob_sum(src)


def blob_sum(sbx: Sandbox) -> str:
    return sbx.commands.run("sha256sum /dev/shm/blob", timeout=120).stdout.split()[0]


class Phase:
    """Latencies, bytes (repository, peers, S3 wire) and loads of one measured step."""

    def __init__(self):
        self.ms, self.repo, self.peers, self.wire, self.load = [], [], [], [], []

    def measure(self, c, net, fn):
        before = reads(c, net)
        self.load.append(os.getloadavg()[0])
        t0 = time.perf_counter()
        out = fn()
        self.ms.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.3)
        after = reads(c, net)
        self.repo.append(after[0] - before[0])
        self.peers.append(after[1] - before[1])
        self.wire.append(after[2] - before[2])
        return out


def one_mode(p2p: bool, n: int, blob_mb: int, s3: dict, net: ShapedNetns) -> dict[str, Phase]:
    from _cluster import Cluster
    from conftest import TEST_ROOT

    env = dict(s3, FORKYARD_REPO=f"s3://{BUCKET}/{'on' if p2p else 'off'}-{os.getpid()}")
    if p2p:
        env |= {"FORKYARD_P2P": "on", "FORKYARD_P2P_BIND": "127.0.0.1:0"}
    c = Cluster(TEST_ROOT / f"bench-p2p-{'on' if p2p else 'off'}", nodes=3, env=env, max_sandboxes={0: 2})
    out = {k: Phase() for k in ("fan", "fan_total", "fork", "resume")}
    try:
        c.start()
        time.sleep(2.5)  # every node has heard of its peers
        for _ in range(n):  # fresh random data per step: no chunk of one step is cached by another
            with only_on(c, "node0"):  # (a drained node pauses what runs there: only_on with nothing running)
                src, want = source(c, blob_mb)
            src.pause()
            with only_on(c, "node1"):
                time.sleep(1.2)  # node1's peer table lists node0's new image
                moved = out["resume"].measure(c, net, lambda: Sandbox.connect(src.sandbox_id, timeout=600, **c.sdk))
            assert c.owner(src.sandbox_id) == "node1" and blob_sum(moved) == want
            moved.kill()

            with only_on(c, "node0"):
                src, want = source(c, blob_mb)
            snap = src.create_snapshot()
            src.kill()  # node0's cache keeps the image
            time.sleep(1.2)
            fan = [0, 0, 0]
            for node in ("node1", "node2"):  # one after the other: the image on all 3 nodes
                with only_on(c, node):
                    kid = out["fan"].measure(c, net, lambda: Sandbox.create(snap.snapshot_id, timeout=600, **c.sdk))
                assert c.owner(kid.sandbox_id) == node and blob_sum(kid) == want
                kid.kill()
                fan = [x + y[-1] for x, y in zip(fan, (out["fan"].repo, out["fan"].peers, out["fan"].wire))]
            out["fan_total"].repo.append(fan[0])
            out["fan_total"].peers.append(fan[1])
            out["fan_total"].wire.append(fan[2])
            out["fan_total"].ms.append(sum(out["fan"].ms[-2:]))
            out["fan_total"].load.extend(out["fan"].load[-2:])
            Sandbox.delete_snapshot(snap.snapshot_id, **c.sdk)

            with only_on(c, "node0"):  # node0 is then full but for one child
                src, want = source(c, blob_mb)

            def fork():
                with c.api() as api:
                    r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 3, "timeout": 600}, timeout=900)
                assert r.status_code == 201, r.text
                return [x["sandbox"]["sandboxID"] for x in r.json()]

            kids = out["fork"].measure(c, net, fork)
            assert sorted(c.owner(k) for k in kids).count("node0") == 1, [c.owner(k) for k in kids]
            for k in kids:
                kid = Sandbox.connect(k, **c.sdk)
                assert blob_sum(kid) == want
                kid.kill()
            src.kill()
    finally:
        c.close()
    return out


def s3_read_ms(minio, blob_mb: int) -> float:
    """One GET of a ``blob_mb`` MiB object through the shaped link (the link's own speed)."""
    cl = minio.client()
    cl.put_object(Bucket=BUCKET, Key="probe", Body=os.urandom(blob_mb * MB))
    t0 = time.perf_counter()
    cl.get_object(Bucket=BUCKET, Key="probe")["Body"].read()
    ms = (time.perf_counter() - t0) * 1000
    cl.delete_object(Bucket=BUCKET, Key="probe")
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=2, help="rounds per mode (default 2)")
    ap.add_argument("--blob-mb", type=int, default=64, help="random MiB in the source's memory (default 64)")
    args = ap.parse_args()
    from _minio import MinIO
    from conftest import TEST_ROOT
    from forkyard.config import Settings
    from forkyard.templates.base import build_base

    build_base(Settings(data_dir=TEST_ROOT), progress=lambda line: None)
    with ShapedNetns() as net:
        minio = MinIO(netns=NETNS, host=NS_IP, port=9000)
        try:
            minio.start()
            minio.make_bucket(BUCKET)
            probe = s3_read_ms(minio, args.blob_mb)
            s3 = {"FORKYARD_S3_ENDPOINT": minio.url, "FORKYARD_S3_REGION": minio.region,
                  "AWS_ACCESS_KEY_ID": minio.access_key, "AWS_SECRET_ACCESS_KEY": minio.secret_key}
            results = {mode: one_mode(mode == "on", args.n, args.blob_mb, s3, net) for mode in ("off", "on")}
        finally:
            minio.stop()
    print(f"\nS3 (MinIO in netns {NETNS}) behind tc tbf {RATE} each way; one GET of {args.blob_mb} MiB: "
          f"{probe:.0f} ms ({args.blob_mb * MB * 8 / probe / 1e6:.2f} Gbit/s)")
    names = {"fan": "create from node0's snapshot (each)",
             "fan_total": "fan-out: on node1, then node2 (sum)",
             "fork": "fork of 3 (2 spill to node1/node2)",
             "resume": "resume node0's paused sandbox on node1"}
    print(f"\n{'step':<40} {'P2P':>3} {'p50 ms':>8} {'max ms':>8} {'repo MB':>8} {'peers MB':>9} "
          f"{'S3 wire MB':>10}  load")
    for key, name in names.items():
        for mode, r in results.items():
            p = r[key]
            print(f"{name:<40} {mode:>3} {pct(p.ms, 50):8.0f} {max(p.ms):8.0f} "
                  f"{sum(p.repo) / len(p.repo) / MB:8.1f} {sum(p.peers) / len(p.peers) / MB:9.1f} "
                  f"{sum(p.wire) / len(p.wire) / MB:10.1f}  {min(p.load):.1f}-{max(p.load):.1f}")
    print(f"\n(MB per round, mean of {args.n}; stored = compressed bytes; S3 wire = bytes the server sent; "
          f"{os.cpu_count()} CPUs shared by every node and the server; load = 1-min load at each step's start, "
          f"now {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
