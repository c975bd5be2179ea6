"""Scrape-time metric families of each component (point-in-time state, read when
Prometheus scrapes; the running counters live in :mod:`forkyard.obs.metrics`)."""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client.core import CounterMetricFamily

from forkyard.obs.metrics import capped, gauge

log = logging.getLogger("forkyard.obs")

#: How often the repository's stored size is re-listed (s): a full listing of chunks.
STORED_BYTES_EVERY_S = 60.0


class _StoredBytes:
    """``(chunks, bytes)`` in the repository, listed in a background thread at most every
    :data:`STORED_BYTES_EVERY_S` so a scrape never waits for a listing (None until the
    first listing finished)."""

    def __init__(self):
        self.value: tuple[int, int] | None = None
        self._at = 0.0
        self._busy = threading.Lock()

    def get(self, repo) -> tuple[int, int] | None:
        if time.monotonic() - self._at > STORED_BYTES_EVERY_S and self._busy.acquire(blocking=False):
            self._at = time.monotonic()

            def run():
                try:
                    self.value = repo.stored_bytes()
                except Exception as e:  # noqa: BLE001 — the repository may be down; metrics go on
                    log.warning("listing the repository for forkyard_repository_stored_bytes failed: %s", e)
                finally:
                    self._busy.release()

            threading.Thread(target=run, name="stored-bytes", daemon=True).start()
        return self.value


_stored = _StoredBytes()


def node_families(orch) -> list:
    """A node's state: sandboxes by state and template, spare slots, pauses in flight,
    repository and cache counters (from ``Orchestrator.repository_metrics``). Blocking
    (reads the store): call in a thread."""
    counts: dict[tuple[str, str], int] = {}
    for r in orch.list():
        key = (r.state, r.template_id or "")
        counts[key] = counts.get(key, 0) + 1
    nm = orch.node_metrics()
    fams = [
        gauge("forkyard_sandboxes", "Sandboxes on this node by state (running, paused, creating, pausing, …) "
              "and template (top 50 templates; the rest as 'other').",
              labels={"names": ["state", "template"], "samples": capped(counts)}),
        gauge("forkyard_spare_slots", "Network slots built ahead and ready for new sandboxes.", len(nm["spareSlots"])),
        gauge("forkyard_spare_disks", "Sandbox disks made ahead and ready for new sandboxes (FORKYARD_SPARE_DISKS).",
              len(nm.get("spareDisks", []))),
        gauge("forkyard_pauses_in_flight", "Pauses that answered and are still committing their image.",
              nm["pausesInFlight"]),
        gauge("forkyard_hot_paused", "Paused sandboxes whose frozen runtime this node still keeps, so a resume "
              "is an unfreeze (hot pause, FORKYARD_HOT_PAUSE_S).", nm["hotPaused"]),
    ]
    pool = nm.get("pool") or {}
    if pool:  # templates are the configured ones (FORKYARD_POOL): a bounded label set
        fams += [
            gauge("forkyard_pool_sandboxes", "Warm pool sandboxes by template and state (ready, starting); "
                  "not counted in forkyard_sandboxes.",
                  labels={"names": ["template", "state"],
                          "samples": [((t, st), p[st]) for t, p in pool.items() for st in ("ready", "starting")]}),
            gauge("forkyard_pool_target", "Warm pool size wanted per template (FORKYARD_POOL).",
                  labels={"names": ["template"], "samples": [((t,), p["target"]) for t, p in pool.items()]}),
        ]
        for name, doc in (("hits", "Creates served from the warm pool."),
                          ("misses", "Creates of a pooled template that started cold (pool empty or hand-out failed).")):
            fam = CounterMetricFamily(f"forkyard_pool_{name}", doc, labels=["template"])
            for t, p in pool.items():
                fam.add_metric([t], float(p[name]))
            fams.append(fam)
    rm = orch.repository_metrics()
    cache, restore, commit, gc = rm["cache"], rm["restore"], rm["commit"], rm["gc"]

    def c(name: str, doc: str, value) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=float(value or 0))

    fams += [
        gauge("forkyard_cache_used_bytes", "Bytes held by this node's snapshot cache.", cache.get("used_bytes", 0)),
        gauge("forkyard_cache_limit_bytes", "This node's snapshot cache bound (FORKYARD_CACHE_BYTES).",
              cache.get("limit_bytes", 0)),
        gauge("forkyard_cache_entries", "Chunks and images in this node's snapshot cache.", cache.get("entries", 0)),
        c("forkyard_cache_chunk_hits", "Chunk reads served by the node cache.", cache.get("chunk_hits")),
        c("forkyard_cache_chunk_misses", "Chunk reads that went to the repository.", cache.get("chunk_misses")),
        c("forkyard_cache_image_hits", "Restores whose whole image was in the node cache.", cache.get("image_hits")),
        c("forkyard_cache_image_misses", "Restores whose image had to be materialized.", cache.get("image_misses")),
        c("forkyard_cache_evictions", "Entries evicted from the node cache.", cache.get("evictions")),
        c("forkyard_cache_evicted_bytes", "Bytes evicted from the node cache.", cache.get("evicted_bytes")),
        c("forkyard_repository_commits", "Snapshots committed to the repository by this node.", commit.get("commits")),
        c("forkyard_repository_chunks_written", "Chunks uploaded (new to the repository).", commit.get("chunks_uploaded")),
        c("forkyard_repository_chunks_reused", "Chunks a commit found already stored (deduplicated).",
          commit.get("chunks_reused")),
        c("forkyard_repository_uploaded_bytes", "Stored (compressed) bytes uploaded by commits.",
          commit.get("bytes_uploaded")),
        c("forkyard_repository_fetched_bytes", "Stored bytes fetched from the repository for restores.",
          restore.get("bytes_fetched")),
        c("forkyard_repository_gc_runs", "Repository garbage collections run by this node.", gc.get("gc_runs")),
        c("forkyard_repository_gc_freed_bytes", "Bytes freed by repository garbage collection.",
          gc.get("gc_bytes_freed")),
    ]
    if (p2p := rm.get("p2p")) is not None:  # FORKYARD_P2P=on (forkyard.repository.p2p)
        fams += [
            c("forkyard_p2p_fetched_chunks", "Chunks fetched from peer nodes for restores (verified).",
              p2p.get("chunks_from_peers")),
            c("forkyard_p2p_fetched_bytes", "Stored bytes fetched from peer nodes for restores.",
              p2p.get("bytes_from_peers")),
            c("forkyard_p2p_peer_failures", "Peer requests that failed (connection, timeout, corrupt chunk).",
              p2p.get("peer_failures")),
            c("forkyard_p2p_peer_corrupt_chunks", "Chunks from peers that failed verification.", p2p.get("peer_corrupt")),
            c("forkyard_p2p_peer_slow_answers", "Peer answers slower than half FORKYARD_P2P_TIMEOUT_S (8 in a row "
              "skip the peer).", p2p.get("peer_slow")),
            c("forkyard_p2p_slot_waits", "Peer requests not sent: no per-peer slot within FORKYARD_P2P_SLOT_WAIT_S.",
              p2p.get("peer_slot_waits")),
            c("forkyard_p2p_served_chunks", "Chunks this node served to peers.", p2p.get("served_chunks")),
            c("forkyard_p2p_served_busy", "Peer requests answered busy (FORKYARD_P2P_MAX_SERVING or "
              "FORKYARD_P2P_MAX_SERVING_PER_PEER reached).", p2p.get("served_busy")),
            c("forkyard_p2p_served_bytes", "Stored bytes this node served to peers.", p2p.get("served_bytes")),
            c("forkyard_p2p_served_rate_wait_ms", "Milliseconds chunks waited for their member's bytes/s bound "
              "(FORKYARD_P2P_PEER_MBIT) before they were sent, all requests together.",
              p2p.get("served_rate_wait_ms")),
            c("forkyard_p2p_refused_connections", "Connections refused: the endpoint is no member the scheduler "
              "lists.", p2p.get("refused_connections")),
        ]
    stored = _stored.get(orch.snapshots.repo)
    if stored is not None:
        fams += [gauge("forkyard_repository_stored_chunks", "Chunks in the repository (listed at most once a minute).",
                       stored[0]),
                 gauge("forkyard_repository_stored_bytes", "Stored (compressed) bytes of every chunk in the repository "
                       "(listed at most once a minute).", stored[1])]
    return fams


