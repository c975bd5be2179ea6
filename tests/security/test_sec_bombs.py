"""Issue 25, item 3: decompression and sparse bombs.

A 1.5 MB import once took the server from 84 MB to 2.39 GB of memory (each layer read
whole and gunzipped in memory), a 1 MB build ``COPY`` upload to 2.07 GB, and a 20 KB
tar holding a 2 GiB sparse file allocated 2 GiB of host disk. Layers and uploads are
now streamed, and what an archive may unpack to is bounded by
``FORKYARD_MAX_UNPACKED_MB`` / ``_FILES`` / ``_FILE_MB`` (413 naming the setting)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import subprocess
import tarfile
import time
import zlib

import httpx
from test_sec_import import _image, _layer


class _Zeros(io.RawIOBase):
    def __init__(self, n: int):
        self.left = n

    def readinto(self, b) -> int:
        k = min(len(b), self.left)
        b[:k] = bytes(k)
        self.left -= k
        return k

    def readable(self) -> bool:
        return True


def _gz_layer_of_zeros(size: int, name: str = "zeros.bin") -> bytes:
    """A gzipped layer holding one ``size``-byte file of zeros (about size/1000 bytes)."""
    out = io.BytesIO()
    z = zlib.compressobj(9, zlib.DEFLATED, 31)

    class _Sink:
        def write(self, data):
            out.write(z.compress(data))
            return len(data)

    with tarfile.open(fileobj=_Sink(), mode="w|") as tf:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mode = size, 0o644
        tf.addfile(ti, io.BufferedReader(_Zeros(size), 1 << 20))
    out.write(z.flush())
    return out.getvalue()


def _sparse_layer(tmp_path, apparent: int) -> bytes:
    """A GNU tar (``-S``) layer holding one sparse file of ``apparent`` bytes (~10 KB)."""
    d = tmp_path / "sparse"
    d.mkdir(exist_ok=True)
    with open(d / "hole", "wb") as f:
        f.write(b"data at the start")
        f.truncate(apparent)
    subprocess.run(["tar", "-cSf", str(tmp_path / "sparse.tar"), "-C", str(d), "hole"], check=True)
    return (tmp_path / "sparse.tar").read_bytes()


class _PeakRss:
    """Peak resident memory of a process while the block runs (its VmHWM reset first)."""

    def __init__(self, pid: int):
        self.pid = pid

    def _rss(self, key: str) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def __enter__(self):
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current RSS
        self.before = self._rss("VmRSS")
        return self

    def __exit__(self, *exc):
        self.growth = self._rss("VmHWM") - self.before


def _allocated(root) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            total += os.lstat(os.path.join(dirpath, f)).st_blocks * 512
    return total


def test_import_streams_layers_and_sparse_files_cost_no_disk(server, tmp_path):
    """1 GiB of gzipped zeros (~1 MB sent) and a 2 GiB sparse file (~10 KB sent) import
    with the server's memory barely moving, and the rootfs holds what they contain,
    not their apparent size."""
    image = _image([_gz_layer_of_zeros(1 << 30), _sparse_layer(tmp_path, 2 << 30)])
    assert len(image) < 4 << 20
    name = "bomb-" + secrets.token_hex(4)
    try:
        with _PeakRss(server.proc.pid) as peak, server.api() as c:
            r = c.post("/templates/import", params={"name": name}, content=image, timeout=300)
        assert r.status_code == 201, r.text
        print(f"import of {len(image)} bytes: server memory +{peak.growth >> 20} MiB")
        assert peak.growth < 200 << 20, f"server memory grew by {peak.growth >> 20} MiB"
        root = server.templates_dir / name / "rootfs"
        assert (root / "zeros.bin").stat().st_size == 1 << 30
        assert (root / "hole").stat().st_size == 2 << 30
        assert _allocated(root) < 64 << 20, _allocated(root)
    finally:
        with server.api() as c:
            c.delete(f"/templates/{name}")


def _pax_bomb() -> bytes:
    """A layer whose one PAX header is 64 MiB (tarfile reads headers whole)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("f")
        ti.pax_headers = {"comment": "x" * (64 << 20)}
        tf.addfile(ti, io.BytesIO(b""))
    return _gzip(buf.getvalue())


def _gzip(data: bytes) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    return z.compress(data) + z.flush()


LIMITS = {"FORKYARD_MAX_UNPACKED_MB": "64", "FORKYARD_MAX_UNPACKED_FILES": "1000",
          "FORKYARD_MAX_UNPACKED_FILE_MB": "16"}


