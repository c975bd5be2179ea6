"""This test session's slot on the host: an index in ``range(SLOTS)`` held through a lock
file for the whole session, so test sessions running at the same time (developers,
helpers, CI) never share network names, address ranges, runsc roots or state
directories. (A pid-derived index collided: two of five parallel sessions picked the
same one and wiped each other's server directory.)

The slot is also put in ``FORKYARD_TEST_SLOT`` (``<pid>:<slot>``) so a second import of
this module under another name in the same process (``tests._slot`` and ``_slot``)
reuses it instead of taking another.

Outer address ranges by user (S = slot; keep new ones clear of these and of the
default 10.209.0.0/16): tests/_hostutil 10.(144+S); test_egress 10.(160+S);
test_fidelity 10.(176+S) and 10.(128+S); test_repository 10.(192+S) and 10.212.16S/20; test_network
10.211.16S/20; workloads/test_workloads 10.213.16S/20; test_readme_claims 10.214.16S/20; test_deploy 10.219.16S/20;
conftest 10.(220+S); tests/_cluster 10.(240+S); test_package_cache 10.(112+S) (prefix pk<letter>,
never built: its server stops at preflight) and cache address 169.254.(100+S).1. TEST-NET "public" servers: test_egress 198.51.100.8S/29,
workloads/test_workloads 203.0.113.8S/29.
"""

from __future__ import annotations

import fcntl
import os

SLOTS = 16
LOCK_DIR = "/run/forkyard-test"
_held: list[int] = []  # the lock's fd, open for the life of the process


def _take() -> int:
    mine = os.environ.get("FORKYARD_TEST_SLOT", "")
    pid, _, slot = mine.partition(":")
    if pid == str(os.getpid()) and slot.isdigit():
        return int(slot)
    os.makedirs(LOCK_DIR, mode=0o700, exist_ok=True)
    start = os.getpid() % SLOTS
    for k in range(SLOTS):
        i = (start + k) % SLOTS
        fd = os.open(f"{LOCK_DIR}/slot-{i}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        os.environ["FORKYARD_TEST_SLOT"] = f"{os.getpid()}:{i}"
        return i
    raise RuntimeError(f"all {SLOTS} test slots are held by other test sessions on this host ({LOCK_DIR})")


#: This session's slot (0..SLOTS-1) and its letter.
SLOT = _take()
LETTER = "abcdefghijklmnop"[SLOT]
