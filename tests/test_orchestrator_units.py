"""Fast tests (no runsc, < 2 s) of the orchestrator's pure parts: admission, hot-pause
books, the warm pool's books and refill, Server-Timing, and the SQLite store (a real
database file).

These are the tests the mutation run uses per mutant (docs/testing.md); the same code
is exercised end to end by test_lifecycle.py, test_hot_pause.py and test_pool.py. The
pool's ``boot``/``destroy`` callbacks are the orchestrator's (runsc); here they are
plain functions that record what the pool asked for — the pool's books are under test.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from forkyard.orchestrator import admission, hot, timing
from forkyard.orchestrator.admission import AtCapacity, Capacity
from forkyard.orchestrator.hot import HotPaused
from forkyard.orchestrator.pool import NotPoolable, Pooled, WarmPool
from forkyard.orchestrator.store import SandboxRecord, Store


def _rec(sid: str, state: str = "running", vcpus: int = 1, memory_mb: int = 512, started_at: float = 1.0,
         **kw) -> SandboxRecord:
    return SandboxRecord(id=sid, template_id="base", state=state, slot=None, vcpus=vcpus, memory_mb=memory_mb,
                         started_at=started_at, end_at=started_at + 300, auto_pause=True, **kw)


# ---- admission ---------------------------------------------------------------------------
def test_capacity_from_env(monkeypatch):
    total = admission._host_memory_mb()
    with open("/proc/meminfo") as f:
        assert total == int(f.readline().split()[1]) // 1024
    for k in ("FORKYARD_RESERVED_MEMORY_MB", "FORKYARD_MEMORY_OVERCOMMIT", "FORKYARD_CPU_OVERCOMMIT",
              "FORKYARD_MAX_SANDBOXES"):
        monkeypatch.delenv(k, raising=False)
    c = Capacity.from_env()
    assert (c.memory_mb, c.vcpus, c.max_sandboxes) == (total - 1024, None, 125 * os.cpu_count())
    monkeypatch.setenv("FORKYARD_MAX_SANDBOXES", "0")
    assert Capacity.from_env().max_sandboxes is None  # 0: no count limit
    monkeypatch.setenv("FORKYARD_RESERVED_MEMORY_MB", "100")
    monkeypatch.setenv("FORKYARD_MEMORY_OVERCOMMIT", "2.5")
    monkeypatch.setenv("FORKYARD_CPU_OVERCOMMIT", "3")
    monkeypatch.setenv("FORKYARD_MAX_SANDBOXES", "7")
    c = Capacity.from_env()
    assert c.memory_mb == int((total - 100) * 2.5)
    assert c.vcpus == os.cpu_count() * 3 and c.max_sandboxes == 7
    assert c.as_dict() == {"memoryMB": c.memory_mb, "vcpus": c.vcpus, "maxSandboxes": 7,
                           "minAvailableMemoryPct": c.min_available_pct, "sandboxHostMB": c.sandbox_host_mb,
                           "memoryOvercommit": 2.5, "hostMemoryMB": total - 100}
    for bad in ("0", "-1"):
        monkeypatch.setenv("FORKYARD_MEMORY_OVERCOMMIT", bad)
        with pytest.raises(ValueError, match="ratio"):
            Capacity.from_env()
    monkeypatch.setenv("FORKYARD_MEMORY_OVERCOMMIT", "2.5")
    monkeypatch.setenv("FORKYARD_RESERVED_MEMORY_MB", str(total + 10))
    assert Capacity.from_env().memory_mb == 0  # never negative


def test_admission_counts_memory_exactly_and_not_paused_sandboxes():
    cap = Capacity(memory_mb=2048, vcpus=None, max_sandboxes=None)
    live = [_rec("a", memory_mb=1024), _rec("b", "paused", memory_mb=4096), _rec("c", "creating", memory_mb=512)]
    cap.check(live, 1, 512)  # 1024 + 512 + 512 = 2048: fits exactly
    assert cap.fits(live, 1, 512) and not cap.fits(live, 1, 513)
    with pytest.raises(AtCapacity) as ei:
        cap.check(live, 1, 256, count=3)
    assert ei.value.status == 503
    assert str(ei.value) == ("node at capacity: 1536 of 2048 MiB of sandbox memory in use, "
                             "no room for 3 sandbox(es) of 1 vCPU / 256 MiB; retry later")
    assert not cap.fits(live, 1, 256, held=[(1, 512)])  # the pool's holdings count too
    assert cap.fits([], 1, 1024, count=2) and not cap.fits([], 1, 1024, count=3)


def test_overcommitted_admission_counts_what_sandboxes_use():
    """Issue 21: with limits overcommitted, the node admits by measured use (each
    sandbox at least sandbox_host_mb, as is each new one) within the host's memory; at
    overcommit 1 the limits alone decide (today's behaviour) and use is not read."""
    use = {"a": 300 << 20, "c": 10 << 20}  # bytes, as the runtime measures them
    asked = []

    def measure(ids):
        asked.append(list(ids))
        return {i: use[i] for i in ids if i in use}

    live = [_rec("a", memory_mb=512), _rec("b", "paused", memory_mb=512), _rec("c", "creating", memory_mb=512)]
    cap = Capacity(memory_mb=8000, vcpus=None, max_sandboxes=None, sandbox_host_mb=64, overcommit=8,
                   host_memory_mb=1000, memory_in_use=measure)
    assert cap.in_use_mb(live) == 300 + 64  # c is below the floor; b is paused
    assert asked[-1] == ["a", "c"]
    cap.check(live, 1, 512, count=9)  # limits 1024 + 4608 <= 8000; use 364 + 576 <= 1000
    with pytest.raises(AtCapacity) as ei:
        cap.check(live, 1, 512, count=10)  # use 364 + 640 > 1000, although the limits fit
    assert ei.value.status == 503
    assert str(ei.value) == ("node at capacity: sandboxes use 364 of 1000 MiB of host memory (limits "
                             "overcommitted 8x), no room for 10 sandbox(es) of 1 vCPU / 512 MiB; retry later")
    assert not cap.fits(live, 1, 512, count=9, held=[(2, 512)])  # pooled sandboxes use memory too
    use["a"] = 0  # a freed its memory: room again
    assert cap.fits(live, 1, 512, count=10)
    asked.clear()
    plain = Capacity(memory_mb=8000, vcpus=None, max_sandboxes=None, overcommit=1, host_memory_mb=1000,
                     memory_in_use=measure)
    assert plain.fits(live, 1, 512, count=13) and asked == []


def test_admission_host_memory_readings_are_meminfos():
    with open("/proc/meminfo") as f:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in f}
    assert admission._host_memory_mb() == fields["MemTotal"] // 1024
    # MemAvailable moves while we read: within 256 MiB of our own reading
    assert abs(admission._host_available_mb() - fields["MemAvailable"] // 1024) < 256


def test_admission_keeps_a_share_of_host_memory_available(monkeypatch):
    """min_available_pct: a start is refused when the host's available memory, less
    sandbox_host_mb per new sandbox, would fall under that share of its total; 0: the
    host is not asked."""
    monkeypatch.setattr(admission, "_host_available_mb", lambda: 1000)
    monkeypatch.setattr(admission, "_host_memory_mb", lambda: 10000)
    cap = Capacity(memory_mb=10**6, vcpus=None, max_sandboxes=None, min_available_pct=5, sandbox_host_mb=100)
    cap.check([], 1, 1, count=5)  # 1000 - 500 = 500: exactly the 5 % that must stay
    with pytest.raises(AtCapacity) as ei:
        cap.check([], 1, 1, count=6)
    assert ei.value.status == 503
    assert str(ei.value) == ("node at capacity: host memory low (1000 MiB available, 5% of 10000 MiB must stay "
                             "free), no room for 6 sandbox(es) of 1 vCPU / 1 MiB; retry later")
    assert Capacity(memory_mb=10**6, vcpus=None, max_sandboxes=None, min_available_pct=4.5,
                    sandbox_host_mb=100).fits([], 1, 1, count=5)  # 550 >= 450
    assert not Capacity(memory_mb=10**6, vcpus=None, max_sandboxes=None, min_available_pct=5,
                        sandbox_host_mb=101).fits([], 1, 1, count=5)

    def unread():
        raise AssertionError("host memory read with the check off")

    monkeypatch.setattr(admission, "_host_available_mb", unread)
    assert Capacity(memory_mb=10**6, vcpus=None, max_sandboxes=None).fits([], 1, 1, count=50)
    defaults = Capacity(memory_mb=1, vcpus=None, max_sandboxes=None)
    assert (defaults.min_available_pct, defaults.sandbox_host_mb, defaults.overcommit, defaults.host_memory_mb) == \
        (0.0, 64, 1.0, None)


def test_admission_vcpu_and_count_limits():
    cap = Capacity(memory_mb=10**6, vcpus=4, max_sandboxes=None)
    live = [_rec("a", vcpus=2), _rec("p", "paused", vcpus=8)]
    assert cap.fits(live, 2, 1) and not cap.fits(live, 3, 1) and not cap.fits(live, 1, 1, count=3)
    with pytest.raises(AtCapacity, match=r"2 of 4 vCPUs in use, no room for 1 sandbox\(es\) of 3 vCPU"):
        cap.check(live, 3, 1)
    assert not cap.fits(live, 1, 1, held=[(2, 0)])
    assert cap.fits([], 1, 1) and cap.fits([], 4, 1) and not cap.fits([], 5, 1)  # under the cap fits too
    cap = Capacity(memory_mb=10**6, vcpus=None, max_sandboxes=3)
    live = [_rec("a"), _rec("b"), _rec("p", "paused")]
    assert cap.fits(live, 1, 1) and not cap.fits(live, 1, 1, count=2)
    assert not cap.fits(live, 1, 1, held=[(1, 1)])
    assert cap.fits([], 1, 1) and cap.fits([], 1, 1, count=3)  # under the cap fits too
    with pytest.raises(AtCapacity, match=r"2 of 3 sandboxes in use, no room for 2 sandbox"):
        cap.check(live, 1, 1, count=2)


# ---- hot pause ----------------------------------------------------------------------------
def test_hot_paused_books():
    h = HotPaused(grace_s=60, max_kept=2)
    assert h.enabled and not HotPaused(0, 2).enabled and not HotPaused(60, 0).enabled
    assert HotPaused(60, 1).enabled and HotPaused(0.5, 1).enabled  # FORKYARD_HOT_PAUSE_MAX=1 keeps one
    slots = {sid: object() for sid in "abc"}
    for sid in "abc":
        h.keep(sid, slots[sid])
        time.sleep(0.002)
    assert h.ids() == ["a", "b", "c"] and len(h) == 3 and "a" in h and "z" not in h
    assert h.due() == ["a"]  # one more than max_kept: the oldest goes
    assert h.due(available_pct=50.0) == ["a"]
    assert h.due(available_pct=9.9) == ["a", "b"]  # low memory: the oldest of the rest too
    assert h.slot("b") is slots["b"] and "b" in h  # slot() keeps it
    assert h.take("b") is slots["b"] and "b" not in h and h.take("b") is None and h.slot("b") is None
    assert h.due(available_pct=10.0) == []  # at the threshold: nothing
    few = HotPaused(grace_s=60, max_kept=5)
    few.keep("x", object())
    few.keep("y", object())
    assert few.due() == []  # fewer kept than max_kept: none is dropped


def test_hot_paused_grace_period():
    h = HotPaused(grace_s=1.0, max_kept=10)
    h.keep("old", object())
    time.sleep(1.05)
    h.keep("new", object())
    assert h.due() == ["old"]
    assert h.due(available_pct=1.0) == ["old", "new"]
    time.sleep(1.05)
    assert h.due() == ["old", "new"]


def test_hot_available_memory_pct_is_meminfos():
    pct = hot.available_memory_pct()
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, rest = line.partition(":")
            info[k] = int(rest.split()[0])
    assert pct == pytest.approx(100 * info["MemAvailable"] / info["MemTotal"], abs=2)
    assert 0 < pct <= 100


# ---- Server-Timing ------------------------------------------------------------------------
async def test_server_timing_is_per_request():
    assert timing.header([]) == {}
    timing.record("outside", 1.0)  # no request collecting: nothing to append to, no error

    async def request(name: str, ms: float):
        phases = timing.start()
        await asyncio.sleep(0.01)
        timing.record(name, ms)
        timing.add("extra", 2.25)
        return phases

    a, b = await asyncio.gather(request("checkpoint", 54.14), request("restore", 7.0))
    assert a == [("checkpoint", 54.14), ("extra", 2.25)] and b == [("restore", 7.0), ("extra", 2.25)]
    assert timing.header(a) == {"Server-Timing": "checkpoint;dur=54.1, extra;dur=2.2"}


async def test_server_timing_phases_are_observed_in_seconds():
    """``record`` also feeds ``forkyard_lifecycle_phase_seconds`` (seconds, under the
    running operation); ``add`` does not (its phase is observed elsewhere)."""
    from forkyard.obs import metrics

    hist = metrics.PHASE.labels("snapshot", "unit-phase")  # (this test process's registry)
    sum_before = hist._sum.get()

    @metrics.timed("snapshot")
    async def op(self, _sid):
        timing.record("unit-phase", 250.0)
        timing.add("unit-phase", 1000.0)

    await op(None, "sbx")
    assert hist._sum.get() - sum_before == pytest.approx(0.25)


# ---- store (real SQLite) ------------------------------------------------------------------
def test_store_round_trips_every_field_and_notifies(tmp_path):
    s = Store(tmp_path / "data" / "db" / "state.db")  # the data dir is made as needed
    seen: list[str] = []
    s.listeners.append(seen.append)
    assert stat.S_IMODE((tmp_path / "data" / "db" / "state.db").stat().st_mode) == 0o600
    full = _rec("full", "paused", vcpus=2, memory_mb=1024, started_at=5.0, metadata={"k": "v"},
                env_vars={"A": "1"}, envd_access_token="tok", client_id="c", image_id="img", timeout_s=60,
                paused_at=9.5, auto_resume=True, egress={"allowOut": ["1.2.3.4/32"], "denyOut": []},
                traffic_token="tt", mask_host="h:${PORT}", disk_mb=2048, auto_pause_memory=False,
                default_user="root", default_workdir="/srv")
    full.slot = 3
    bare = _rec("bare", started_at=1.0)
    bare.auto_pause = False
    s.put(full)
    s.put(bare)
    assert s.get("full") == full and s.get("bare") == bare and s.get("none") is None
    assert s.get("bare").auto_pause_memory is None and s.get("bare").egress == {}
    assert s.get("bare").auto_pause is False and s.get("full").auto_resume is True
    assert [r.id for r in s.all()] == ["bare", "full"]  # oldest first
    full.state = "running"
    s.put(full)  # replaces the row
    assert s.get("full").state == "running" and len(s.all()) == 2
    s.delete("full")
    s.delete("never")
    assert s.get("full") is None and [r.id for r in s.all()] == ["bare"]
    assert seen == ["full", "bare", "full", "full", "never"]
    s.close()
    again = Store(tmp_path / "data" / "db" / "state.db")  # persisted
    assert again.get("bare") == bare
    # The orchestrator calls it from worker threads (asyncio.to_thread) too.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: again.put(_rec(f"t{i}", started_at=10.0 + i)), range(8)))
        assert pool.submit(again.get, "t3").result().started_at == 13.0
    assert len(again.all()) == 9
    again.close()


def test_store_migrates_an_old_database(tmp_path):
    path = tmp_path / "state.db"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE sandboxes (id TEXT PRIMARY KEY, template_id TEXT NOT NULL,
        state TEXT NOT NULL, slot INTEGER, vcpus INTEGER NOT NULL, memory_mb INTEGER NOT NULL,
        started_at REAL NOT NULL, end_at REAL NOT NULL, auto_pause INTEGER NOT NULL,
        metadata TEXT NOT NULL, env_vars TEXT NOT NULL, envd_access_token TEXT,
        client_id TEXT NOT NULL DEFAULT 'forkyard');""")
    db.execute("INSERT INTO sandboxes VALUES ('old','base','paused',NULL,1,512,1.0,301.0,1,?,?,NULL,'forkyard')",
               (json.dumps({"m": "1"}), json.dumps({})))
    db.commit()
    db.close()
    os.chmod(path, 0o644)
    s = Store(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    r = s.get("old")
    assert r.metadata == {"m": "1"} and r.timeout_s == 300 and r.disk_mb == 0 and r.image_id is None
    assert r.auto_resume is False and r.auto_pause_memory is None and r.egress == {}
    s.put(r)
    s.close()


# ---- warm pool ----------------------------------------------------------------------------
class Books:
    """What the pool asked the orchestrator to do."""

    def __init__(self, room: int = 10):
        self.booted: list[str] = []
        self.destroyed: list[str] = []
        self.room_left = room
        self.fail: set[str] = set()
        self.not_poolable: set[str] = set()
        self.busy = False
        self.pct: float | None = 50.0
        self.n = 0

    async def boot(self, e: Pooled) -> None:
        await asyncio.sleep(0)
        if e.template_id in self.fail:
            raise RuntimeError("boot failed")
        if e.template_id in self.not_poolable:
            raise NotPoolable("snapshot template")
        self.booted.append(e.sandbox_id)

    async def destroy(self, e: Pooled) -> None:
        self.destroyed.append(e.sandbox_id)

    def new_id(self) -> str:
        self.n += 1
        return f"p{self.n}"

    def pool(self, targets: dict[str, int]) -> WarmPool:
        return WarmPool(targets, self.boot, self.destroy, room=lambda v, m, held: len(held) < self.room_left,
                        busy=lambda: self.busy, available_pct=lambda: self.pct, defaults=(1, 256),
                        new_id=self.new_id)


async def _filled(p: WarmPool) -> None:
    p.refill()
    await asyncio.wait_for(p._task, 5)


async def test_pool_fills_to_target_within_room_and_hands_out_oldest_first():
    b = Books(room=3)
    p = b.pool({"base": 2, "other": 2})
    assert p.enabled and p.pools("base") and not p.pools("x") and not b.pool({}).enabled
    await _filled(p)
    assert len(b.booted) == 3 and len(p.held()) == 3  # room for 3, not the 4 wanted
    d = p.describe()
    assert d["base"]["ready"] + d["other"]["ready"] == 3 and d["base"]["memoryMB"] == 256 * d["base"]["ready"]
    assert d["base"]["target"] == 2 and d["base"]["boots"] == d["base"]["ready"]
    first = min((e for e in p.ready() if e.template_id == "base"), key=lambda e: e.ready_at)
    got = p.take("base", 0)
    assert got is first and got.state == "taken" and got.sandbox_id not in p.ids()
    p.record("base", True)
    p.record("base", True)
    p.record("base", False)
    assert (p.stats["base"].hits, p.stats["base"].misses) == (2, 1)
    await p.stop()
    assert sorted(b.destroyed) == sorted(set(b.booted) - {got.sandbox_id}) and p.ids() == []


async def test_pool_take_drops_stale_builds_and_waits_while_busy():
    b = Books()
    p = b.pool({"base": 2})
    await _filled(p)
    b.busy = True  # a user start in flight: no refill
    assert p.take("base", stamp=1) is None  # both are of an older build (stamp 0)
    await asyncio.sleep(0.1)
    assert sorted(b.destroyed) == sorted(b.booted) and p.held() == [] and len(b.booted) == 2
    b.busy = False
    await asyncio.wait_for(p._task, 5)
    assert len(b.booted) == 4 and len(p.ready()) == 2
    await p.stop()


async def test_pool_gives_way_to_users_and_low_memory():
    b = Books()
    p = b.pool({"base": 3})
    await _filled(p)
    ready = sorted(p.ready(), key=lambda e: e.ready_at)
    b.room_left = 0  # no refill into the room users take
    assert p.make_room(lambda held: len(held) <= 1) == 2
    await asyncio.sleep(0.05)
    assert sorted(b.destroyed) == sorted(e.sandbox_id for e in ready[1:])  # the newest go first
    assert p.held() == [(1, 256)]
    b.pct = 9.0
    p.check_memory()
    await asyncio.sleep(0.05)
    assert p.held() == [] and ready[0].sandbox_id in b.destroyed
    b.pct, b.room_left = 15.0, 10
    await _filled(p)
    assert p.held() == []  # under refill_min_available_pct (20 %): no refill
    b.pct = 10.0
    p.check_memory()  # at the drop threshold: nothing dropped
    await p.stop()


async def test_pool_make_room_drops_starting_before_ready():
    b = Books()
    p = b.pool({"base": 1})
    await _filled(p)
    starting = Pooled("s1", "base", 1, 256)
    p._entries["s1"] = starting
    assert p.make_room(lambda held: len(held) <= 1) == 1
    assert starting.state == "doomed" and len(p.ready()) == 1 and len(p.held()) == 1
    await asyncio.sleep(0.05)
    assert "s1" not in b.destroyed  # a starting one is destroyed when its boot returns, not now
    await p.stop()


async def test_pool_failed_and_unpoolable_boots_are_retried_later():
    b = Books()
    b.fail.add("bad")
    b.not_poolable.add("snap")
    p = b.pool({"bad": 1, "snap": 1, "base": 1})
    p.retry_s = 1.0
    await _filled(p)
    assert [e.template_id for e in p.ready()] == ["base"]
    assert p.stats["bad"].failures == 1 and "snap" not in p.stats and sorted(p.slot_indexes()) == []
    b.fail.clear()
    b.not_poolable.clear()
    await _filled(p)
    assert len(p.ready()) == 1  # within retry_s: not tried again
    await asyncio.sleep(1.05)
    await _filled(p)
    assert sorted(e.template_id for e in p.ready()) == ["bad", "base", "snap"]
    await p.stop()
    assert len(b.destroyed) == 3


async def test_pool_hands_out_only_its_template_and_refills_the_neediest():
    b = Books()
    p = b.pool({"other": 1})
    await _filled(p)  # an "other" sandbox, older than any "base" one
    assert p.take("base", 0) is None and len(p.ready()) == 1  # never another template's
    p.targets = {"other": 1, "base": 1}
    await _filled(p)
    got = p.take("base", 0)
    assert got is not None and got.template_id == "base"
    # Refill: a starting sandbox counts toward its target; the template furthest below
    # its target goes first.
    await p.stop()
    b2 = Books()
    q = b2.pool({"a": 3, "b": 2})
    for i in range(2):
        q._entries[f"a{i}"] = Pooled(f"a{i}", "a", 1, 256, state="ready")
    assert q._next() == "b"  # a is 1 short, b 2
    q._entries["b0"] = Pooled("b0", "b", 1, 256)  # starting
    q._entries["b1"] = Pooled("b1", "b", 1, 256)
    assert q._next() == "a"
    q._entries["a2"] = Pooled("a2", "a", 1, 256)
    assert q._next() is None
    q._entries.clear()


async def test_pool_low_memory_drops_the_newest_ready_and_only_when_low():
    b = Books()
    p = b.pool({"base": 2})
    await _filled(p)
    newest = max(p.ready(), key=lambda e: e.ready_at)
    b.room_left = 0
    b.pct = 50.0
    p.check_memory()
    await asyncio.sleep(0.05)
    assert b.destroyed == [] and len(p.ready()) == 2  # enough memory: nothing dropped
    b.pct = 5.0
    p.check_memory()
    await asyncio.sleep(0.05)
    assert b.destroyed == [newest.sandbox_id]
    await p.stop()


async def test_pool_stop_waits_for_a_boot_in_flight_and_refills_no_more():
    b = Books()
    gate = asyncio.Event()
    booting = asyncio.Event()

    async def slow_boot(e: Pooled) -> None:
        booting.set()
        await gate.wait()
        b.booted.append(e.sandbox_id)

    p = b.pool({"base": 2})
    p.boot = slow_boot
    p.refill()
    await asyncio.wait_for(booting.wait(), 5)
    stopping = asyncio.create_task(p.stop())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits for the boot in flight
    gate.set()
    await asyncio.wait_for(stopping, 5)
    assert b.booted == ["p1"] and b.destroyed == ["p1"] and p.ids() == []  # booted, then destroyed
    p.refill()
    await asyncio.sleep(0.05)
    assert b.booted == ["p1"] and p.ids() == []  # a stopped pool starts nothing


# ---- pure parts of images / staging -------------------------------------------------------
def test_lifecycle_guest_defaults_staged_memory_and_ids(tmp_path):
    from forkyard.ids import new_sandbox_id
    from forkyard.orchestrator.images import DEFAULT_USER_KEY, DEFAULT_WORKDIR_KEY, guest_defaults
    from forkyard.repository.snapshots import SnapshotMeta
    from forkyard.runtime.base import ImageKind
    from forkyard.runtime.gvisor.image import ROOTFS_TAR, image_at

    meta = SnapshotMeta("s", "snapshot", "base", "src", 1, 512,
                        metadata={DEFAULT_USER_KEY: "builder", DEFAULT_WORKDIR_KEY: "/app"})
    assert guest_defaults(None) == (None, None)
    assert guest_defaults(meta) == ("builder", "/app")  # a template build's metadata
    meta.default_user, meta.default_workdir = "root", "/srv"
    assert guest_defaults(meta) == ("root", "/srv")  # the source's own defaults win
    assert guest_defaults(SnapshotMeta("s", "pause", "base", "src", 1, 512)) == (None, None)
    (tmp_path / "image").mkdir()
    assert image_at(tmp_path / "image").kind is ImageKind.CHECKPOINT
    (tmp_path / "image" / "forkyard-runtime.json").write_text('{"runtime": "gvisor", "build": "b1"}')
    assert image_at(tmp_path / "image").build == "b1"  # the build it records (restores check it)
    (tmp_path / "image" / f"{ROOTFS_TAR}.tmp").touch()
    assert image_at(tmp_path / "image").kind is ImageKind.FILESYSTEM  # an export, still being written
    (tmp_path / "image" / f"{ROOTFS_TAR}.tmp").rename(tmp_path / "image" / ROOTFS_TAR)
    assert image_at(tmp_path / "image").kind is ImageKind.FILESYSTEM
    ids = {new_sandbox_id() for _ in range(200)}
    assert len(ids) == 200 and all(len(i) == 20 and i.isalnum() and i == i.lower() for i in ids)


async def test_pool_sandbox_dropped_while_booting_is_destroyed_and_replaced():
    b = Books()
    gate = asyncio.Event()
    booting = asyncio.Event()
    fast_boot = b.boot

    async def first_slow(e: Pooled) -> None:
        if e.sandbox_id == "p1":
            booting.set()
            await gate.wait()
        await fast_boot(e)

    p = b.pool({"base": 1})
    p.boot = first_slow
    p.refill()
    await asyncio.wait_for(booting.wait(), 5)
    assert p.make_room(lambda held: not held) == 1  # a user start needs the room: p1 is doomed
    gate.set()
    await asyncio.wait_for(p._task, 5)
    assert "p1" in b.destroyed and "p1" not in p.ids()  # destroyed when its boot returned, never ready
    assert [e.sandbox_id for e in p.ready()] == ["p2"]  # and the pool went on to refill
    await p.stop()
