"""Host-side helpers for the runtime/network tests (real runsc, real netns; no mocks).

The tests use their own network-slot prefix and outer range (``ft<slot letter><N>``,
10.<144 + slot>.0.0/16)
and their own runsc root, so they neither disturb nor get reconciled away by a forkyard
server (default ``fy`` slots) running on the same host, e.g. from the API tests.

Data lives under ``$FORKYARD_TEST_DATA_DIR``, else ``$FORKYARD_DATA_DIR``, else
``/var/lib/forkyard-test``; the ``base`` template is built there once and cached.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from statistics import median

from forkyard.config import Settings
from forkyard.network.slots import NetnsNetwork

from _slot import LETTER, SLOT  # noqa: E402 — this session's slot (tests/_slot.py)

TEST_PREFIX = "ft" + LETTER
TEST_OUTER_NET = f"10.{144 + SLOT}.0.0/16"  # 10.144-159 (tests/_slot.py lists every range)
HTTP_PORT = 49983
#: init for tests until envd is used: a tiny HTTP server on the envd port.
HTTP_INIT = ["/usr/bin/python3", "-m", "http.server", str(HTTP_PORT)]


def data_root() -> Path:
    """Root data directory of the host tests."""
    return Path(
        os.environ.get("FORKYARD_TEST_DATA_DIR")
        or os.environ.get("FORKYARD_DATA_DIR")
        or "/var/lib/forkyard-test"
    )


def template_settings() -> Settings:
    """Settings whose ``templates_dir`` is ``<root>/templates`` (shared build cache)."""
    return Settings(data_dir=data_root())


def runtime_settings() -> Settings:
    """Settings for driver tests: runsc root and sandboxes under ``<root>/rt-<slot letter>``."""
    root = data_root()
    return Settings(data_dir=root / f"rt-{LETTER}", templates_override=str(root / "templates"))


def network_manager(settings: Settings | None = None) -> NetnsNetwork:
    """A NetnsNetwork on the test prefix and outer range."""
    return NetnsNetwork(settings, outer_net=TEST_OUTER_NET, prefix=TEST_PREFIX)


def runsc_exec(
    settings: Settings,
    sandbox_id: str,
    argv: list[str],
    timeout: float = 60,
    user: str | None = None,
    groups: list[int] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``argv`` inside a sandbox with ``runsc exec`` (test-only side channel).

    ``user`` is ``"uid:gid"``; ``groups`` are supplementary gids (envd gives a user its
    /etc/group memberships; ``runsc exec`` does not)."""
    cmd = [settings.runsc, f"--root={settings.runsc_root}", "exec"]
    if user:
        cmd.append(f"--user={user}")
    for gid in groups or []:
        cmd.append(f"--additional-gids={gid}")
    return subprocess.run([*cmd, sandbox_id, *argv], capture_output=True, text=True, timeout=timeout)


def netns_names(prefix: str = TEST_PREFIX) -> list[str]:
    d = Path("/run/netns")
    if not d.is_dir():
        return []
    return sorted(p.name for p in d.iterdir() if p.name.startswith(prefix) and p.name[len(prefix):len(prefix) + 1].isdigit())


def host_links(prefix: str = TEST_PREFIX) -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") > 1]
    return [n for n in names if n.startswith(prefix + "v")]


def runsc_processes(settings: Settings, sandbox_id: str | None = None) -> list[str]:
    """runsc sandbox/gofer processes of this runsc root (optionally one sandbox)."""
    out = subprocess.run(["pgrep", "-af", "runsc-(sandbox|gofer)"], capture_output=True, text=True).stdout
    lines = [l for l in out.splitlines() if f"--root={settings.runsc_root}" in l]
    if sandbox_id is not None:
        lines = [l for l in lines if l.split()[-1] == sandbox_id]
    return lines


def mounts_mentioning(fragment: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.strip() for line in f if fragment in line]


def cgroup_dirs(sandbox_id: str) -> list[str]:
    root = Path("/sys/fs/cgroup")
    found = [root / "forkyard" / sandbox_id, *root.glob(f"*/forkyard/{sandbox_id}")]
    return [str(p) for p in found if p.exists()]


def assert_sandbox_gone(settings: Settings, sandbox_id: str, workdir: Path) -> None:
    """Nothing of the sandbox is left: processes, runsc state, bundle, overlay, mounts,
    cgroups."""
    deadline = time.time() + 5
    while runsc_processes(settings, sandbox_id) and time.time() < deadline:
        time.sleep(0.05)
    assert runsc_processes(settings, sandbox_id) == []
    out = subprocess.run(
        [settings.runsc, f"--root={settings.runsc_root}", "list", "--format=json"], capture_output=True, text=True
    ).stdout
    assert f'"{sandbox_id}"' not in out
    assert not (workdir / "bundle").exists()
    assert not (workdir / "overlay").exists()
    assert mounts_mentioning(str(workdir)) == []
    assert cgroup_dirs(sandbox_id) == []


def stats_ms(samples: list[float]) -> str:
    ms = sorted(1000 * s for s in samples)
    return f"median {median(ms):.0f} ms (min {ms[0]:.0f}, max {ms[-1]:.0f}, n={len(ms)})"


def in_netns(netns_path: str, code: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run Python ``code`` natively (not under gVisor) inside a network namespace."""
    return subprocess.run(
        ["nsenter", f"--net={netns_path}", "python3", "-c", code], capture_output=True, text=True, timeout=timeout
    )


def host_source_ip(dest: str) -> str:
    """The host address the kernel uses to reach ``dest`` (e.g. its eth0 address)."""
    import json

    out = subprocess.run(["ip", "-j", "route", "get", dest], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["prefsrc"]


def mirror_host() -> str:
    """Host name of the Debian mirror configured on this host (never hard-coded)."""
    from urllib.parse import urlparse

    from forkyard.templates.base import debian_mirrors

    return urlparse(debian_mirrors()[0]).hostname or ""


def nameserver() -> str:
    from forkyard.guest.files import host_nameservers

    servers = host_nameservers()
    assert servers, "host has no usable nameserver"
    return servers[0]


#: Python snippet: try a TCP connect, print OK/FAIL:<errno name>.
CONNECT_SNIPPET = """
import socket, sys
s = socket.socket(); s.settimeout({timeout})
try:
    s.connect(({host!r}, {port})); print("OK")
except Exception as e:
    print("FAIL:" + type(e).__name__)
"""


#: A command that touches 900 MiB: over a 512 MiB sandbox's memory limit.
OOM_HOG = "python3 -c \"x = bytearray(900 * 2**20)\nfor i in range(0, len(x), 4096): x[i] = 1\""


def oom_kill_sandbox(sbx, attempts: int = 5) -> Exception:
    """Run :data:`OOM_HOG` in the E2B SDK sandbox ``sbx`` until the host's OOM killer ends
    the whole sandbox; return what ``commands.run`` raised then.

    The OOM killer may take only the allocating process's systrap stub (the command ends
    with exit 137 and the sandbox lives: docs/security.md "A sandbox killed for its
    resources"); then the hog runs again, at most ``attempts`` times (AssertionError)."""
    from e2b import CommandExitException

    for _ in range(attempts):
        try:
            sbx.commands.run(OOM_HOG, timeout=90)
        except CommandExitException as e:
            if e.exit_code != 137:
                return e
            time.sleep(1)
        except Exception as e:  # noqa: BLE001 — what the SDK raised is what the caller checks
            return e
        else:
            raise AssertionError("900 MiB were allocated in a 512 MiB sandbox")
    raise AssertionError(f"only the process was OOM-killed {attempts} times; the sandbox lives")
