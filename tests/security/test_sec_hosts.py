"""Issue 25, item 7: a sandbox's host routes only to the sandbox; loopback is no
credential once a proxy relayed the request.

``https://8000-ID.DOMAIN/console`` served forkyard's console on a sandbox's origin (its
login call then went into the sandbox, which logged the API key sent with it), and
``/metrics`` answered there too; a TLS terminator on the same host made every scrape a
loopback one."""

from __future__ import annotations

from _wire import request as _raw


def test_console_and_metrics_are_not_served_on_sandbox_hosts(server, sandbox):
    sid = sandbox.sandbox_id
    port = server.url.rsplit(":", 1)[1]
    for path in ("/console", "/console/", "/console/console.js", "/metrics"):
        for headers in ({"Host": f"8000-{sid}.localhost:{port}"}, {"Host": f"49983-{sid}.localhost:{port}"},
                        {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "8000"}):
            status, data = _raw(server.url, "GET", path, headers)
            low = data.lower()
            assert b"forkyard" not in low and b"<html" not in low and b"# help" not in low, (path, headers, data[:300])
            assert status in (401, 404, 502), (path, headers, status, data[:300])
    # On the API host both are still there.
    status, data = _raw(server.url, "GET", "/console")
    assert status == 200 and b"<html" in data.lower()
    status, data = _raw(server.url, "GET", "/metrics")
    assert status == 200 and b"# HELP" in data


def test_loopback_scrape_needs_a_token_once_a_proxy_relayed_it(server):
    for header in ("X-Forwarded-For: 203.0.113.9", "Forwarded: for=203.0.113.9;proto=https",
                   "X-Real-IP: 203.0.113.9", "Via: 1.1 terminator", "X-Forwarded-Proto: https"):
        name, value = header.split(": ", 1)
        status, data = _raw(server.url, "GET", "/metrics", {name: value})
        assert status == 401, (header, status, data[:200])
        status, _ = _raw(server.url, "GET", "/metrics", {name: value, "Authorization": f"Bearer {server.api_key}"})
        assert status == 200, header
