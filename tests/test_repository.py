"""Snapshot repository (issue 4): manifest + content-addressed chunks on posix_fs and on a
real S3 server (MinIO, with real authentication and a region: ``_minio.py``), node cache bound,
restore after the cache is wiped, corruption, GC, and a real runsc restore from a
materialized image.

Checkpoint images are real: a ``base`` sandbox (runsc, own network prefix and runsc
root) checkpointed before and after writing 1 MB, and 16 fork children restored from
the first image, each changed a little and checkpointed.
"""

from __future__ import annotations

import asyncio
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from dataclasses import replace
from pathlib import Path

import _hostutil as hu
from _minio import REGION as MINIO_REGION
from _minio import MinIO
import pytest
from conftest import TEST_ROOT, ServerProc

from forkyard.config import Settings
from forkyard.network.slots import NetnsNetwork
from forkyard.repository import (
    ChunkCorrupt,
    ChunkMissing,
    RepositoryConfigError,
    RepositoryError,
    SnapshotNotFound,
)
from forkyard.repository.chunks import chunk_key
from forkyard.repository.config import RepoConfig
from forkyard.repository.repo import GC_LOCK, manifest_key
from forkyard.repository.snapshots import SnapshotMeta, SnapshotStore, new_snapshot_id
from forkyard.runtime.base import SandboxSpec
from forkyard.runtime.gvisor import GVisorDriver
from forkyard.templates.base import build_base

MB = 1 << 20
FORKS = 16
from _slot import LETTER, SLOT  # noqa: E402 — this session's slot (tests/_slot.py)

PREFIX = "fr" + LETTER
OUTER_NET = f"10.{192 + SLOT}.0.0/16"
BUCKET = "forkyard-test"
REGION = MINIO_REGION
KEY, SECRET = "forkyard-test-key", "forkyard-test-secret"


# ------------------------------------------------------------------------ S3 server


@pytest.fixture(scope="session")
def minio():
    """A MinIO server with bucket :data:`BUCKET`, for the whole session."""
    srv = MinIO(KEY, SECRET).start()
    srv.make_bucket(BUCKET)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def s3_endpoint(minio) -> str:
    return minio.url


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=KEY,
                        aws_secret_access_key=SECRET)


# ------------------------------------------------------------------- real images


class Rig:
    """runsc + network slots on this module's own prefix, and the images it made."""

    def __init__(self):
        root = hu.data_root()
        self.dir = root / f"repo-{PREFIX}"
        shutil.rmtree(self.dir, ignore_errors=True)
        self.settings = Settings(data_dir=self.dir, templates_override=str(root / "templates"))
        self.rootfs = build_base(hu.template_settings(), progress=lambda line: None)
        self.nm = NetnsNetwork(self.settings, outer_net=OUTER_NET, prefix=PREFIX)
        self.driver = GVisorDriver(self.settings, init_argv=hu.HTTP_INIT)
        self.images = self.dir / "images"
        self.live: dict[str, tuple[SandboxSpec, int]] = {}
        self.a_sha = ""

    def spec(self, sandbox_id: str, index: int) -> tuple[SandboxSpec, object]:
        slot = self.nm.allocate(index)
        spec = SandboxSpec(sandbox_id=sandbox_id, rootfs=self.rootfs, network=slot.attachment, vcpus=1,
                           memory_mb=256, hostname="e2b.local", workdir=self.settings.sandboxes_dir / sandbox_id)
        self.live[sandbox_id] = (spec, index)
        return spec, slot

    def sh(self, sandbox_id: str, script: str) -> str:
        r = hu.runsc_exec(self.settings, sandbox_id, ["/bin/sh", "-c", script])
        assert r.returncode == 0, f"exit {r.returncode}: {r.stdout} {r.stderr}"
        return r.stdout

    async def stop(self, sandbox_id: str) -> None:
        spec, index = self.live.pop(sandbox_id)
        await self.driver.destroy(sandbox_id, spec.workdir)
        self.nm.release(index)
        shutil.rmtree(spec.workdir, ignore_errors=True)

    async def make_images(self) -> None:
        self.nm.setup_host()
        src, slot = self.spec(f"{PREFIX}-src", 1)
        await self.driver.create(src)
        _http_ok(slot.outer_ip)
        await asyncio.sleep(3)  # a just-booted sandbox still rewrites memory (see bench_repository)
        await self.driver.checkpoint(src.sandbox_id, self.images / "c0", leave_running=True)
        self.a_sha = self.sh(src.sandbox_id, "head -c 1048576 /dev/urandom > /root/a.bin && sha256sum /root/a.bin").split()[0]
        await self.driver.checkpoint(src.sandbox_id, self.images / "c1", leave_running=True)
        await self.stop(src.sandbox_id)
        for i in range(FORKS):
            kid, kslot = self.spec(f"{PREFIX}-kid{i}", 2)
            await self.driver.create(kid, self.driver.image_at(self.images / "c0"))
            _http_ok(kslot.outer_ip)
            self.sh(kid.sandbox_id, f"head -c 65536 /dev/urandom > /root/kid{i}")
            await self.driver.checkpoint(kid.sandbox_id, self.images / f"fork{i}", leave_running=True)
            await self.stop(kid.sandbox_id)

    async def teardown(self) -> None:
        for sid in list(self.live):
            await self.stop(sid)
        self.nm.teardown_host()
        shutil.rmtree(self.dir, ignore_errors=True)


