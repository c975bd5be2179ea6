"""The chaos suite with its long variants (Redis and both schedulers down 30 and 60 s as
well as 1-10 s), printing the figures table: per fault, running and paused sandboxes
lost, probe reads through the gateway that failed and over how long, recovery time, the
mixed SDK workload's results, and the leaks found on every node afterwards.

The suite is tests/chaos (real redis-server, two schedulers, the gateway, three nodes
with runsc sandboxes, MinIO); CI runs it with the short outages only. Here
FORKYARD_CHAOS_LONG=1 adds the long ones (~6 min more).

Usage (as root, after deploy/test.sh once): ``python bench/chaos.py [--report FILE] [pytest args…]``
(``-k redis`` to run some). The table is also appended to FILE (default
``/var/lib/forkyard-test/chaos-figures.md``). Exit status: pytest's.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", default=os.path.join(os.environ.get("FORKYARD_TEST_DATA_DIR", "/var/lib/forkyard-test"),
                                                      "chaos-figures.md"))
    args, rest = ap.parse_known_args()
    env = dict(os.environ, FORKYARD_CHAOS_LONG="1", FORKYARD_CHAOS_REPORT=args.report)
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/chaos", *rest],
                           cwd=REPO, env=env)


if __name__ == "__main__":
    sys.exit(main())
