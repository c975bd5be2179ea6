"""A commit whose chunk upload fails part-way reports that failure — a clean
RepositoryError, nothing committed — even while other uploads are still in flight
(regression: the image's mappings were closed under them and the commit died with
``BufferError: cannot close exported pointers exist`` instead)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from forkyard.repository.backends import PosixBackend
from forkyard.repository.errors import RepositoryError
from forkyard.repository.repo import Repository, manifest_key


class FlakyDisk(PosixBackend):
    """A real directory backend whose 2nd chunk write fails at once while the others
    are still writing (slowly)."""

    def __init__(self, root):
        super().__init__(root)
        self.writes = 0
        self.lock = threading.Lock()

    def put(self, key: str, data: bytes, exclusive: bool = False) -> bool:
        if key.startswith("chunks/"):
            with self.lock:
                self.writes += 1
                n = self.writes
            if n == 2:
                raise RepositoryError("disk full (injected)")
            time.sleep(0.3)
        return super().put(key, data, exclusive)


def test_failed_upload_with_others_in_flight_is_a_clean_repository_error(tmp_path):
    image = tmp_path / "image"
    image.mkdir()
    (image / "pages.img").write_bytes(os.urandom(8 << 20))  # many chunks
    backend = FlakyDisk(tmp_path / "repo")
    repo = Repository(backend, workers=8)
    try:
        with pytest.raises(RepositoryError, match="injected"):
            repo.commit("s1", image, {"kind": "pause"})
        assert not backend.exists(manifest_key("s1"))
    finally:
        repo.pool.shutdown(wait=True)


def test_failed_upload_while_others_still_compress(tmp_path, monkeypatch):
    """Same, with the other uploads still reading the image (compressing) when the
    failure surfaces: the image's mappings must outlive every upload."""
    from forkyard.repository import chunks as ck

    real = ck.compress

    def slow_compress(raw):
        time.sleep(0.2)
        return real(raw)

    monkeypatch.setattr(ck, "compress", slow_compress)
    image = tmp_path / "image"
    image.mkdir()
    (image / "pages.img").write_bytes(os.urandom(8 << 20))
    backend = FlakyDisk(tmp_path / "repo")
    repo = Repository(backend, workers=8)
    try:
        with pytest.raises(RepositoryError, match="injected"):
            repo.commit("s2", image, {"kind": "pause"})
        assert not backend.exists(manifest_key("s2"))
    finally:
        repo.pool.shutdown(wait=True)