def _http_ok(ip: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip}:{hu.HTTP_PORT}/", timeout=2) as r:
                assert r.status == 200
                return
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(scope="module")
def rig():
    r = Rig()
    try:
        asyncio.run(r.make_images())
        yield r
    finally:
        asyncio.run(r.teardown())
    assert not [n for n in hu.netns_names(PREFIX)]


# ------------------------------------------------------------------------- stores


@pytest.fixture(params=["posix_fs", "s3"])
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def make_store(tmp_path, request):
    """``make_store(kind, node="n1", cache_bytes=1 GiB) -> SnapshotStore``: stores of
    one test share one repository (a directory, or a fresh prefix in the S3 bucket);
    each ``node`` has its own staging/cache root."""
    prefix = uuid.uuid4().hex[:12]
    stores: list[SnapshotStore] = []

    def make(kind: str, node: str = "n1", cache_bytes: int = 1 << 30) -> SnapshotStore:
        if kind == "s3":
            endpoint = request.getfixturevalue("s3_endpoint")
            cfg = RepoConfig(url=f"s3://{BUCKET}/{prefix}", s3_endpoint=endpoint, s3_region=REGION,
                             access_key=KEY, secret_key=SECRET, cache_bytes=cache_bytes)
        else:
            cfg = RepoConfig(url=str(tmp_path / "repository"), cache_bytes=cache_bytes)
        st = SnapshotStore(tmp_path / node, cfg, auto_gc=False)
        stores.append(st)
        return st

    yield make
    for st in stores:
        st.close()


def commit(store: SnapshotStore, image: Path, kind: str = "snapshot") -> SnapshotMeta:
    """Copy ``image`` into a fresh staging dir and commit it."""
    sid = new_snapshot_id()
    staging = store.staging(sid)
    shutil.rmtree(staging / "image")
    shutil.copytree(image, staging / "image")
    return store.commit(staging, SnapshotMeta(sid, kind, "base", "src", 1, 256))


