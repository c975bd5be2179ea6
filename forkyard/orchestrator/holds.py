"""Test-only hold points: stop a lifecycle operation at a named phase so a test can fire
a competing request (or kill the server) at exactly that moment, then let it go on.

Off unless ``FORKYARD_TEST_HOLD_DIR`` (:func:`forkyard.config.hold_dir`) names a directory (never set it in production);
then :func:`hold` costs one ``stat`` per phase passed. Protocol, all files in that
directory (tests/_holds.py drives it):

* the test creates ``<phase>.arm`` (empty: any sandbox; else the sandbox id it holds);
* the operation reaching ``phase`` removes the arm file (one shot), writes
  ``<phase>.reached`` (the sandbox id) and waits until ``<phase>.release`` exists
  (at most :data:`MAX_HOLD_S`, then it goes on and logs a warning);
* it then removes ``.reached`` and ``.release`` and continues.

Phases (see where :func:`hold` is called in :mod:`forkyard.orchestrator.pause`,
:mod:`~forkyard.orchestrator.snapshot` and :mod:`~forkyard.orchestrator.fork`):
``pause.before-checkpoint`` (state ``pausing`` persisted, lock held),
``pause.checkpointed`` (image staged, sandbox stopped, not yet marked or ``paused``),
``pause.before-commit`` (reply sent; background commit not started),
``snapshot.staged`` (``snapshotting``, image staged, not committed),
``fork.staged`` (source checkpointed and running again, no child exists),
``fork.children-recorded`` (children persisted as ``creating``, none started),
``fork.child-start`` (one child holds a place among the ``FORKYARD_FORK_PARALLELISM``
restores, its restore not started; the hold names the child).
"""

from __future__ import annotations

import asyncio
import logging
import time

from forkyard.config import hold_dir

log = logging.getLogger("forkyard.orchestrator")

#: Longest a hold waits for its release (s): a forgotten release never wedges a server.
MAX_HOLD_S = 120.0
_POLL_S = 0.02


async def hold(phase: str, sandbox_id: str) -> None:
    """Wait at ``phase`` if a test armed it for ``sandbox_id`` (or for any sandbox);
    return at once otherwise (and always when hold points are off)."""
    d = hold_dir()
    if d is None:
        return
    arm = d / f"{phase}.arm"
    try:
        target = arm.read_text().strip()
    except OSError:
        return
    if target and target != sandbox_id:
        return
    arm.unlink(missing_ok=True)
    reached, release = d / f"{phase}.reached", d / f"{phase}.release"
    tmp = d / f".{phase}.reached.tmp"
    tmp.write_text(sandbox_id)
    tmp.rename(reached)
    log.warning("test hold: %s of %s held until %s exists", phase, sandbox_id, release)
    deadline = time.monotonic() + MAX_HOLD_S
    while not release.exists():
        if time.monotonic() > deadline:
            log.warning("test hold: %s of %s not released in %.0f s; going on", phase, sandbox_id, MAX_HOLD_S)
            break
        await asyncio.sleep(_POLL_S)
    reached.unlink(missing_ok=True)
    release.unlink(missing_ok=True)
