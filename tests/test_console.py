"""The web console at ``/console`` in a real headless browser: Playwright (PyPI) driving
Debian's ``chromium`` (deploy/test.sh installs it; Playwright's own browser downloads are
unreachable, so ``executable_path`` points at the system one), against a real node with
real gVisor sandboxes. A screenshot of the fork tree goes to ``.ci/artifacts/``."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest

ARTIFACTS = Path(__file__).resolve().parent.parent / ".ci" / "artifacts"


@pytest.fixture
def browser_page():
    """A fresh page in headless chromium (``--no-sandbox``: tests run as root)."""
    from playwright.sync_api import sync_playwright

    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed; deploy/test.sh installs it (apt-get install chromium)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        try:
            ctx = browser.new_context(viewport={"width": 1400, "height": 900})
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.errors = errors
            page.dialogs = []  # messages of the confirmations shown
            page.accept_dialogs = True

            def on_dialog(d):
                page.dialogs.append(d.message)
                d.accept() if page.accept_dialogs else d.dismiss()

            page.on("dialog", on_dialog)  # the console confirms every action
            yield page
        finally:
            browser.close()


def test_console_files_and_headers(server):
    """``/console`` serves the page without a key, with a strict CSP; unknown files 404."""
    r = httpx.get(f"{server.url}/console", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert httpx.get(f"{server.url}/console/console.js", timeout=10).status_code == 200
    missing = httpx.get(f"{server.url}/console/state.db", timeout=10)
    assert missing.status_code == 404 and missing.json()["code"] == 404
    assert httpx.post(f"{server.url}/console", timeout=10).status_code == 405
    # the console's snapshot data needs the key like every other route
    assert httpx.get(f"{server.url}/metrics/snapshots", timeout=10).status_code == 401


def test_console_sign_in_fork_tree_and_kill(server, browser_page):
    """Sign in with the API key, see a sandbox appear (template, metadata, usage), fork
    it from the console, see the tree grow by a child under it, snapshot it and see the
    snapshot with its chunks, kill the child, pause and resume the parent, then kill it —
    every action from the console (each confirmed in a dialog)."""
    from e2b import Sandbox

    page = browser_page
    page.goto(f"{server.url}/console")
    page.wait_for_selector("body[data-ready]")
    page.fill("#api-key", "e2b_wrong")
    page.click("#sign-in")
    page.wait_for_selector("#signin-error:has-text('refused')")

    page.fill("#api-key", server.api_key)
    page.click("#sign-in")
    page.wait_for_selector("#main-view:not([hidden])")
    assert server.api_key not in page.url
    assert page.evaluate("sessionStorage.getItem('forkyard.apiKey')") == server.api_key
    assert page.evaluate("localStorage.length") == 0

    sbx = Sandbox.create("base", timeout=300, metadata={"team": "console-test", "note": "<b>not bold</b>"})
    child_id = None
    try:
        root = f"li[data-sandbox-id='{sbx.sandbox_id}']"
        page.wait_for_selector(root, timeout=30_000)
        card = page.locator(f"{root} > .card")
        assert "base" in card.inner_text() and "team=console-test" in card.inner_text()
        assert "note=<b>not bold</b>" in card.inner_text() and card.locator("b").count() == 0  # text, never HTML
        page.wait_for_selector(f"{root} > .card .usage:has-text('cpu')", timeout=30_000)  # live CPU/memory
        assert page.locator("#nodes tbody tr").count() == 1

        page.accept_dialogs = False  # a dismissed confirmation does nothing
        page.click(f"{root} > .card .act-kill")
        page.wait_for_timeout(1500)
        assert page.locator(root).count() == 1 and page.dialogs == [f"Kill {sbx.sandbox_id}? This cannot be undone."]
        page.accept_dialogs = True

        page.click(f"{root} > .card .act-fork")
        child = page.wait_for_selector(f"{root} > ul > li.sandbox", timeout=120_000)
        child_id = child.get_attribute("data-sandbox-id")
        assert child_id and child_id != sbx.sandbox_id
        assert "forked" in page.locator(f"li[data-sandbox-id='{child_id}'] > .card").inner_text()

        page.click(f"{root} > .card .act-snapshot")
        snap_row = page.wait_for_selector(f"#snapshots tbody tr:has-text('{sbx.sandbox_id}')", timeout=120_000)
        cells = snap_row.query_selector_all("td")
        assert cells[1].inner_text() == "snapshot" and int(cells[5].inner_text()) > 0

        page.click("#templates tbody tr[data-template-id='base'] .act-logs")
        page.wait_for_selector("#build-log:not([hidden]):has-text('base')")

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "console-fork-tree.png"), full_page=True)

        page.click(f"li[data-sandbox-id='{child_id}'] > .card .act-kill")
        page.wait_for_selector(f"li[data-sandbox-id='{child_id}']", state="detached", timeout=60_000)
        page.click(f"{root} > .card .act-pause")
        page.wait_for_selector(f"{root} > .card .badge:has-text('paused')", timeout=120_000)
        page.click(f"{root} > .card .act-resume")
        page.wait_for_selector(f"{root} > .card .badge:has-text('running')", timeout=120_000)
        assert sbx.commands.run("echo back").stdout.strip() == "back"

        page.click(f"{root} > .card .act-kill")
        page.wait_for_selector(root, state="detached", timeout=60_000)
        with server.api() as c:
            assert c.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
            assert c.get(f"/sandboxes/{child_id}").status_code == 404
        assert len(page.dialogs) == 7, page.dialogs  # every action asked first
        assert not page.errors, page.errors
    finally:
        for sid in (sbx.sandbox_id, child_id):
            if sid:
                with server.api() as c:
                    c.delete(f"/sandboxes/{sid}")


def test_console_on_gateway(base_template, browser_page):
    """Through a cluster's gateway: the node table lists the cluster's nodes with their
    capacity, and a sandbox created through the gateway appears in the tree."""
    import os

    from _cluster import Cluster
    from conftest import TEST_ROOT
    from e2b import Sandbox
    from test_cluster import assert_clean

    c = Cluster(TEST_ROOT / f"cluster-console-{os.getpid()}", nodes=1)
    try:
        c.start()
        page = browser_page
        page.goto(f"{c.gateway_url}/console")
        page.wait_for_selector("body[data-ready]")
        page.fill("#api-key", c.api_key)
        page.click("#sign-in")
        try:
            row = page.wait_for_selector("#nodes tbody tr[data-node-id='node0']", timeout=60_000)
        except Exception as e:
            raise AssertionError(f"no node0 row; console status: {page.inner_text('#status')!r}; "
                                 f"nodes: {page.inner_text('#nodes')!r}") from e
        assert "up" in row.inner_text() and "/ 40" in row.inner_text()  # running / max sandboxes
        sbx = Sandbox.create("base", timeout=120, **c.sdk)
        try:
            page.wait_for_selector(f"li[data-sandbox-id='{sbx.sandbox_id}'] .usage:has-text('cpu')", timeout=60_000)
        finally:
            sbx.kill()
        page.wait_for_selector(f"li[data-sandbox-id='{sbx.sandbox_id}']", state="detached", timeout=30_000)
        assert not page.errors, page.errors
    finally:
        c.close()
        assert_clean(c)
