"""Snapshot repository benchmark: bytes stored and wall time per commit, restore with a
cold vs warm node cache, on posix_fs and on S3 (a local MinIO process: real S3 with authentication,
``tests/_minio.py``; built once by ``deploy/test.sh``).

Real runsc images of the ``base`` template (envd as init): ``c0`` (optionally after
writing ``--fill-mb`` MB of random data), ``c1`` after writing 1 MB more, and
``--forks`` children restored from ``c0``, each writing 64 KiB and checkpointed.

Reported per backend:

* first snapshot (``c0``), second snapshot after the 1 MB change (``c1``), the fork
  snapshots: bytes added to the repository (compressed chunks) and commit wall time;
* restore (materialize the image directory ``runsc restore`` reads) of ``c1`` on a node
  with a **cold** cache (everything fetched, host page cache dropped first), **warm** chunks (image evicted, chunks
  cached: nothing fetched) and a **hot** cache (materialized image reused).

Usage: ``python bench/bench_repository.py [--forks 16] [--fill-mb 0] [--settle 5] [-n 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, templates_dir

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from _minio import REGION as MINIO_REGION
from _minio import MinIO

from forkyard.config import Settings
from forkyard.network.slots import NetnsNetwork
from forkyard.repository.config import RepoConfig
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore, new_snapshot_id
from forkyard.runtime.base import SandboxSpec
from forkyard.runtime.gvisor.driver import GVisorDriver

MB = 1 << 20
ROOT = DATA / "repository"
BUCKET, REGION, KEY, SECRET = "forkyard-bench", MINIO_REGION, "bench-key", "bench-secret"


def _wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


async def make_images(rootfs: Path, out: Path, fill_mb: int, forks: int, settle_s: float = 5.0) -> None:
    """Write ``c0``, ``c1`` and ``fork<i>`` image directories under ``out``. The first
    checkpoint waits ``settle_s`` after boot: a just-booted sandbox still rewrites several
    MB of memory (measured: 7.5 MB of 64 KiB chunks change between a checkpoint at boot
    and one 5 s later, 1.4 MB compressed; between two idle checkpoints 1.6-2 MB, 0.15 MB
    compressed)."""
    settings = Settings(data_dir=ROOT / "rt")
    net = NetnsNetwork(settings, outer_net="10.123.0.0/16", prefix="fbs")
    net.setup_host()
    drv = GVisorDriver(settings)

    def spec(sid: str, i: int):
        slot = net.allocate(i)
        return SandboxSpec(sandbox_id=sid, rootfs=rootfs, network=slot.attachment, vcpus=1, memory_mb=512,
                           hostname="bench", workdir=settings.sandboxes_dir / sid), slot

    def sh(sid: str, script: str) -> None:
        subprocess.run([settings.runsc, f"--root={settings.runsc_root}", "exec", sid, "/bin/sh", "-c", script],
                       check=True, capture_output=True, timeout=120)

    try:
        src, slot = spec("src", 0)
        await drv.create(src)
        _wait_http(f"http://{slot.outer_ip}:49983/health")
        if fill_mb:
            sh("src", f"head -c {fill_mb}M /dev/urandom > /root/fill.bin")
        await asyncio.sleep(settle_s)
        await drv.checkpoint("src", out / "c0", leave_running=True)
        sh("src", "head -c 1M /dev/urandom > /root/change.bin")
        await drv.checkpoint("src", out / "c1", leave_running=True)
        await drv.destroy("src", src.workdir)
        net.release(0)
        for i in range(forks):
            kid, kslot = spec(f"kid{i}", 1)
            await drv.create(kid, drv.image_at(out / "c0"))
            _wait_http(f"http://{kslot.outer_ip}:49983/health")
            sh(kid.sandbox_id, f"head -c 64K /dev/urandom > /root/kid{i}")
            await drv.checkpoint(kid.sandbox_id, out / f"fork{i}", leave_running=False)
            await drv.destroy(kid.sandbox_id, kid.workdir)
            net.release(1)
    finally:
        for sid in ["src", *(f"kid{i}" for i in range(forks))]:
            await drv.destroy(sid, settings.sandboxes_dir / sid)
        for i in net.existing_indexes():
            net.release(i)
        net.teardown_host()


def start_minio() -> tuple[MinIO, str]:
    """MinIO on a free loopback port with bucket :data:`BUCKET`."""
    srv = MinIO(KEY, SECRET).start()
    srv.make_bucket(BUCKET)
    return srv, srv.url


def drop_page_cache() -> None:
    """``sync`` then drop the host's page cache (``/proc/sys/vm/drop_caches`` = 3, root),
    so a cold read really reads the disk; ``PermissionError`` when not root."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def _config(kind: str, s3_url: str | None, run: str) -> RepoConfig:
    if kind == "s3":
        return RepoConfig(url=f"s3://{BUCKET}/{run}", s3_endpoint=s3_url, s3_region=REGION, access_key=KEY,
                          secret_key=SECRET)
    return RepoConfig(url=str(ROOT / "runs" / run / "repository"))


