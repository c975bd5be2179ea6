"""Issue 25 item 4: a network policy changed while a sandbox is hot-paused holds after its
unfreeze, in both directions (a new deny closes, a lifted deny opens).

Attack as filed: ``PUT /sandboxes/{id}/network`` answered 204 while the sandbox was
hot-paused, and after the unfreeze the old rules still held. Uses test_egress's servers
(two "public" HTTP servers in their own netns, and a forkyard server allowed to reach them).
The resumes here must be unfreezes (``thaw`` in Server-Timing), else the test would not test
the hot path; the cold path is test_egress's pause/resume.
"""

from __future__ import annotations

from test_egress import SRV_A, SRV_B, _reach, egress_server, public_server  # noqa: F401 (fixtures)


def _hot_cycle(srv, sandbox_id: str, policy: dict) -> None:
    """Pause ``sandbox_id`` (kept hot), set ``policy`` while it is paused, resume it by an
    unfreeze."""
    with srv.api() as c:
        r = c.post(f"/sandboxes/{sandbox_id}/pause")
        assert r.status_code == 204 and "freeze;" in r.headers.get("server-timing", ""), r.headers
        r = c.put(f"/sandboxes/{sandbox_id}/network", json=policy)
        assert r.status_code == 204, r.text
        r = c.post(f"/sandboxes/{sandbox_id}/connect", json={"timeout": 120})
        assert r.status_code == 201, r.text
        timing = r.headers.get("server-timing", "")
        assert "thaw;" in timing and "restore;" not in timing, timing


def test_policy_set_while_hot_paused_holds_after_unfreeze(egress_server):
    from e2b import Sandbox

    sbx = Sandbox.create("base", timeout=120)
    try:
        assert _reach(sbx, SRV_A) and _reach(sbx, SRV_B)
        _hot_cycle(egress_server, sbx.sandbox_id, {"denyOut": [SRV_A]})
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert not _reach(sbx, SRV_A), "a deny set while hot-paused did not hold after the unfreeze"
        assert _reach(sbx, SRV_B)
        _hot_cycle(egress_server, sbx.sandbox_id, {})
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert _reach(sbx, SRV_A), "a deny lifted while hot-paused still held after the unfreeze"
    finally:
        Sandbox.kill(sbx.sandbox_id)
