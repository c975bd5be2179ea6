"""When is a node dead? Only on evidence about the node (issue 19).

Nodes are the source of truth for what runs on them; the control plane routes and
places. A node is **declared down** — its running sandboxes reported gone, its paused
ones free to resume elsewhere — only when *its own* heartbeats have been missing for
:data:`~.types.HEARTBEAT_TIMEOUT_S` while the control plane could have received them.
Declaring never destroys anything: a declared-down node that comes back is told which of
its sandboxes were reported gone and stops them itself (``NodeAgent``); its paused ones
stay bound to it unless a call (or :data:`~.scheduler.ORPHAN_MOVE_S`) moved them.

The rules, per scheduler replica (each keeps this view; one at a time, the holder of
a sweeper lease in Redis, sweeps — another takes the lease over within
:data:`~.scheduler.SWEEP_LEASE_S` when it dies; the declaration itself is one atomic
Redis script that re-checks the silence, so replicas never disagree):

1. **One clock.** Heartbeats are stamped, and silences measured, with Redis's own clock
   (``TIME`` inside the scripts), so a node's, scheduler's or gateway's skewed clock
   changes nothing.
2. **Grace after a control-plane outage.** A replica trusts its view only from the
   moment it could last reach Redis without interruption (``healthy_since``, Redis
   time). A Redis call that fails, a sweep that did not run for
   :data:`STALL_S` (the scheduler was stopped, starved or just started) resets it. A
   node's silence counts from ``max(last heartbeat, healthy_since)``: after a Redis or
   scheduler outage of any length every node gets a full timeout to be heard again.
3. **A restart is announced.** A node stopped with SIGTERM keeps its sandboxes running
   (they are re-adopted at its next start) and tells the scheduler; it is not declared
   down for ``FORKYARD_NODE_RESTART_GRACE_S`` (120 s). Only a node that vanished without a word
   (killed, host lost, partitioned) is declared after the timeout.
4. **The node is asked.** Before a silent node is declared, the scheduler calls its
   ``/health`` (:data:`PROBE_TIMEOUT_S`). A node that answers is alive — overloaded, or
   cut off from the scheduler in one direction only — and is not declared: it gets no
   placements while silent, its sandboxes keep running and being served, and its paused
   ones are moved to other nodes when resumed (it refuses to resume them itself while it
   cannot tell the scheduler). Only a node that is silent *and* does not answer (dead,
   hung, or unreachable) is declared.
5. **Mass silence is the control plane's fault.** When more than
   :data:`MASS_SILENCE_FRACTION` of the nodes not yet declared down (and at least two)
   (not in a restart grace) are silent at once, the likelier cause is between them and the control plane (a
   scheduler behind an unreachable address, a network split on the control plane's
   side): nobody is declared, and a warning says why. (Kubernetes' node lifecycle
   controller stops evictions in a fully disrupted zone for the same reason.)

Cost: with every node heard, a sweep is one script (the lease, Redis's clock, and a
look at ``fy:seen``, the nodes by last heartbeat); only when some node is silent past
the timeout (or not in that index) does it read every node's liveness fields (O(nodes),
never O(sandboxes)); only the declaration of a node walks that node's own sandbox set.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from forkyard.cluster.types import HEARTBEAT_INTERVAL_S, HEARTBEAT_TIMEOUT_S, NODE_DOWN, NodeInfo
from forkyard.config import ClusterSettings

log = logging.getLogger("forkyard.scheduler")

#: Fraction of the nodes not yet declared down that may be silent at once before the
#: scheduler blames the control plane instead of the nodes (``FORKYARD_MASS_SILENCE_FRACTION``,
#: default 0.5: a majority; :class:`~forkyard.config.ClusterSettings`). 1 turns the guard off.
MASS_SILENCE_FRACTION = ClusterSettings().mass_silence_fraction
#: A sweep that did not start for this long after the previous one ended (s) means this
#: replica was not watching: its grace period starts again.
STALL_S = 3 * HEARTBEAT_INTERVAL_S
#: How long a silent node has to answer the scheduler's ``/health`` before it is declared
#: down (s): long enough for a node on an overloaded host.
PROBE_TIMEOUT_S = 3.0


@dataclass
class Verdict:
    """One sweep's judgement.

    Attributes:
        declare: ids of nodes to declare down now (silent past the timeout, counted
            from the later of their last heartbeat and ``healthy_since``).
        silent: ids of every node silent past the timeout (declared or not).
        held_back: why nothing was declared although nodes are silent (mass silence),
            or None.
    """

    declare: list[str] = field(default_factory=list)
    silent: list[str] = field(default_factory=list)
    held_back: str | None = None


class Liveness:
    """A scheduler replica's judgement of its nodes (see the module docstring).

    Args:
        timeout_s: silence (s) after which a node is declared down.
        mass_fraction: :data:`MASS_SILENCE_FRACTION`.
        stall_s: :data:`STALL_S`.
        clock: monotonic clock (s); tests pass their own.
    """

    def __init__(self, timeout_s: float = HEARTBEAT_TIMEOUT_S, mass_fraction: float = MASS_SILENCE_FRACTION,
                 stall_s: float = STALL_S, clock=time.monotonic):
        self.timeout_s, self.mass_fraction, self.stall_s = timeout_s, mass_fraction, stall_s
        self._clock = clock
        #: Redis time from which this replica's view is trusted; None while Redis fails.
        self.healthy_since: float | None = None
        self._last_tick: float | None = None
        self._last_end: float | None = None
        self._held_logged = False

    def tick(self, redis_now: float | None) -> None:
        """Record one sweep: ``redis_now`` is Redis's clock (s) read this sweep, None
        when Redis could not be reached."""
        mono = self._clock()
        since = self._last_end if self._last_end is not None else self._last_tick
        gap = mono - since if since is not None else 0.0
        stalled = gap > self.stall_s
        self._last_tick, self._last_end = mono, None
        if redis_now is None:
            if self.healthy_since is not None:
                log.warning("cluster state store unreachable: no node is judged until it is back "
                            "(then every node gets %.0f s to be heard)", self.timeout_s)
            self.healthy_since = None
        elif self.healthy_since is None or stalled:
            if stalled:
                log.warning("the sweep did not run for %.1f s (this scheduler was stopped or starved): "
                            "every node gets %.0f s to be heard again", gap, self.timeout_s)
            self.healthy_since = redis_now

    def done(self) -> None:
        """Record the end of a sweep (its own work, e.g. probes, is not a stall)."""
        self._last_end = self._clock()

    def silence(self, node: NodeInfo, redis_now: float) -> float:
        """Seconds ``node`` has been silent while this replica was watching."""
        since = max(node.last_seen, self.healthy_since if self.healthy_since is not None else redis_now)
        return redis_now - since

    def judge(self, nodes: list[NodeInfo], redis_now: float) -> Verdict:
        """Which of ``nodes`` to declare down now. Pure: declaring is the caller's
        (one atomic script per node that re-checks the silence)."""
        v = Verdict()
        v.silent = [n.node_id for n in nodes if redis_now - n.last_seen > self.timeout_s]
        if self.healthy_since is None:
            return v
        candidates = [n for n in nodes if n.status != NODE_DOWN and n.grace_until <= redis_now]
        quiet = [n for n in candidates if self.silence(n, redis_now) > self.timeout_s]
        if len(quiet) >= 2 and len(quiet) > self.mass_fraction * len(candidates):
            v.held_back = (f"{len(quiet)} of {len(candidates)} nodes are silent at once "
                           f"({', '.join(sorted(n.node_id for n in quiet))}): more likely the control plane "
                           "cannot hear them than that they all died; none is declared down")
            if not self._held_logged:
                log.warning("%s", v.held_back)
                self._held_logged = True
            return v
        self._held_logged = False
        v.declare = sorted(n.node_id for n in quiet)
        return v