def _commit(store: SnapshotStore, image: Path) -> tuple[float, int]:
    sid = new_snapshot_id()
    staging = store.staging(sid)
    shutil.rmtree(staging / "image")
    shutil.copytree(image, staging / "image")
    t = time.perf_counter()
    store.commit(staging, SnapshotMeta(sid, "snapshot", "base", "bench", 1, 512))
    return time.perf_counter() - t, store.last_commit_stats.new_stored_bytes


def bench_backend(kind: str, images: Path, forks: int, n: int, s3_url: str | None) -> dict:
    """Commit and restore timings/bytes for one backend (see the module doc)."""
    run = f"{kind}-{int(time.time())}"
    cfg = _config(kind, s3_url, run)
    writer = SnapshotStore(ROOT / "runs" / run / "writer", cfg, auto_gc=False)
    res: dict = {"backend": kind}
    res["image_mb"] = sum(p.stat().st_size for p in (images / "c1").iterdir()) / MB
    s, b = _commit(writer, images / "c0")
    res["first"] = {"seconds": s, "stored_mb": b / MB}
    s, b = _commit(writer, images / "c1")
    c1 = writer.list()[-1].snapshot_id
    res["second_after_1mb"] = {"seconds": s, "stored_mb": b / MB}
    fork_s, fork_b = [], []
    for i in range(forks):
        s, b = _commit(writer, images / f"fork{i}")
        fork_s.append(s)
        fork_b.append(b)
    res["forks"] = {"count": forks, "seconds_total": sum(fork_s), "seconds_median": statistics.median(fork_s) if fork_s else 0,
                    "stored_mb_total": sum(fork_b) / MB, "stored_mb_max": max(fork_b, default=0) / MB}
    res["repository_mb"] = writer.repo.stored_bytes()[1] / MB
    cold, warm, hot, fetched = [], [], [], []
    for r in range(n):
        node = SnapshotStore(ROOT / "runs" / run / f"node{r}", cfg, auto_gc=False)
        drop_page_cache()  # "cold": the repository's files (or MinIO's) come from disk too
        t = time.perf_counter()
        node.image(c1)
        cold.append(time.perf_counter() - t)
        fetched.append(node.metrics()["restore"]["bytes_fetched"])
        node.release(c1)
        t = time.perf_counter()
        node.image(c1)
        hot.append(time.perf_counter() - t)
        node.release(c1)
        node.release(c1)
        node.cache.drop_image(c1)
        t = time.perf_counter()
        node.image(c1)
        warm.append(time.perf_counter() - t)
        assert node.metrics()["restore"]["bytes_fetched"] == fetched[-1]
        node.close()
    res["restore"] = {"cold_s": statistics.median(cold), "warm_chunks_s": statistics.median(warm),
                      "hot_image_s": statistics.median(hot), "cold_fetched_mb": statistics.median(fetched) / MB, "n": n}
    writer.close()
    if kind == "posix_fs":
        shutil.rmtree(ROOT / "runs" / run, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--forks", type=int, default=16, help="fork snapshots to commit")
    ap.add_argument("--fill-mb", type=int, default=0, help="MB of random data written before the first checkpoint")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds between boot and the first checkpoint")
    ap.add_argument("-n", type=int, default=3, help="restore repetitions (median reported)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    rootfs = templates_dir() / "base" / "rootfs"
    images = ROOT / "images"
    shutil.rmtree(ROOT, ignore_errors=True)
    asyncio.run(make_images(rootfs, images, args.fill_mb, args.forks, args.settle))
    s3, url = start_minio()
    try:
        results = [bench_backend(k, images, args.forks, args.n, url) for k in ("posix_fs", "s3")]
    finally:
        s3.stop()
        shutil.rmtree(ROOT, ignore_errors=True)
    for r in results:
        print(f"== {r['backend']}  (image {r['image_mb']:.1f} MB; repository after all commits {r['repository_mb']:.2f} MB)")
        print(f"  first snapshot            stored {r['first']['stored_mb']:7.2f} MB  in {r['first']['seconds']:6.2f} s")
        print(f"  second after 1 MB change  stored {r['second_after_1mb']['stored_mb']:7.2f} MB  "
              f"in {r['second_after_1mb']['seconds']:6.2f} s")
        f = r["forks"]
        print(f"  {f['count']} fork snapshots         stored {f['stored_mb_total']:7.2f} MB  in {f['seconds_total']:6.2f} s "
              f"(max {f['stored_mb_max']:.2f} MB, median {f['seconds_median']:.2f} s each)")
        rs = r["restore"]
        print(f"  restore (materialize)     cold {rs['cold_s']:.3f} s (fetched {rs['cold_fetched_mb']:.2f} MB)  "
              f"warm chunks {rs['warm_chunks_s']:.3f} s  hot image {rs['hot_image_s']:.4f} s  (median of {rs['n']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
