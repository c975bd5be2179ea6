"""``GET /sandboxes/{id}/metrics`` figures against known loads, through the real SDK.

CPU comes from the sandbox's cgroup on the host (gVisor's in-sandbox ``/proc/stat`` is
all zeros); memory from the sandbox's ``/proc/meminfo``; disk from its root overlay.
Tolerances are wide: the test machine has 2 CPUs shared with other work.
"""

from __future__ import annotations

import os
import time

MB = 1 << 20
BUSY = "python3 -c 'while 1: pass'"


def _metric(sbx):
    (m,) = sbx.get_metrics()
    return m


def test_cpu_share_is_measured_on_the_host(sandbox):
    idle = _metric(sandbox)  # the first sample opens a fresh window
    time.sleep(1)
    idle = _metric(sandbox)  # covers the last second: envd idle
    assert idle.cpu_count >= 1
    assert idle.cpu_used_pct < 15, idle
    loop = sandbox.commands.run(BUSY, background=True)
    try:
        time.sleep(1)
        _metric(sandbox)
        time.sleep(2)
        busy = _metric(sandbox)  # 2 s of one busy thread
    finally:
        loop.kill()
    # One thread can use one of cpu_count CPUs: 100/cpu_count % at most (plus envd's
    # own bit); other work on the host may take some of it.
    share = 100 / busy.cpu_count
    assert share * 0.3 < busy.cpu_used_pct <= share * 1.15 + 3, (busy, idle)
    time.sleep(0.5)
    _metric(sandbox)
    time.sleep(1)
    assert _metric(sandbox).cpu_used_pct < share * 0.3  # stopped again


def test_memory_follows_an_allocation(sandbox):
    before = _metric(sandbox)
    assert 0 < before.mem_used < before.mem_total
    hold = sandbox.commands.run(
        "python3 -c 'import time; b = bytearray(200 << 20); b[::4096] = b\"x\" * len(b[::4096]); "
        "open(\"/tmp/ready\", \"w\").close(); time.sleep(600)'", background=True)
    try:
        deadline = time.time() + 60
        while not sandbox.files.exists("/tmp/ready") and time.time() < deadline:
            time.sleep(0.2)
        assert sandbox.files.exists("/tmp/ready")
        grown = _metric(sandbox).mem_used - before.mem_used
        assert 170 * MB < grown < 260 * MB, grown / MB
    finally:
        hold.kill()
    time.sleep(1)
    assert _metric(sandbox).mem_used - before.mem_used < 60 * MB  # given back


def test_page_cache_and_disk_follow_written_files(sandbox):
    before = _metric(sandbox)
    sandbox.commands.run("head -c 100M /dev/zero > /dev/shm/blob && head -c 100M /dev/urandom > /home/user/blob && sync")
    after = _metric(sandbox)
    assert after.mem_cache - before.mem_cache > 80 * MB, (before, after)
    assert 90 * MB < after.disk_used - before.disk_used < 140 * MB, (before, after)
    st = os.statvfs("/var/lib")  # the host filesystem the sandbox's layer grows into
    assert after.disk_used < after.disk_total <= max(st.f_blocks * st.f_frsize, 1 << 40)
