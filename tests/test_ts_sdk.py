"""The E2B JavaScript/TypeScript SDK (npm ``e2b``, pinned in tests/ts/package.json) against
forkyard: create, commands, files, PTY, pause, connect, isRunning, getHost
(tests/ts/smoke.mjs). Skipped when node or the installed package is missing: install
with ``npm ci --prefix tests/ts`` (deploy/test.sh does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

TS = Path(__file__).parent / "ts"


@pytest.mark.skipif(shutil.which("node") is None or not (TS / "node_modules" / "e2b").is_dir(),
                    reason="node or tests/ts/node_modules/e2b missing (npm ci --prefix tests/ts)")
def test_typescript_sdk_smoke(server):
    env = {**os.environ, "FORKYARD_EXPECT_DOMAIN": f"localhost:{server.port}"}
    p = subprocess.run(["node", "smoke.mjs"], cwd=TS, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(p.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
