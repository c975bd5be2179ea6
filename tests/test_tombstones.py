"""The record of why sandboxes died (forkyard.orchestrator.tombstones): bounded,
expiring, and saying the cause the way clients are told it."""

from __future__ import annotations

import time

from forkyard.orchestrator.tombstones import MAX_LOG_ENTRIES, MAX_MESSAGE_CHARS, Tombstones


def test_a_death_is_told_with_its_cause_and_time():
    t = Tombstones()
    tomb = t.add("sbx1", "out of memory (limit 512 MiB)", [{"message": f"line {i}"} for i in range(500)])
    assert t.get("sbx1") is tomb and t.get("other") is None
    assert tomb.describe().startswith("it was killed: out of memory (limit 512 MiB), at 20")
    assert len(tomb.logs) == MAX_LOG_ENTRIES and tomb.logs[-2]["message"] == "line 499"
    last = tomb.logs[-1]
    assert last["level"] == "error" and last["message"] == "sandbox sbx1 was killed: out of memory (limit 512 MiB)"
    assert abs(last["timestampUnixMs"] / 1000 - time.time()) < 5


def test_the_record_is_bounded_and_expires():
    t = Tombstones(max_entries=3, keep_s=0.2)
    for i in range(5):
        t.add(f"s{i}", "x")
    assert len(t) == 3 and t.get("s0") is None and t.get("s4") is not None
    time.sleep(0.3)
    assert len(t) == 0 and t.get("s4") is None


def test_log_lines_a_sandbox_wrote_are_capped():
    """A sandbox writes its own console: 200 lines of 20 KB must not pin 4 MB per death."""
    t = Tombstones()
    tomb = t.add("sbx1", "x", [{"message": "A" * 20_000} for _ in range(300)])
    assert all(len(e["message"]) <= MAX_MESSAGE_CHARS + 10 for e in tomb.logs)
    assert tomb.logs[0]["message"].endswith("…[cut]")


def test_expiry_forgets_the_oldest_first():
    t = Tombstones(max_entries=10, keep_s=1.0)
    t.add("old", "x")
    time.sleep(1.05)
    t.add("new", "y")  # old is past keep_s, new is not
    assert t.get("old") is None and t.get("new") is not None and len(t) == 1