def _upload_url(server, c) -> tuple[str, str]:
    """A template build's signed COPY upload URL (and the files hash it is for)."""
    r = c.post("/v3/templates", json={"name": "bombs-" + secrets.token_hex(3)})
    assert r.status_code == 202, r.text
    files_hash = hashlib.sha256(secrets.token_bytes(8)).hexdigest()
    r = c.get(f"/templates/{r.json()['templateID']}/files/{files_hash}")
    assert r.status_code == 201, r.text
    return r.json()["url"], files_hash


def test_limits_refuse_imports_and_uploads_with_413_naming_the_setting(server, tmp_path):
    many = _layer([(f"f{i}", "file", b"", 0o644) for i in range(1500)])
    big = [_gz_layer_of_zeros(15 << 20, f"z{i}") for i in range(5)]  # 75 MiB, no file over 16
    cases = [
        ([_gz_layer_of_zeros(32 << 20)], "FORKYARD_MAX_UNPACKED_FILE_MB"),
        ([_sparse_layer(tmp_path, 2 << 30)], "FORKYARD_MAX_UNPACKED_FILE_MB"),
        (big, "FORKYARD_MAX_UNPACKED_MB"),  # the layers of an image count together
        ([many], "FORKYARD_MAX_UNPACKED_FILES"),
    ]
    with server.restarted_with(**LIMITS), server.api() as c:
        for layers, setting in cases:
            name = "lim-" + secrets.token_hex(4)
            r = c.post("/templates/import", params={"name": name}, content=_image(layers), timeout=120)
            assert r.status_code == 413 and setting in r.json()["message"], (setting, r.status_code, r.text)
            assert not (server.templates_dir / name).exists()
        r = c.post("/templates/import", params={"name": "lim-pax"}, content=_image([_pax_bomb()]), timeout=120)
        assert r.status_code == 400 and "extended tar header" in r.text, (r.status_code, r.text)
        # A COPY upload is checked the same way before it is kept.
        for body, setting in ((_gz_layer_of_zeros(32 << 20), "FORKYARD_MAX_UNPACKED_FILE_MB"),
                              (_sparse_layer(tmp_path, 2 << 30), "FORKYARD_MAX_UNPACKED_FILE_MB"),
                              (_gzip(many), "FORKYARD_MAX_UNPACKED_FILES")):
            url, files_hash = _upload_url(server, c)
            r = httpx.put(url, content=body, timeout=120)
            assert r.status_code == 413 and setting in r.json()["message"], (setting, r.status_code, r.text)
            assert not (server.data_dir / "template-files" / f"{files_hash}.tar").exists()


def test_build_copy_streams_the_upload(server):
    """A COPY of 300 MiB of gzipped zeros (~300 KB uploaded): the server streams it into
    the build sandbox instead of gunzipping it in memory."""
    with server.api() as c:
        r = c.post("/v3/templates", json={"name": "copybomb-" + secrets.token_hex(3)})
        tid, bid = r.json()["templateID"], r.json()["buildID"]
        layer = _gz_layer_of_zeros(300 << 20, "big.bin")
        files_hash = hashlib.sha256(layer).hexdigest()
        url = c.get(f"/templates/{tid}/files/{files_hash}").json()["url"]
        assert httpx.put(url, content=layer, timeout=120).status_code == 201
        steps = [{"type": "COPY", "args": ["big.bin", "/opt/big.bin"], "filesHash": files_hash},
                 {"type": "RUN", "args": ["test $(stat -c %s /opt/big.bin) = 314572800 && exit 7", "root"]}]
        with _PeakRss(server.proc.pid) as peak:
            assert c.post(f"/v2/templates/{tid}/builds/{bid}", json={"steps": steps}).status_code == 202
            deadline = time.time() + 240
            while time.time() < deadline:
                st = c.get(f"/templates/{tid}/builds/{bid}/status").json()
                if st["status"] in ("ready", "error"):
                    break
                time.sleep(1)
        # The RUN step saw the whole file, then failed on purpose (no snapshot to make).
        assert st["status"] == "error" and "exit code 7" in json.dumps(st), st
        print(f"COPY of 300 MiB ({len(layer)} bytes uploaded): server memory +{peak.growth >> 20} MiB")
        assert peak.growth < 150 << 20, f"server memory grew by {peak.growth >> 20} MiB"
        c.delete(f"/templates/{tid}")