def same_tree(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def chunks_of(store: SnapshotStore, sid: str) -> set[str]:
    return store.repo.manifest(sid).chunk_hashes()


# -------------------------------------------------------------------------- tests


def test_s3_settings_must_be_explicit(tmp_path):
    base = {"FORKYARD_REPO": "s3://bucket/prefix", "FORKYARD_S3_ENDPOINT": "http://127.0.0.1:1",
            "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}
    with pytest.raises(RepositoryConfigError, match="FORKYARD_S3_REGION"):
        SnapshotStore(tmp_path, RepoConfig.from_env(tmp_path, base))
    with pytest.raises(RepositoryConfigError, match="AWS_SECRET_ACCESS_KEY"):
        RepoConfig.from_env(tmp_path, {**base, "FORKYARD_S3_REGION": "r", "AWS_SECRET_ACCESS_KEY": ""}).open_backend()
    with pytest.raises(RepositoryConfigError, match="FORKYARD_CACHE_BYTES"):
        RepoConfig.from_env(tmp_path, {"FORKYARD_CACHE_BYTES": "lots"})
    cfg = RepoConfig.from_env(tmp_path / "repo", {"FORKYARD_CACHE_BYTES": "12345"})
    assert cfg.url == str(tmp_path / "repo") and cfg.cache_bytes == 12345


@pytest.mark.parametrize("change, message", [
    ({"access_key": "nobody"}, "does not know access key 'nobody': check AWS_ACCESS_KEY_ID \\(InvalidAccessKeyId\\)"),
    ({"secret_key": "wrong-secret"}, "rejected the request signature: check AWS_SECRET_ACCESS_KEY \\(SignatureDoesNotMatch\\)"),
    ({"s3_region": "us-east-1"}, f"is in region '{REGION}', not FORKYARD_S3_REGION='us-east-1': set FORKYARD_S3_REGION={REGION}"),
    ({"url": "s3://no-such-bucket/p"}, "bucket does not exist: create it"),
    ({"s3_endpoint": "http://127.0.0.1:1"}, "cannot be reached .*check FORKYARD_S3_ENDPOINT"),
])
def test_s3_startup_errors_say_what_to_fix(tmp_path, s3_endpoint, change, message):
    """Against a real S3 server (MinIO checks signatures and keys): each wrong setting
    stops the repository at startup with the setting to fix, and nothing is written."""
    cfg = RepoConfig(url=f"s3://{BUCKET}/bad", s3_endpoint=s3_endpoint, s3_region=REGION, access_key=KEY,
                     secret_key=SECRET)
    with pytest.raises(RepositoryConfigError, match=message):
        SnapshotStore(tmp_path, replace(cfg, **change), auto_gc=False)
    assert "Contents" not in s3_client(s3_endpoint).list_objects_v2(Bucket=BUCKET, Prefix="bad/")
    SnapshotStore(tmp_path / "ok", cfg, auto_gc=False).close()  # the right settings work


def test_s3_refuses_wrong_credentials_after_startup(tmp_path, s3_endpoint):
    """A real server checks every request: a repository whose secret is changed under
    it fails its next put with the server's own error, and nothing lands."""
    st = SnapshotStore(tmp_path, RepoConfig(url=f"s3://{BUCKET}/rot", s3_endpoint=s3_endpoint, s3_region=REGION,
                                            access_key=KEY, secret_key=SECRET), auto_gc=False)
    try:
        import boto3

        st.repo.backend._client = boto3.client("s3", endpoint_url=s3_endpoint, region_name=REGION,
                                               aws_access_key_id=KEY, aws_secret_access_key="rotated")
        with pytest.raises(RepositoryError, match="SignatureDoesNotMatch"):
            st.repo.backend.put("probe", b"x")
        assert "Contents" not in s3_client(s3_endpoint).list_objects_v2(Bucket=BUCKET, Prefix="rot/")
    finally:
        st.close()


def test_commit_and_restore_round_trip(rig, make_store, backend_kind):
    """A committed image comes back byte for byte on another node (fetched chunks), a
    second restore there reuses the materialized image, and a third after the image was
    evicted reads every chunk from the node cache."""
    a = make_store(backend_kind, "a")
    meta = commit(a, rig.images / "c0")
    assert a.get(meta.snapshot_id) == meta
    assert same_tree(a.image(meta.snapshot_id), rig.images / "c0")  # the committed staging image
    assert a.metrics()["restore"]["bytes_fetched"] == 0

    b = make_store(backend_kind, "b")
    d = b.image(meta.snapshot_id)
    assert same_tree(d, rig.images / "c0")
    m1 = b.metrics()
    assert m1["restore"]["bytes_fetched"] > 0 and m1["cache"]["chunk_misses"] > 0 and m1["cache"]["image_misses"] == 1
    assert b.image(meta.snapshot_id) == d
    m2 = b.metrics()
    assert m2["cache"]["image_hits"] == 1 and m2["restore"]["bytes_fetched"] == m1["restore"]["bytes_fetched"]
    b.release(meta.snapshot_id)
    b.release(meta.snapshot_id)
    b.cache.drop_image(meta.snapshot_id)
    assert same_tree(b.image(meta.snapshot_id), rig.images / "c0")
    m3 = b.metrics()
    assert m3["restore"]["bytes_fetched"] == m1["restore"]["bytes_fetched"]  # nothing fetched again
    assert m3["cache"]["chunk_hits"] > 0
    with pytest.raises(SnapshotNotFound):
        b.image("doesnotexist")
    with pytest.raises(FileExistsError):
        staging = a.staging(meta.snapshot_id)
        shutil.copytree(rig.images / "c0", staging / "image", dirs_exist_ok=True)
        a.commit(staging, replace(meta))


def test_incremental_and_fork_sharing(rig, make_store, backend_kind):
    """After a 1 MB change the second snapshot stores <= 3 MB; 16 fork snapshots share
    their common chunks and each stores <= 3 MB of new data."""
    st = make_store(backend_kind)
    first = commit(st, rig.images / "c0")
    s1 = st.commit_stats(first.snapshot_id)
    _, bytes0 = st.repo.stored_bytes()
    assert bytes0 == s1.new_stored_bytes and s1.new_stored_bytes < s1.raw_bytes
    second = commit(st, rig.images / "c1")
    s2 = st.commit_stats(second.snapshot_id)
    _, bytes1 = st.repo.stored_bytes()
    print(f"\nfirst: {s1.raw_bytes / MB:.1f} MB image, stored {s1.new_stored_bytes / MB:.2f} MB; "
          f"second after 1 MB change: new {s2.new_raw_bytes / MB:.2f} MB raw, stored {s2.new_stored_bytes / MB:.2f} MB")
    assert bytes1 - bytes0 == s2.new_stored_bytes <= 3 * MB
    assert s2.new_raw_bytes <= 3 * MB

    forks = [commit(st, rig.images / f"fork{i}", kind="fork") for i in range(FORKS)]
    stats = [st.commit_stats(f.snapshot_id) for f in forks]
    _, bytes2 = st.repo.stored_bytes()
    per_fork = [s.new_stored_bytes for s in stats]
    print(f"16 forks: stored {sum(per_fork) / MB:.2f} MB in all (max {max(per_fork) / MB:.2f} MB) "
          f"vs {16 * s1.new_stored_bytes / MB:.1f} MB without sharing")
    assert bytes2 - bytes1 == sum(per_fork)
    assert max(per_fork) <= 3 * MB
    assert sum(per_fork) < 4 * s1.new_stored_bytes  # vs 16x without sharing
    common = set.intersection(*(chunks_of(st, f.snapshot_id) for f in forks))
    assert len(common) >= 0.5 * min(len(chunks_of(st, f.snapshot_id)) for f in forks)
    print(f"chunks common to all 16 forks: {len(common)}; shared with the parent image: "
          f"{len(common & chunks_of(st, first.snapshot_id))}")


def test_cache_bound_respected_under_eviction(rig, make_store):
    """Materializing more images than fit keeps the cache within its byte bound (LRU
    evicts), and every image is still correct."""
    img = sum(p.stat().st_size for p in (rig.images / "c0").iterdir())
    limit = int(2.5 * img)
    writer = make_store("posix_fs", "writer")
    metas = [commit(writer, rig.images / n) for n in ("c0", "c1", "fork0", "fork1", "fork2")]
    node = make_store("posix_fs", "node", cache_bytes=limit)
    for m, n in zip(metas, ("c0", "c1", "fork0", "fork1", "fork2")):
        assert same_tree(node.image(m.snapshot_id), rig.images / n)
        node.release(m.snapshot_id)
        assert node.cache.used_bytes <= limit
        assert node.cache.disk_bytes() <= limit
    met = node.metrics()["cache"]
    assert met["evictions"] > 0 and met["images"] < len(metas)
    # A restarted node rebuilds its index from disk and a smaller bound applies at once.
    node.close()
    small = SnapshotStore(node.root, replace(node.config, cache_bytes=img // 2), auto_gc=False)
    assert small.cache.used_bytes <= img // 2 and small.cache.disk_bytes() <= img // 2
    small.close()


def test_restore_after_cache_wiped(rig, make_store, backend_kind):
    st = make_store(backend_kind)
    meta = commit(st, rig.images / "c1")
    st.release(meta.snapshot_id)
    shutil.rmtree(st.root / "cache")  # under a live store: always safe
    assert same_tree(st.image(meta.snapshot_id), rig.images / "c1")
    assert st.metrics()["restore"]["bytes_fetched"] > 0


def _corrupt(store: SnapshotStore, kind: str, h: str, endpoint: str | None) -> None:
    key = chunk_key(h)
    if kind == "posix_fs":
        p = Path(store.repo.backend.location) / key
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    else:  # a valid zstd frame of other content
        from forkyard.repository.chunks import compress

        s3_client(endpoint).put_object(Bucket=BUCKET, Key=store.repo.backend.prefix + key, Body=compress(b"x" * 1000))


def test_corrupt_or_missing_chunk_fails_restore_clearly(rig, make_store, backend_kind, request):
    endpoint = request.getfixturevalue("s3_endpoint") if backend_kind == "s3" else None
    st = make_store(backend_kind)
    meta = commit(st, rig.images / "c0")
    pages = next(f for f in st.repo.manifest(meta.snapshot_id).files if f.path == "pages.img")
    victim = pages.chunks[len(pages.chunks) // 2][0]
    _corrupt(st, backend_kind, victim, endpoint)
    node = make_store(backend_kind, "other")
    with pytest.raises(ChunkCorrupt) as err:
        node.image(meta.snapshot_id)
    assert err.value.chunk == victim and err.value.snapshot_id == meta.snapshot_id
    assert meta.snapshot_id in str(err.value) and victim in str(err.value) and "corrupt" in str(err.value)
    assert not node.cache.image_dir(meta.snapshot_id).exists()
    assert not [p for p in (node.root / "cache" / "images").iterdir()]  # no half-made image left

    st.repo.backend.delete(chunk_key(victim))
    with pytest.raises(ChunkMissing, match=f"{meta.snapshot_id}.*{victim}.*missing"):
        node.image(meta.snapshot_id)

    # A corrupt chunk in the node cache is not trusted either: dropped and fetched again.
    # (A new writer: ``st`` remembers the chunk removed behind its back as present.)
    meta2 = commit(make_store(backend_kind, "writer2"), rig.images / "c1")
    n2 = make_store(backend_kind, "third")
    n2.image(meta2.snapshot_id)
    n2.release(meta2.snapshot_id)
    n2.cache.drop_image(meta2.snapshot_id)
    cached = next(p for p in (n2.root / "cache" / "chunks").rglob("*") if p.is_file())
    cached.write_bytes(b"garbage")
    fetched = n2.metrics()["restore"]["chunks_fetched"]
    assert same_tree(n2.image(meta2.snapshot_id), rig.images / "c1")
    assert n2.metrics()["restore"]["chunks_fetched"] == fetched + 1


def test_gc_frees_only_unreferenced_chunks(rig, make_store, backend_kind):
    st = make_store(backend_kind)
    a = commit(st, rig.images / "c0")
    b = commit(st, rig.images / "c1")
    only_a = chunks_of(st, a.snapshot_id) - chunks_of(st, b.snapshot_id)
    assert only_a
    assert st.delete(a.snapshot_id) and not st.delete(a.snapshot_id)
    assert st.get(a.snapshot_id) is None and [m.snapshot_id for m in st.list()] == [b.snapshot_id]
    out = st.gc(grace_s=3600)  # everything is younger than the grace period
    assert out["chunks_freed"] == 0

    # An in-progress commit's lease protects the chunks it will reference.
    leased = min(only_a)
    st.repo.backend.put("leases/inflight-0000.json",
                        json.dumps({"snapshot_id": "inflight", "created_at": time.time(), "chunks": [leased]}).encode())
    n_before, bytes_before = st.repo.stored_bytes()
    out = st.gc(grace_s=0)
    assert out["chunks_freed"] == len(only_a) - 1
    n_after, bytes_after = st.repo.stored_bytes()
    assert n_before - n_after == out["chunks_freed"] and bytes_before - bytes_after == out["bytes_freed"]
    assert st.repo.backend.exists(chunk_key(leased))
    assert all(st.repo.backend.exists(chunk_key(h)) for h in chunks_of(st, b.snapshot_id))
    assert not any(st.repo.backend.exists(chunk_key(h)) for h in only_a - {leased})
    st.repo.backend.delete("leases/inflight-0000.json")
    assert st.gc(grace_s=0)["chunks_freed"] == 1

    # The survivor still restores from scratch on another node.
    other = make_store(backend_kind, "other")
    assert same_tree(other.image(b.snapshot_id), rig.images / "c1")
    assert other.metrics()["gc"]["gc_runs"] == 0 and st.metrics()["gc"]["gc_chunks_freed"] == len(only_a)


def test_commit_after_gc_uploads_freed_chunks_again(rig, make_store, backend_kind):
    """A writer skips existence checks for chunks it committed itself — until a GC has
    run (the GC epoch changed): then chunks the GC freed are uploaded again."""
    st = make_store(backend_kind)
    a = commit(st, rig.images / "c0")
    again = commit(st, rig.images / "c0")
    assert st.commit_stats(again.snapshot_id).new_chunks == 0
    st.delete(a.snapshot_id)
    st.delete(again.snapshot_id)
    assert st.gc(grace_s=0)["chunks_freed"] > 0
    assert st.repo.stored_bytes() == (0, 0)
    third = commit(st, rig.images / "c0")
    assert st.commit_stats(third.snapshot_id).new_chunks == st.commit_stats(third.snapshot_id).unique_chunks
    assert same_tree(make_store(backend_kind, "other").image(third.snapshot_id), rig.images / "c0")


def test_commit_waits_for_a_running_gc_and_interrupted_commits_leave_nothing(rig, make_store, backend_kind):
    st = make_store(backend_kind)
    st.repo.backend.put(GC_LOCK, json.dumps({"created_at": time.time()}).encode(), exclusive=True)
    sid = new_snapshot_id()
    staging = st.staging(sid)
    shutil.copytree(rig.images / "c0", staging / "image", dirs_exist_ok=True)
    done: list[object] = []
    t = threading.Thread(target=lambda: done.append(st.commit(staging, SnapshotMeta(sid, "snapshot", "base", "s", 1, 256))))
    t.start()
    time.sleep(1.5)
    assert not done and not list(st.repo.backend.list("chunks/"))  # waits before checking/uploading chunks
    assert list(st.repo.backend.list("leases/"))  # but its lease is already there
    assert st.gc(grace_s=0)["skipped"]  # a second GC does not run either
    st.repo.backend.delete(GC_LOCK)
    t.join(120)
    assert done and st.get(sid) is not None and not list(st.repo.backend.list("leases/"))

    # A commit that dies before its manifest is written leaves no snapshot.
    put = st.repo.backend.put

    def failing_put(key, data, exclusive=False):
        if key.startswith("manifests/"):
            raise OSError("simulated crash")
        return put(key, data, exclusive)

    st.repo.backend.put = failing_put
    with pytest.raises(OSError):
        commit(st, rig.images / "c1")
    st.repo.backend.put = put
    assert [m.snapshot_id for m in st.list()] == [sid]
    assert not st.repo.backend.exists(manifest_key("x"))
    assert st.gc(grace_s=0)["chunks_freed"] > 0  # its orphan chunks are collected


async def test_runsc_restores_from_materialized_s3_image(rig, make_store, s3_endpoint):
    """End to end: commit to S3 on one node, materialize on a fresh node, ``runsc
    restore`` from it: the 1 MB file written before the checkpoint is there intact."""
    st = make_store("s3", "writer")
    meta = commit(st, rig.images / "c1")
    node = make_store("s3", "fresh")
    path = await asyncio.to_thread(node.image, meta.snapshot_id)
    try:
        kid, slot = rig.spec(f"{PREFIX}-e2e", 3)
        await rig.driver.create(kid, rig.driver.image_at(path))
    finally:
        node.release(meta.snapshot_id)
    try:
        _http_ok(slot.outer_ip)
        assert rig.sh(kid.sandbox_id, "sha256sum /root/a.bin").split()[0] == rig.a_sha
    finally:
        await rig.stop(kid.sandbox_id)


# ------------------------------------------------------------ server on S3, end to end


class S3Server(ServerProc):
    """A ``forkyard serve`` whose repository is the test S3 bucket (own network prefix)."""

    def __init__(self, data_dir: Path, extra_env: dict[str, str]):
        super().__init__(data_dir, TEST_ROOT / "templates")
        self.extra_env = extra_env

    def env(self) -> dict[str, str]:
        env = super().env()
        env.update(FORKYARD_NET_PREFIX=SERVER_PREFIX, FORKYARD_OUTER_NET=SERVER_OUTER_NET, **self.extra_env)
        return env


SERVER_PREFIX = "fs" + LETTER
SERVER_OUTER_NET = f"10.212.{SLOT * 16}.0/20"


def test_server_refuses_s3_without_region(tmp_path):
    srv = S3Server(tmp_path / "data", {"FORKYARD_REPO": f"s3://{BUCKET}/x", "FORKYARD_S3_ENDPOINT": "http://127.0.0.1:1",
                                       "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                                       "FORKYARD_S3_REGION": ""})
    (tmp_path / "data").mkdir()
    with pytest.raises(RuntimeError, match="exited"):
        srv.start()
    assert "FORKYARD_S3_REGION" in srv.log.read_text()


def test_server_refuses_wrong_s3_secret(tmp_path, s3_endpoint):
    """``forkyard serve`` against a real S3 server with a wrong secret exits at startup
    and its log says which setting to fix."""
    srv = S3Server(tmp_path / "data", {"FORKYARD_REPO": f"s3://{BUCKET}/x", "FORKYARD_S3_ENDPOINT": s3_endpoint,
                                       "FORKYARD_S3_REGION": REGION, "AWS_ACCESS_KEY_ID": KEY,
                                       "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    (tmp_path / "data").mkdir()
    with pytest.raises(RuntimeError, match="exited"):
        srv.start()
    log = " ".join(srv.log.read_text().split())  # the console wraps long lines
    assert "check AWS_SECRET_ACCESS_KEY (SignatureDoesNotMatch)" in log, log[-2000:]
    assert "not-the-secret" not in log and "Traceback" not in log


def test_server_pause_resume_and_snapshot_through_s3(base_template, s3_endpoint):
    """The real server on an S3 repository: pause, wipe the node cache, resume (image
    materialized from S3), snapshot, wipe again, create from the snapshot."""
    from e2b import Sandbox

    prefix = uuid.uuid4().hex[:12]
    data = TEST_ROOT / f"server-{SERVER_PREFIX}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    srv = S3Server(data, {"FORKYARD_REPO": f"s3://{BUCKET}/{prefix}", "FORKYARD_S3_ENDPOINT": s3_endpoint,
                          "FORKYARD_S3_REGION": REGION, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                          "FORKYARD_CACHE_BYTES": str(256 * MB),
                          # resume must restore from S3, not unfreeze a kept copy (hot pause)
                          "FORKYARD_HOT_PAUSE_S": "0"})
    srv.start()
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    cache = data / "snapshots" / "cache"
    s3 = s3_client(s3_endpoint)

    def keys(sub: str) -> list[str]:
        return [o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/{sub}").get("Contents", [])]

    try:
        sbx = Sandbox.create("base", timeout=120, **opts)
        sbx.files.write("/home/user/note", "kept in S3")
        assert sbx.pause() is True
        srv.settle()  # the pause answers before its image is committed
        assert len(keys("manifests/")) == 1 and keys("chunks/")
        shutil.rmtree(cache)  # this node forgets everything; the repository is the truth
        same = Sandbox.connect(sbx.sandbox_id, **opts)
        assert same.files.read("/home/user/note") == "kept in S3"
        assert list((cache / "chunks").rglob("*")), "resume did not fetch chunks into the cache"
        info = same.create_snapshot()
        shutil.rmtree(cache)
        child = Sandbox.create(info.snapshot_id, timeout=60, **opts)
        assert child.files.read("/home/user/note") == "kept in S3"
        child.kill()
        Sandbox.delete_snapshot(info.snapshot_id, **opts)
        srv.settle()
        assert keys("manifests/") == []  # the pause image went at resume, the snapshot now
        same.kill()
    finally:
        try:
            if srv.proc and srv.proc.poll() is None:
                srv.kill_all()
        finally:
            srv.stop()
            NetnsNetwork(None, outer_net=SERVER_OUTER_NET, prefix=SERVER_PREFIX).teardown_host()
            shutil.rmtree(data, ignore_errors=True)


def test_pause_survives_an_unreachable_repository(base_template):
    """The S3 repository goes away: pause still answers (the image is staged on local
    disk), its commit fails and is logged, and resume restores from the staged image —
    process and files intact. Killing the sandbox then removes the staged image."""
    from e2b import Sandbox

    s3 = MinIO(KEY, SECRET).start()
    s3.make_bucket(BUCKET)
    url = s3.url
    data = TEST_ROOT / f"server-{SERVER_PREFIX}-down"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    srv = S3Server(data, {"FORKYARD_REPO": f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}", "FORKYARD_S3_ENDPOINT": url,
                          "FORKYARD_S3_REGION": REGION, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET})
    srv.start()
    opts = {"api_key": srv.api_key, "api_url": srv.url, "sandbox_url": srv.url}
    try:
        sbx = Sandbox.create("base", timeout=120, **opts)
        sbx.files.write("/home/user/note", "staged")
        bg = sbx.commands.run("sleep 600", background=True)
        s3.kill()
        assert sbx.pause() is True
        srv.settle(120)
        assert "commit failed" in srv.log.read_text()
        staged = [p.name for p in (data / "snapshots").iterdir() if p.name.startswith(".staging-")]
        assert len(staged) == 1, staged
        same = Sandbox.connect(sbx.sandbox_id, **opts)  # the repository is still down
        assert same.files.read("/home/user/note") == "staged"
        assert bg.pid in [p.pid for p in same.commands.list()]
        assert not [p for p in (data / "snapshots").iterdir() if p.name.startswith(".staging-")]
        assert same.pause() is True
        srv.settle(120)
        same.kill()
        assert not [p for p in (data / "snapshots").iterdir() if p.name.startswith(".staging-")]
    finally:
        try:
            if srv.proc and srv.proc.poll() is None:
                srv.kill_all()
        finally:
            srv.stop()
            s3.stop()
            NetnsNetwork(None, outer_net=SERVER_OUTER_NET, prefix=SERVER_PREFIX).teardown_host()
            shutil.rmtree(data, ignore_errors=True)