async def cluster_families(store) -> list:
    """The cluster as the scheduler/gateway sees it in Redis: reachability, and per node
    (label ``node``: node ids, bounded by the fleet) heartbeat age, status and its last
    report (running, paused, max sandboxes, vCPUs reserved, spare slots, load)."""
    up = await store.ping()
    fams = [gauge("forkyard_redis_up", "1 when the cluster's Redis answers a PING.", 1.0 if up else 0.0)]
    if not up:
        return fams
    try:
        nodes = await store.nodes()
    except Exception as e:  # noqa: BLE001 — Redis went away between ping and read
        log.warning("reading nodes for /metrics failed: %s", e)
        return fams
    now = time.time()
    rows = sorted(nodes, key=lambda n: n.node_id)
    status = [((n.node_id, s), 1.0 if (n.status if n.alive(now) else "down") == s else 0.0)
              for n in rows for s in ("up", "draining", "down")]
    fams.append(gauge("forkyard_node_heartbeat_age_seconds", "Seconds since each node's last heartbeat.",
                      labels={"names": ["node"], "samples": [((n.node_id,), round(now - n.last_seen, 3)) for n in rows]}))
    fams.append(gauge("forkyard_node_status", "1 for each node's current status (up, draining, down).",
                      labels={"names": ["node", "status"], "samples": status}))
    for field, doc in (("running", "Running sandboxes"), ("paused", "Paused sandboxes"),
                       ("max_sandboxes", "Sandboxes the node may run at once"),
                       ("vcpus", "The node's CPUs"), ("vcpus_reserved", "vCPUs of its running sandboxes"),
                       ("free_slots", "Spare network slots"), ("memory_mb", "The node's memory (MiB)"),
                       ("load1", "1-minute load average")):
        fams.append(gauge(f"forkyard_node_{field}", f"{doc}, per node, from its last heartbeat.",
                          labels={"names": ["node"],
                                  "samples": [((n.node_id,), float(getattr(n.report, field, 0) or 0)) for n in rows]}))
    return fams
