"""Fixtures of the chaos suite. One cluster for the chaos suite (torn down after its last test) (starting one costs ~10 s and its probes more):
real redis-server (AOF), two scheduler replicas, the gateway, three nodes with real
runsc sandboxes (node1's clock 90 s ahead), MinIO as the shared S3 repository; node2's
data dir is a 6 GiB filesystem of its own (the disk-full test fills it). Every test leaves it healed (the
``healthy`` fixture starts what a test left stopped and waits for every node to be up);
at the end every node is checked for leaks and the host for leftovers, and the figures
of every fault are printed as one table after the test summary.

Run: ``.venv/bin/python -m pytest -q tests/chaos`` (CI: short outages), or
``bench/chaos.py`` for the long variants too (FORKYARD_CHAOS_LONG=1).
"""

from __future__ import annotations

import os
import time

import pytest
from chaos._chaos import FIGURES, Probes, leaks, read_counter
from chaos._faults import skewed_env
from _cluster import Cluster
from _minio import MinIO
from conftest import TEST_ROOT

BUCKET = "chaos"


class Chaos:
    """What the chaos tests share: ``c`` (the :class:`Cluster`), ``minio``, ``probes``."""

    def __init__(self, c: Cluster, minio: MinIO):
        self.c, self.minio = c, minio
        self.probes = Probes(c)

    def heal(self) -> None:
        """Start every process a test left stopped, clear firewall rules it left, and
        wait until all nodes are up (not draining, not declared down)."""
        from chaos._faults import unpartition

        unpartition(self.c)
        if self.minio.proc is None or self.minio.proc.poll() is not None:
            self.minio.start()
        if not self.c.redis.running():
            self.c.start_redis()
        for p in self.c.schedulers + [self.c.gateway] + self.c.nodes:
            if not p.running():
                p.start()
        with self.c.sched() as s:
            for i in range(len(self.c.nodes)):
                s.post(f"/v1/nodes/node{i}/undrain")
        self.c.wait_nodes({f"node{i}" for i in range(len(self.c.nodes))}, timeout_s=60)


# Package scope: the cluster goes when the last chaos test is done (a session-scoped one
# lived until the end of the whole suite, holding its nodes' network prefixes, so every
# later cluster of the session failed to start: "another forkyard node ... uses network prefix").
@pytest.fixture(scope="package")
def chaos(base_template):
    minio = MinIO().start()
    minio.make_bucket(BUCKET)
    c = Cluster(TEST_ROOT / f"chaos-{os.getpid()}", nodes=3, schedulers=2, data_fs_mb={2: 6144}, node_cgroups=True,
                env={"FORKYARD_REPO": f"s3://{BUCKET}/repo", "FORKYARD_S3_ENDPOINT": minio.url,
                     "FORKYARD_S3_REGION": minio.region, "AWS_ACCESS_KEY_ID": minio.access_key,
                     "AWS_SECRET_ACCESS_KEY": minio.secret_key, "FORKYARD_SPARE_SLOTS": "2",
                     "FORKYARD_SPARE_DISKS": "1", "FORKYARD_COMMIT_RETRY_S": "5"})
    # node1's wall clock runs 90 s ahead for the whole suite (clock skew: liveness uses
    # Redis's clock, so nothing may notice; test_clock_skew skews the others too).
    c.nodes[1].env = skewed_env(c.nodes[1].env, 90)
    h = Chaos(c, minio)
    try:
        c.start()
        yield h
        h.heal()
        time.sleep(3)  # pauses' background halves, republishing
        for p in list(h.probes.all):
            c.api().delete(f"/sandboxes/{p}")
        time.sleep(2)
        found = leaks(c)
        FIGURES.append({"fault": "leaks after the suite", "note": "; ".join(f"{n}: {v or 'none'}" for n, v in found.items())})
        assert not any(found.values()), found
    finally:
        c.close()
        minio.stop()
        from test_cluster import assert_clean

        assert_clean(c)


@pytest.fixture
def healthy(chaos):
    """The shared cluster, healed before and after the test; probes a failed test lost
    are dropped (so the next test does not wait for them)."""
    chaos.heal()
    yield chaos
    chaos.heal()
    for p in list(chaos.probes.all.values()):
        if not p.paused and read_counter(chaos.c, p.sid, wait_s=5) != p.value:
            chaos.probes.all.pop(p.sid)


def pytest_terminal_summary(terminalreporter):
    """Print :data:`~chaos._chaos.FIGURES` as one table (and append it to
    ``$FORKYARD_CHAOS_REPORT`` when set)."""
    if not FIGURES:
        return
    cols = ["fault", "running_lost", "paused_lost", "errors", "error_span_s", "recovery_s", "workload", "note"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in FIGURES:
        lines.append("| " + " | ".join(str(row.get(k, "")) for k in cols) + " |")
    terminalreporter.section("chaos figures (errors: failed/all probe reads through the gateway)")
    for line in lines:
        terminalreporter.write_line(line)
    out = os.environ.get("FORKYARD_CHAOS_REPORT")
    if out:
        with open(out, "a") as f:
            f.write("\n".join(lines) + "\n")
