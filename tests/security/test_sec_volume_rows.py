"""A volume row (``volume.json``) in the shared volumes directory is data another node
wrote: a compromised node must not steer this node's host paths with it.

Before the fix, ``Volumes._row`` trusted the row's ``id`` field (never checked against
the directory it lies in), and ``data_dir``/``_mount``/``_unmount`` built host paths from
it: ``"id": "../../…"`` made a node loop-mount an image of the attacker's choosing onto
any host directory (and unmount any mount named ``data``). With leases the lease call
did not stop it: httpx removes dot segments, so
``/v1/nodes/B/volumes/<../../…/v1/nodes/B/volumes/q>/lease`` asks for the lease of
``q``. Real filesystem, real ``mount``; no cluster needed to show the host path."""

from __future__ import annotations

import json
import os
import subprocess
import uuid

import httpx
import pytest

from forkyard.orchestrator.errors import NotFound
from forkyard.orchestrator.volumes.store import IMAGE_NAME, NAMES, ROW_NAME, Volumes


def _plant(root, vid: str, row: dict, name: str | None = None) -> None:
    d = root / vid
    d.mkdir(mode=0o700)
    (d / ROW_NAME).write_text(json.dumps(row))
    if name is not None:
        (root / NAMES / name).write_text(vid)


@pytest.fixture
def vols(tmp_path):
    v = Volumes(tmp_path / "shared", tmp_path / "node" / "volumes", max_count=10, size_mb=16)
    yield v, tmp_path
    for line in open("/proc/mounts").read().splitlines():  # a single node mounts what it creates
        target = line.split()[1]
        if target.startswith(str(tmp_path) + "/"):
            subprocess.run(["umount", target], capture_output=True)


def test_row_id_must_be_its_directory(vols):
    v, tmp = vols
    (tmp / "outside").mkdir()
    evil_id = "../" * 32 + str(tmp / "outside").lstrip("/")  # "/.." is "/": enough of them reach /
    # the attacker's image, where root/<evil id>/volume.img resolves
    subprocess.run(["truncate", "-s", "16M", str(tmp / "outside" / IMAGE_NAME)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(tmp / "outside" / IMAGE_NAME)], check=True)
    shared = tmp / "shared"
    _plant(shared, "evil2", {"id": evil_id, "name": "foo", "token": "t" * 43, "size_mb": 16,
                             "created_at": 1.0}, name="foo")
    for lookup in (lambda: v.get("evil2"), lambda: v.by_name("foo")):
        try:
            rec = lookup()
        except NotFound:
            continue
        assert rec.id == "evil2", f"a row's id {rec.id!r} is not the directory it lies in"
        try:
            path = v.ensure_mounted(rec)
        except Exception:  # noqa: BLE001 - any refusal is fine; what matters is below
            path = None
        assert not os.path.ismount(tmp / "outside" / "data"), "a crafted row mounted an image outside the volumes"
        if path is not None:
            assert os.path.realpath(path).startswith(str(tmp / "node" / "volumes") + "/")
    assert all(r.id == "evil2" for r in v.all()) or not v.all()


@pytest.mark.parametrize("row", [
    [1, 2, 3],
    {"id": "evil3"},
    {"id": "evil3", "name": "x", "token": "t", "size_mb": 16, "created_at": "yesterday"},
    {"id": "evil3", "name": "../../etc", "token": "t", "size_mb": 16, "created_at": 1.0},
    {"id": "evil3", "name": "x", "token": 5, "size_mb": 16, "created_at": 1.0},
])
def test_malformed_rows_are_skipped_not_500(vols, row):
    v, tmp = vols
    good = v.create("good")
    _plant(tmp / "shared", "evil3", row)
    assert [r.id for r in v.all()] == [good.id]  # listing works, the bad row is left out
    with pytest.raises(NotFound):
        v.get("evil3")
    assert not v.check_token("evil3", "t")


def test_httpx_removes_dot_segments():
    """Why the scheduler's is_name check on the route did not stop a traversal id."""
    url = httpx.URL("http://s/v1/nodes/B/volumes/" + "../" * 6 + "x/y/../../v1/nodes/B/volumes/q" + "/lease")
    assert url.path == "/v1/nodes/B/volumes/q/lease"


def test_lease_calls_refuse_non_name_ids():
    from forkyard.cluster.volumes import SchedulerLeases
    from forkyard.orchestrator.volumes.store import LeaseUnavailable
    seen = []
    lease = SchedulerLeases("http://127.0.0.1:9", "k", "B", "http://b")
    lease._post = lambda path, body: seen.append(path) or {"granted": True}  # no scheduler needed
    with pytest.raises((LeaseUnavailable, ValueError)):
        lease.acquire("../../v1/nodes/B/volumes/q", "x" + uuid.uuid4().hex[:4])
    assert not seen


@pytest.mark.parametrize("how", ["image-link", "dir-link"])
def test_a_link_in_the_shared_directory_mounts_no_host_file(vols, how):
    """A node loop-mounts ``<root>/<id>/volume.img``: a link there (or at ``<id>``)
    written by another node must not make it mount a host file or disk of its own (and
    bind it into a sandbox, or serve it over the content API)."""
    v, tmp = vols
    out = tmp / "outside"
    out.mkdir()
    subprocess.run(["truncate", "-s", "16M", str(out / IMAGE_NAME)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(out / IMAGE_NAME)], check=True)  # stands for a host disk
    row = {"id": "evil4", "name": "bar", "token": "t" * 43, "size_mb": 16, "created_at": 1.0}
    shared = tmp / "shared"
    if how == "image-link":
        _plant(shared, "evil4", row, name="bar")
        os.symlink(out / IMAGE_NAME, shared / "evil4" / IMAGE_NAME)
    else:
        (out / ROW_NAME).write_text(json.dumps(row))
        os.symlink(out, shared / "evil4")
        (shared / NAMES / "bar").write_text("evil4")
    try:
        rec = v.by_name("bar")
    except NotFound:
        return
    with pytest.raises(Exception):
        v.ensure_mounted(rec)
    assert not os.path.ismount(v.data_dir("evil4"))


@pytest.mark.parametrize("where", ["row", "name"])
def test_a_fifo_in_the_shared_directory_blocks_nothing(vols, where):
    """A FIFO as a row or a name file (another node made it) once blocked the listing,
    every lookup by that name, and (under the store's lock) every volume create."""
    import threading
    v, tmp = vols
    shared = tmp / "shared"
    (shared / "evil5").mkdir()
    if where == "row":
        os.mkfifo(shared / "evil5" / ROW_NAME)
    else:
        os.mkfifo(shared / NAMES / "baz")
    result = {}

    def work():
        result["all"] = [r.id for r in v.all()]
        for lookup in (lambda: v.by_name("baz"), lambda: v.get("evil5")):
            try:
                lookup()
            except NotFound:
                pass
        try:
            v.create("baz")
        except Exception as e:  # noqa: BLE001 - a 409 for a taken name is fine
            result["create"] = type(e).__name__
        result["done"] = True

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(20)
    if not result.get("done"):
        # unblock the reader so the test process can end
        fifo = shared / "evil5" / ROW_NAME if where == "row" else shared / NAMES / "baz"
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"a FIFO as the {where} blocked the volumes store")
    assert result["all"] == []
