"""Issue 11 item 6: a sandbox cannot be taken over through the public proxy.

Tried as an attacker who knows a sandbox id but holds neither the API key nor the
sandbox's envd token."""

from __future__ import annotations

import httpx
from e2b import Sandbox


def _envd(server, sid: str, **headers) -> dict:
    return {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", **headers}


def test_rest_create_without_secure_gets_a_token_and_init_is_unreachable(server):
    with server.api() as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert r.status_code == 201, r.text
        sid, token = r.json()["sandboxID"], r.json().get("envdAccessToken")
    try:
        assert token, "a sandbox created without `secure` must still get an envd access token"
        # Without the token: no files, no commands.
        r = httpx.get(f"{server.url}/files", params={"path": "/etc/hostname"}, headers=_envd(server, sid))
        assert r.status_code == 401
        # /init in every spelling envd's router accepts: refused by the proxy, with or
        # without a token, so nobody can plant a token or env vars.
        attacker = {"accessToken": "attacker-token", "envVars": {"PWNED": "1"}}
        for path in ("/init", "//init", "/./init", "/%69nit", "/x/../init", "/INIT", "/init/"):
            for hdrs in (_envd(server, sid), _envd(server, sid, **{"X-Access-Token": token})):
                r = httpx.post(f"{server.url}{path}", json=attacker, headers=hdrs)
                assert r.status_code == 403, (path, r.status_code, r.text)
                assert r.json()["code"] == 403
        # Host-form routing is refused the same way.
        r = httpx.post(f"{server.url}/init", json=attacker, headers={"Host": f"49983-{sid}.localhost"})
        assert r.status_code == 403
        # The owner is not locked out: the SDK works with the original token.
        sbx = Sandbox.connect(sid)
        out = sbx.commands.run("echo ${PWNED:-clean}")
        assert out.stdout.strip() == "clean"
        with server.api() as c:
            assert c.get(f"/sandboxes/{sid}/metrics").status_code == 200
        # A user port other than envd's is not affected by the /init rule (nothing
        # listens there: 502, not 403).
        r = httpx.post(f"{server.url}/init", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"})
        assert r.status_code == 502
    finally:
        with server.api() as c:
            c.delete(f"/sandboxes/{sid}")


def test_explicit_secure_false_is_open(server):
    """``secure: false`` is the one way to get an open envd (old clients)."""
    with server.api() as c:
        r = c.post("/sandboxes", json={"templateID": "base", "timeout": 60, "secure": False})
        assert r.status_code == 201
        sid = r.json()["sandboxID"]
        assert "envdAccessToken" not in r.json()
        try:
            r = httpx.get(f"{server.url}/files", params={"path": "/etc/hostname", "username": "user"},
                          headers=_envd(server, sid))
            assert r.status_code == 200
            # Still no /init for the public, even on an open sandbox.
            assert httpx.post(f"{server.url}/init", json={"accessToken": "x"},
                              headers=_envd(server, sid)).status_code == 403
        finally:
            c.delete(f"/sandboxes/{sid}")


def test_other_local_users_cannot_reach_sandboxes_directly(server):
    """A local user other than root cannot open connections to a sandbox's outer address
    (envd, user ports) around the proxy's tokens — a pooled sandbox, whose envd has no
    token yet, included. Root (the server) still can."""
    import sqlite3
    import subprocess

    from conftest import NET_PREFIX, OUTER_NET
    from forkyard.network.slots import NetnsNetwork

    sbx = Sandbox.create("base", timeout=120)
    try:
        with sqlite3.connect(server.data_dir / "state.db") as db:
            slot = db.execute("SELECT slot FROM sandboxes WHERE id = ?", (sbx.sandbox_id,)).fetchone()[0]
        _, outer_ip = NetnsNetwork(None, outer_net=OUTER_NET, prefix=NET_PREFIX).addresses(slot)
        url = f"http://{outer_ip}:49983/health"
        as_root = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5", url],
                                 capture_output=True, text=True)
        assert as_root.stdout == "204", as_root  # envd answers root: the address is right
        as_nobody = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                    "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-m", "5", url],
                                   capture_output=True, text=True)
        assert as_nobody.stdout == "000" and as_nobody.returncode != 0, as_nobody
    finally:
        sbx.kill()
