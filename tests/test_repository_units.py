"""Fast tests of the repository's node cache (LRU order, byte bound, pins, restart) and
chunk format (cut sizes, names, compression, verification) on real files — no runsc.
They are what the mutation run (see the report of issue 13) exercises on every mutant."""

from __future__ import annotations

import os
import time

import pytest

from forkyard.repository import ChunkCorrupt
from forkyard.repository.cache import NodeCache
from forkyard.repository.chunks import (MAX_SIZE, MIN_SIZE, MappedFile, chunk_key, chunk_view, compress, cut,
                                        decode, digest)

H = [f"{i:02x}" + "a" * 62 for i in range(8)]


def _image(cache: NodeCache, name: str, size: int):
    d = cache.new_image_dir()
    (d / "pages.img").write_bytes(b"p" * size)
    return d


def test_lru_order_evicts_least_recently_used_first(tmp_path):
    c = NodeCache(tmp_path, limit_bytes=300)
    for h in H[:3]:
        c.put_chunk(h, b"x" * 100)
    assert c.used_bytes == 300
    assert c.get_chunk(H[0]) == b"x" * 100  # H0 is now the most recent; H1 the least
    c.put_chunk(H[3], b"y" * 100)
    assert c.get_chunk(H[1]) is None and c.get_chunk(H[0]) is not None
    assert c.get_chunk(H[2]) is not None and c.get_chunk(H[3]) == b"y" * 100
    assert c.counters["evictions"] == 1 and c.counters["evicted_bytes"] == 100
    assert not (tmp_path / "chunks" / H[1][:2] / H[1]).exists()  # evicted from disk too
    assert c.used_bytes == 300 <= c.limit_bytes


def test_bound_holds_and_oversized_entries_are_skipped(tmp_path):
    c = NodeCache(tmp_path, limit_bytes=250)
    c.put_chunk(H[0], b"a" * 300)  # larger than the whole bound: not kept
    assert c.get_chunk(H[0]) is None and c.used_bytes == 0
    for h in H[1:6]:
        c.put_chunk(h, b"b" * 100)
        assert c.used_bytes <= 250
    assert c.used_bytes == 200
    c.put_chunk(H[5], b"b" * 100)  # already there: no double count
    assert c.used_bytes == 200
    assert c.counters["chunk_misses"] == 1
    with pytest.raises(ValueError):
        NodeCache(tmp_path / "z", limit_bytes=0)


def test_pinned_image_survives_eviction_until_pin_expires(tmp_path):
    c = NodeCache(tmp_path, limit_bytes=1000)
    a = c.add_image("snapA", _image(c, "a", 600), pin_s=0.5)
    assert (a / "pages.img").stat().st_size == 600
    c.add_image("snapB", _image(c, "b", 600))  # would need A's room, but A is pinned
    assert c.get_image("snapA") is not None
    c.drop_image("snapA")  # pinned: left alone
    assert c.image_dir("snapA").is_dir()
    time.sleep(0.6)
    c.put_chunk(H[0], b"c" * 300)  # over the bound: the unpinned LRU entries go
    assert c.get_image("snapA") is None or c.get_image("snapB") is None
    assert c.used_bytes <= 1000
    c.drop_image("snapB", force=True)
    assert not c.image_dir("snapB").exists()
    assert c.counters["image_hits"] >= 1 and c.counters["image_misses"] >= 1


def test_restart_rebuilds_index_oldest_first_and_drops_temp_files(tmp_path):
    c = NodeCache(tmp_path, limit_bytes=10_000)
    for i, h in enumerate(H[:3]):
        c.put_chunk(h, b"z" * 100)
        p = tmp_path / "chunks" / h[:2] / h
        os.utime(p, (1000 + i, 1000 + i))  # H0 oldest
    (tmp_path / "chunks" / H[0][:2] / ".tmp-leftover").write_bytes(b"junk")
    (tmp_path / "images" / ".tmp-half").mkdir()
    again = NodeCache(tmp_path, limit_bytes=250)  # smaller bound: the oldest goes
    assert again.used_bytes == 200
    assert again.get_chunk(H[0]) is None and again.get_chunk(H[2]) is not None
    assert not (tmp_path / "chunks" / H[0][:2] / ".tmp-leftover").exists()
    assert not (tmp_path / "images" / ".tmp-half").exists()


