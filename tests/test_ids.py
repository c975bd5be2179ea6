"""forkyard.ids: the one definition of sandbox ids, names and RFC 3339 text (issue 20).
Pure functions: no server."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from forkyard import ids

PACKAGE = Path(__file__).resolve().parent.parent / "forkyard"


def test_sandbox_ids_and_names():
    assert ids.is_sandbox_id("a" * 64) and ids.is_sandbox_id("0")
    for bad in ("", "a" * 65, "A1", "a-b", "a_b", "../x", "a\n", None, 7):
        assert not ids.is_sandbox_id(bad), bad
    assert ids.is_name("base") and ids.is_name("my-snap_1") and ids.is_name("0" + "x" * 63)
    # A trailing newline slipped through the old `re.match(r"^…$")` checks; not any more.
    for bad in ("", "-base", "_x", "Base", "a" * 65, "a/b", "a.b", "base\n", None):
        assert not ids.is_name(bad), bad
    made = {ids.new_sandbox_id() for _ in range(50)} | {ids.new_snapshot_id() for _ in range(50)}
    assert len(made) == 100 and all(len(i) == 20 and ids.is_sandbox_id(i) and ids.is_name(i) for i in made)


def test_rfc3339_is_what_each_copy_wrote():
    for ts in (0.0, 1764620043.0, 1764620043.25, 1764620043.123456):
        dt = datetime.fromtimestamp(ts, timezone.utc)
        assert ids.rfc3339(ts) == dt.isoformat().replace("+00:00", "Z")
        assert ids.rfc3339(ts, "milliseconds") == dt.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        assert ids.rfc3339(ts, "seconds") == dt.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert ids.rfc3339(1764620043.25) == "2025-12-01T20:14:03.250000Z"


def test_no_other_module_writes_the_id_or_name_pattern_again():
    """The patterns live in forkyard/ids.py only: a module that compiles its own copy
    (the ten copies this replaced) fails here."""
    copies = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "ids.py" and path.parent == PACKAGE:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "re.compile(" in line and ("[a-z0-9]{1,64}" in line or "[a-z0-9][a-z0-9_-]" in line):
                copies.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not copies, "use forkyard.ids instead:\n" + "\n".join(copies)


def test_a_sandboxs_own_started_at_selects_it_in_a_list():
    """``Sandbox.list(query=SandboxQuery(started_after=info.started_at))`` with the exact
    ``startedAt`` the API showed includes that sandbox, and ``startedBefore`` likewise
    (issue 23 item 3): Python rounds a timestamp to the nearest microsecond, so the text
    can lie after the stored float; compared as floats, 38 % of start times failed."""
    from fastapi import Response

    from forkyard.api.routes_sandboxes import list_page
    from forkyard.orchestrator.store import SandboxRecord

    # .1234567 is shown as .123457: after the float (the case that failed) ...
    for started in (1764620043.1234567, 1764620043.1234562, 1764620043.0):
        rec = SandboxRecord(id="s1", template_id="base", state="running", slot=None, vcpus=1, memory_mb=512,
                            started_at=started, end_at=started + 300, auto_pause=False)
        shown = ids.rfc3339(started)
        # ... passed back as the SDK does: parsed to a datetime, sent as isoformat().
        sent = datetime.fromisoformat(shown.replace("Z", "+00:00")).astimezone().isoformat()
        for bound in ("started_after", "started_before"):
            page = list_page([rec], Response(), None, None, None, None, None, 100, **{bound: sent})
            assert [r["sandboxID"] for r in page] == ["s1"], (started, shown, bound)
        later = ids.rfc3339(started + 0.000002)
        assert list_page([rec], Response(), None, None, None, None, None, 100, started_after=later) == []
        assert ids.micros(started) == ids.micros_of(datetime.fromisoformat(shown.replace("Z", "+00:00")))
