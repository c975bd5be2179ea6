"""Bad input through the proxy and envd: clear errors, nothing on the host touched."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path

import httpx
from conftest import TEST_ROOT


def _envd(server, sandbox) -> httpx.Client:
    with server.api() as c:
        token = c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["envdAccessToken"]
    return httpx.Client(base_url=server.url, timeout=30, headers={
        "E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": token})


def test_paths_cannot_leave_the_sandbox(sandbox):
    name = f"forkyard-escape-{uuid.uuid4().hex}"
    sandbox.files.write(f"/../../../../tmp/{name}", "inside")
    sandbox.files.write(f"../../../../../tmp/{name}-rel", "inside")
    assert not Path(f"/tmp/{name}").exists() and not Path(f"/tmp/{name}-rel").exists()
    assert sandbox.files.read(f"/tmp/{name}") == "inside"
    # The template rootfs on the host is never written either.
    sandbox.commands.run("sudo touch /etc/forkyard-was-here")
    assert sandbox.files.exists("/etc/forkyard-was-here")  # the write happened inside
    host_etc = TEST_ROOT / "templates" / "base" / "rootfs" / "etc"
    assert (host_etc / "passwd").is_file()  # the path below is the template's real rootfs
    assert not (host_etc / "forkyard-was-here").exists()


def test_invalid_utf8_and_missing_paths(server, sandbox):
    with _envd(server, sandbox) as c:
        r = c.get("/files", params={"path": "/home/user/does-not-exist"})
        assert r.status_code == 404
        r = c.get("/files?path=%ff%fe%fd")
        assert 400 <= r.status_code < 500, r.text
        r = c.post("/files?path=/home/user/%ff", content=b"x", headers={"content-type": "application/octet-stream"})
        assert 400 <= r.status_code < 500, r.text
        # envd still answers normally afterwards.
        assert c.get("/health").status_code in (200, 204)


def test_huge_upload_rejected_before_reading(server, sandbox):
    with server.api() as c:
        token = c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["envdAccessToken"]
    head = (
        "POST /files?path=/home/user/huge HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{server.port}\r\n"
        f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\nE2b-Sandbox-Port: 49983\r\nX-Access-Token: {token}\r\n"
        "Content-Type: application/octet-stream\r\n"
        f"Content-Length: {64 << 30}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(head.encode() + b"x" * 1024)
        reply = s.recv(4096).decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413"), reply
    assert not sandbox.files.exists("/home/user/huge")


def test_wrong_access_token(server, sandbox):
    r = httpx.get(f"{server.url}/envs", headers={
        "E2b-Sandbox-Id": sandbox.sandbox_id, "X-Access-Token": "wrong"})
    assert r.status_code == 401


def test_pause_and_snapshot_bodies_from_the_sdk(sandbox, server):
    """SDK pause bodies: ``memory: true`` with ``requireHealthyGuest`` and a healthy
    envd pauses normally; a non-boolean ``memory`` is a 400 naming it (``memory:
    false`` — filesystem-only — is tested in test_fs_pause.py)."""
    sid = sandbox.sandbox_id
    with server.api() as c:
        for path in (f"/sandboxes/{sid}/pause", f"/sandboxes/{sid}/snapshots"):
            r = c.post(path, json={"memory": "maybe"})
            assert r.status_code == 400 and "memory" in r.json()["message"], r.text
        assert sandbox.commands.run("echo up").stdout.strip() == "up"
        r = c.post(f"/sandboxes/{sid}/pause", json={"memory": True, "requireHealthyGuest": True})
        assert r.status_code == 204, r.text
        r = c.post(f"/sandboxes/{sid}/resume", json={"timeout": 60})
        assert r.status_code == 201, r.text


def test_pause_require_healthy_guest_refuses_an_unresponsive_envd(sandbox, server):
    """``requireHealthyGuest: true`` with an envd that does not answer (its sandbox is
    frozen behind the server's back) → 503 and the sandbox is left running."""
    import subprocess

    from conftest import SERVER_DIR
    from forkyard.config import Settings

    runsc = [Settings().runsc, f"--root={SERVER_DIR / 'runsc'}"]
    subprocess.run([*runsc, "pause", sandbox.sandbox_id], check=True, capture_output=True)
    try:
        with server.api() as c:
            r = c.post(f"/sandboxes/{sandbox.sandbox_id}/pause", json={"requireHealthyGuest": True})
            assert r.status_code == 503, r.text
            assert "does not answer" in r.json()["message"]
            assert c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "running"
    finally:
        subprocess.run([*runsc, "resume", sandbox.sandbox_id], check=True, capture_output=True)
    assert sandbox.commands.run("echo up").stdout.strip() == "up"