def test_chunks_cut_within_bounds_named_by_content_and_verified():
    data = os.urandom(3 * MAX_SIZE) + b"\0" * MAX_SIZE
    cuts = cut(data)
    assert cuts[0][0] == 0 and sum(n for _, n in cuts) == len(data)
    assert all(cuts[i][0] + cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
    assert all(MIN_SIZE <= n <= MAX_SIZE for _, n in cuts[:-1]) and cuts[-1][1] <= MAX_SIZE
    refs = chunk_view(memoryview(data))
    assert [r.length for r in refs] == [n for _, n in cuts]
    first = data[: cuts[0][1]]
    assert refs[0].hash == digest(first) and len(refs[0].hash) == 64
    assert chunk_key(refs[0].hash) == f"chunks/{refs[0].hash[:2]}/{refs[0].hash}"
    blob = compress(first)
    assert decode(refs[0].hash, blob, len(first)) == first
    with pytest.raises(ChunkCorrupt):
        decode(refs[0].hash, compress(first + b"!"))  # other content, valid frame
    with pytest.raises(ChunkCorrupt):
        decode(refs[0].hash, blob[:-3])  # truncated frame
    with pytest.raises(ChunkCorrupt):
        decode(refs[0].hash, blob, len(first) + 1)  # wrong length


def test_pins_unpin_stats_wipe_and_mru_listing(tmp_path):
    """Surviving mutants of the first mutation run: pin()/unpin(), get_image's pin,
    exact counters, stats(), image_ids() order and wipe()."""
    c = NodeCache(tmp_path, limit_bytes=1000)
    assert c.stats() == {"chunk_hits": 0, "chunk_misses": 0, "image_hits": 0, "image_misses": 0, "evictions": 0,
                         "evicted_bytes": 0, "limit_bytes": 1000, "used_bytes": 0, "entries": 0, "images": 0}
    c.add_image("a", _image(c, "a", 400))
    c.add_image("b", _image(c, "b", 400))
    c.put_chunk(H[0], b"q" * 10)
    assert c.image_ids() == ["b", "a"] and c.image_ids(limit=1) == ["b"]
    assert c.get_image("a", pin_s=60) is not None  # pinned for a minute, now most recent
    assert c.image_ids() == ["a", "b"]
    c.pin("b", 0)  # no-op
    c.add_image("c", _image(c, "c", 400))  # needs room: b (unpinned) goes, a stays
    assert c.image_dir("a").is_dir() and not c.image_dir("b").exists()
    c.pin("c", 60)
    c.pin("c", 60)
    c.unpin("c")  # one pin left
    c.drop_image("c")
    assert c.image_dir("c").is_dir()
    c.unpin("c")
    c.unpin("c")  # none left: no-op
    c.drop_image("c")
    assert not c.image_dir("c").exists()
    st = c.stats()
    assert st["images"] == 1 and st["entries"] == 2 and st["used_bytes"] == 410 == c.used_bytes
    assert st["image_hits"] == 1 and st["image_misses"] == 0 and st["evictions"] == 1
    c.wipe()
    assert c.used_bytes == 0 and c.stats()["entries"] == 0
    assert (tmp_path / "chunks").is_dir() and (tmp_path / "images").is_dir()
    assert not any((tmp_path / "images").iterdir()) and not any((tmp_path / "chunks").iterdir())


def test_every_chunk_is_named_by_its_own_bytes_and_mapped_files_are_whole(tmp_path):
    data = os.urandom(5 * MAX_SIZE)
    refs = chunk_view(memoryview(data))
    assert len(refs) > 2
    assert all(r.hash == digest(data[r.offset:r.offset + r.length]) for r in refs)
    f = tmp_path / "pages.img"
    f.write_bytes(data)
    with MappedFile(f) as m:
        assert m.view.nbytes == len(data) and bytes(m.view[-10:]) == data[-10:]
        assert [(r.offset, r.length) for r in chunk_view(m.view)] == [(r.offset, r.length) for r in refs]
    (tmp_path / "empty").write_bytes(b"")
    with MappedFile(tmp_path / "empty") as m:
        assert m.view.nbytes == 0 and cut(m.view) == []


def test_get_image_pin_expires(tmp_path):
    c = NodeCache(tmp_path, limit_bytes=500)
    c.add_image("a", _image(c, "a", 400))
    assert c.get_image("a", pin_s=0.3) is not None
    c.drop_image("a")
    assert c.image_dir("a").is_dir()  # pinned
    time.sleep(0.4)
    c.drop_image("a")
    assert not c.image_dir("a").exists()  # the pin ran out


@pytest.mark.parametrize("path, chunk", [
    ("/etc/shadow", "a" * 64), ("../../x", "a" * 64), ("pages/../../x", "a" * 64), ("a//b", "a" * 64),
    ("./pages.img", "a" * 64), ("", "a" * 64), ("a\0b", "a" * 64), ("pages.img", "../" * 20 + "etc/passwd"),
    ("pages.img", "A" * 64), ("pages.img", "a" * 63),
])
def test_a_manifest_whose_paths_leave_the_image_is_refused(path, chunk):
    """A manifest comes from the shared repository: a path that leaves the image
    directory (a restore writes there, a P2P peer reads there) or a hash that is not a
    content address (it names a backend object) makes it malformed — found by the attack
    review of P2P: a forged manifest wrote files as root on the restoring node."""
    from forkyard.repository import RepositoryError
    from forkyard.repository.repo import FileEntry, Manifest

    good = Manifest("snap1", {}, [FileEntry("pages.img", 4, 0o600, (("a" * 64, 4),))], {})
    assert Manifest.from_json(good.to_json()).files == good.files
    bad = Manifest("snap1", {}, [FileEntry(path, 4, 0o600, ((chunk, 4),))], {})
    with pytest.raises(RepositoryError, match="malformed manifest"):
        Manifest.from_json(bad.to_json())
