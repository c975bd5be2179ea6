"""Drive the server's test-only hold points (:mod:`forkyard.orchestrator.holds`).

A server started by :class:`conftest.ServerProc` has ``FORKYARD_TEST_HOLD_DIR`` set to
``<data dir>/test-holds``. ``Hold(server, phase, sandbox_id)`` arms the phase; the test
then starts the operation, :meth:`Hold.wait` blocks until the operation is parked there,
the test fires its competing request, and :meth:`Hold.release` lets the operation go on.
"""

from __future__ import annotations

import time
from pathlib import Path


class Hold:
    """One armed hold point of one server."""

    def __init__(self, hold_dir: Path, phase: str, sandbox_id: str = ""):
        self.dir, self.phase = hold_dir, phase
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        for suffix in ("reached", "release"):
            (self.dir / f"{phase}.{suffix}").unlink(missing_ok=True)
        (self.dir / f"{phase}.arm").write_text(sandbox_id)

    def wait(self, timeout_s: float = 90) -> str:
        """Block until the operation reached the phase; returns the sandbox id it holds.

        Raises:
            AssertionError: it did not get there in ``timeout_s`` (the race did not happen).
        """
        reached = self.dir / f"{self.phase}.reached"
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            try:
                return reached.read_text()
            except FileNotFoundError:
                time.sleep(0.02)
        raise AssertionError(f"no operation reached hold point {self.phase} in {timeout_s} s")

    def held(self) -> bool:
        """True while an operation is parked at the phase."""
        return (self.dir / f"{self.phase}.reached").exists()

    def release(self) -> None:
        """Let the parked operation continue."""
        (self.dir / f"{self.phase}.release").touch()

    def disarm(self) -> None:
        """Remove the arm file if nothing used it (test cleanup)."""
        (self.dir / f"{self.phase}.arm").unlink(missing_ok=True)
