"""The E2B CLI (npm ``@e2b/cli``, pinned in tests/e2bcli/package.json) pointed at forkyard
with ``E2B_API_URL``/``E2B_API_KEY``: the commands that need no e2b.dev login (see
docs/e2b-compat.md). Skipped when node or the package is missing
(``npm ci --prefix tests/e2bcli``; deploy/test.sh does)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from e2b import Sandbox

E2B = Path(__file__).parent / "e2bcli" / "node_modules" / ".bin" / "e2b"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or not E2B.exists(),
                                reason="node or tests/e2bcli/node_modules missing (npm ci --prefix tests/e2bcli)")


def e2b(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_UPDATE_NOTIFIER": "1", "HOME": os.environ.get("HOME", "/root")}
    return subprocess.run([str(E2B), *args], capture_output=True, text=True, timeout=120, env=env)


def test_e2b_cli_sandbox_and_template_commands(server):
    sbx = Sandbox.create("base", timeout=120, metadata={"via": "e2b-cli"})
    try:
        sbx.commands.run("echo from-e2b-cli")
        p = e2b("sandbox", "list", "--format", "json")
        assert p.returncode == 0, p.stderr
        assert sbx.sandbox_id in [s["sandboxId"] for s in json.loads(p.stdout)]
        p = e2b("sandbox", "logs", sbx.sandbox_id, "--format", "json")
        assert p.returncode == 0, p.stderr
        # envd's lines as the sandbox's console, beside forkyard's own (issue 25 item 5)
        assert "from-e2b-cli" in p.stdout and '"logger":"sandbox"' in p.stdout, p.stdout
        assert '"logger":"forkyard"' in p.stdout and "sandbox started" in p.stdout, p.stdout
        p = e2b("sandbox", "metrics", sbx.sandbox_id, "--format", "json")
        assert p.returncode == 0 and "cpuUsedPct" in p.stdout, p.stdout + p.stderr
        p = e2b("sandbox", "exec", sbx.sandbox_id, "--", "sh", "-c", "echo exec-$((2+3)); exit 4")
        assert p.returncode == 4 and p.stdout == "exec-5\n", (p.returncode, p.stdout, p.stderr)
        p = e2b("template", "list", "--format", "json")
        assert p.returncode == 0 and "base" in p.stdout, p.stdout + p.stderr
        p = e2b("sandbox", "kill", sbx.sandbox_id)
        assert p.returncode == 0, p.stderr
        assert sbx.is_running() is False
    finally:
        Sandbox.kill(sbx.sandbox_id)
