"""Soak test: many mixed lifecycle cycles against one server, then a leak report.

Each cycle creates a sandbox and runs one of these scenarios (random, seeded):

* ``exec``        — run a command, kill;
* ``pause``       — write a file, pause, resume, check the file, kill;
* ``fork``        — fork 2 children, run a command in one, kill all;
* ``kill-pause``  — start a pause and kill the sandbox while it runs;
* ``kill-fork``   — start a fork of 2 and kill the source while it runs;
* ``kill-exec``   — start a long command and kill the sandbox under it.

Afterwards every sandbox is killed, the server settles (pauses committed, image GC
done), and the host is compared with the baseline taken before the first cycle:
sandbox rows in the state database (one a create or fork left behind would count
against the node's capacity), network namespaces and veths of the server's prefix
(spare slots excepted), mounts
under its data dir, runsc processes of its runsc root, iptables rules naming its
prefix, the server's open file descriptors and the repository's bytes (after a final
image GC with no grace period, the server stopped). Goal: every difference 0.

Usage (as root): ``python bench/soak.py [--cycles 1000] [--concurrency 4] [--seed 1]``.
The server runs from this checkout with its own data dir (``/var/lib/forkyard-soak``),
network prefix ``soak`` and outer range 10.121.0.0/16. Exit status 1 when anything leaked
(a figure above its baseline); ``sockets_to_sandboxes`` lists the server's new sockets to
sandbox addresses, ``gone_fds`` what was open at the baseline and closed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import _clean_previous, templates_dir  # noqa: E402

PREFIX = "soak"  # clear of every test prefix (tests/_slot.py)
OUTER = "10.121.0.0/16"
PARENT_KEY = "forkyard.parentSandboxID"  # fork lineage (forkyard.orchestrator.lifecycle)
SCENARIOS = ("exec", "pause", "fork", "kill-pause", "kill-fork", "kill-exec")


def _sh(argv: list[str]) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def repository_bytes(repo: Path) -> int:
    """Bytes of chunks, manifests and leases (not the GC's own epoch/lock files)."""
    return sum(p.stat().st_size for d in ("chunks", "manifests", "leases") if (repo / d).is_dir()
               for p in (repo / d).rglob("*") if p.is_file())


def server_fds(pid: int, port: int) -> list[str]:
    """What the server's open fds point at, not counting connections clients hold open
    to its API port (keep-alive pools of the soak's own clients); sockets are named by
    their /proc/net entry (local and remote address) where found."""
    clients, names = set(), {}
    for table in ("tcp", "tcp6", "udp", "unix"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            f = line.split()
            if table == "unix":
                names[f[6]] = f"unix {f[7] if len(f) > 7 else ''}"
                continue
            names[f[9]] = f"{table} {f[1]}->{f[2]} st{f[3]}"
            if table.startswith("tcp") and int(f[1].rsplit(":", 1)[1], 16) == port and f[3] != "0A":
                clients.add(f[9])  # accepted, not the listener
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inode = target[8:-1] if target.startswith("socket:[") else None
        if inode in clients:
            continue
        out.append(names.get(inode, target) if inode else target)
    return sorted(out)


def _to_sandbox(fd: str) -> bool:
    """Whether an fd description from :func:`server_fds` (``tcp LOCAL->REMOTE stXX``)
    is a TCP socket to an address in the sandboxes' outer range :data:`OUTER`."""
    import ipaddress

    m = re.match(r"^tcp [0-9A-F:]+->([0-9A-F]{8}):[0-9A-F]{4} ", fd)
    if not m:
        return False
    addr = ipaddress.IPv4Address(bytes(reversed(bytes.fromhex(m.group(1)))))  # /proc/net/tcp: little-endian
    return addr in ipaddress.ip_network(OUTER)


def host_state(data: Path, pid: int, spare: set[int], port: int) -> dict[str, int]:
    """Counts of what the server holds on the host (see the module doc)."""
    ns = [l.split()[0] for l in _sh(["ip", "netns", "list"]).splitlines() if l.strip()]
    ns = [n for n in ns if re.match(rf"^{PREFIX}\d+s?$", n) and int(n[len(PREFIX):].rstrip("s")) not in spare]
    links = [l.split(":")[1].strip().split("@")[0] for l in _sh(["ip", "-o", "link"]).splitlines() if l.count(":") > 1]
    veths = [n for n in links if re.match(rf"^{PREFIX}v\d+$", n) and int(n[len(PREFIX) + 1:]) not in spare]
    mounts = [l for l in Path("/proc/self/mounts").read_text().splitlines() if str(data) in l.split()[1]]
    procs = [p for p in _sh(["pgrep", "-af", "runsc"]).splitlines() if f"--root={data / 'runsc'}" in p]
    rules = [l for l in _sh(["iptables-save"]).splitlines() if PREFIX in l or PREFIX.upper() in l]
    fds = server_fds(pid, port)
    host_state.fd_targets = fds  # type: ignore[attr-defined]
    repo_bytes = repository_bytes(data / "snapshots" / "repository")
    import sqlite3

    try:
        db = sqlite3.connect(f"file:{data / 'state.db'}?mode=ro", uri=True)
        rows = db.execute("SELECT count(*) FROM sandboxes").fetchone()[0]
        db.close()
    except sqlite3.Error:
        rows = -1
    return {"netns": len(ns), "veth": len(veths), "mounts": len(mounts), "runsc": len(procs),
            "iptables_rules": len(rules), "server_fds": len(fds), "repository_bytes": repo_bytes,
            "state_rows": rows}


class Soak:
    def __init__(self, url: str, key: str):
        self.c = httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, timeout=120)
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self.errors: list[str] = []

    async def create(self) -> tuple[str, str]:
        r = await self.c.post("/sandboxes", json={"templateID": "base", "timeout": 300})
        if r.status_code != 201:
            raise RuntimeError(f"create: {r.status_code} {r.text[:200]}")
        return r.json()["sandboxID"], r.json()["envdAccessToken"]

    async def run(self, sid: str, token: str, cmd: str, timeout: float = 60) -> str:
        """Run ``cmd`` through envd's Connect API (what the SDK does), return stdout."""
        from e2b import AsyncSandbox

        sbx = await AsyncSandbox.connect(sid)
        r = await sbx.commands.run(cmd, timeout=timeout)
        return r.stdout

    async def kill(self, sid: str) -> None:
        r = await self.c.delete(f"/sandboxes/{sid}")
        if r.status_code not in (204, 404):
            raise RuntimeError(f"kill {sid}: {r.status_code} {r.text}")

    async def cycle(self, scenario: str) -> None:
        try:
            sid, token = await self.create()
        except Exception as e:  # noqa: BLE001 — counted and reported
            self.outcomes[f"{scenario} create error"] += 1
            self.errors.append(f"{scenario}: {e!r}"[:300])
            return
        try:
            if scenario == "exec":
                assert (await self.run(sid, token, "echo ok")).strip() == "ok"
            elif scenario == "pause":
                await self.run(sid, token, "echo kept > /home/user/f")
                (await self.c.post(f"/sandboxes/{sid}/pause")).raise_for_status()
                (await self.c.post(f"/sandboxes/{sid}/resume", json={"timeout": 300})).raise_for_status()
                assert (await self.run(sid, token, "cat /home/user/f")).strip() == "kept"
            elif scenario == "fork":
                r = await self.c.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 120})
                r.raise_for_status()
                # E2B's fork answer: one {"sandbox": Sandbox} or {"error": …} per child.
                kids = [k["sandbox"]["sandboxID"] for k in r.json() if "sandbox" in k]
                self.outcomes["fork children"] += len(kids)
                try:
                    assert kids, f"fork gave no child: {r.text[:300]}"
                    k = (await self.c.get(f"/sandboxes/{kids[0]}")).json()
                    assert (await self.run(kids[0], k.get("envdAccessToken", ""), "echo kid")).strip() == "kid"
                finally:
                    for k in kids:
                        await self.kill(k)
            elif scenario == "kill-pause":
                op = asyncio.create_task(self.c.post(f"/sandboxes/{sid}/pause"))
                await asyncio.sleep(random.uniform(0, 0.3))
                await self.kill(sid)
                await asyncio.gather(op, return_exceptions=True)
            elif scenario == "kill-fork":
                op = asyncio.create_task(self.c.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 60}))
                await asyncio.sleep(random.uniform(0, 0.3))
                await self.kill(sid)
                res = (await asyncio.gather(op, return_exceptions=True))[0]
                if isinstance(res, httpx.Response) and res.status_code == 201:
                    for k in res.json():  # E2B's fork answer: {"sandbox": Sandbox} or {"error": …}
                        if "sandbox" in k:
                            await self.kill(k["sandbox"]["sandboxID"])
                # Children the client was never told of (the fork answered an error, or
                # its answer left them out): they would live until their timeout. Found
                # by lineage metadata and counted; goal 0.
                for _ in range(6):  # some may still be starting when the fork call ends
                    orphans = [s["sandboxID"] for s in (await self.c.get("/v2/sandboxes")).json()
                               if s.get("metadata", {}).get(PARENT_KEY) == sid]
                    self.outcomes["kill-fork orphan children"] += len(orphans)
                    for k in orphans:
                        await self.kill(k)
                    await asyncio.sleep(0.5)
            elif scenario == "kill-exec":
                op = asyncio.create_task(self.run(sid, token, "sleep 30", timeout=60))
                await asyncio.sleep(random.uniform(0.2, 1.0))
                await self.kill(sid)
                await asyncio.gather(op, return_exceptions=True)
            self.outcomes[f"{scenario} ok"] += 1
        except Exception as e:  # noqa: BLE001 — counted and reported, the soak goes on
            self.outcomes[f"{scenario} error"] += 1
            self.errors.append(f"{scenario}: {e!r}"[:300])
        finally:
            await self.kill(sid)

    async def quiet_state(self, data: Path, pid: int, port: int, timeout_s: float = 60) -> dict[str, int]:
        """:func:`host_state` once the server is idle: the same figures (spare slots
        built, fds) twice 1 s apart, so slots still being built around the baseline do
        not read as leaks (or as negative ones)."""
        last, deadline = None, time.time() + timeout_s
        while True:
            await asyncio.sleep(1)
            spare = set((await self.c.get("/metrics/node")).json()["spareSlots"])
            state = host_state(data, pid, spare, port)
            if state == last or time.time() > deadline:
                return state
            last = state

    async def settle(self, timeout_s: float = 120) -> dict:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for s in (await self.c.get("/v2/sandboxes")).json():
                await self.kill(s["sandboxID"])
            node = (await self.c.get("/metrics/node")).json()
            if not node["pausesInFlight"] and not node["gcInFlight"] and not (await self.c.get("/v2/sandboxes")).json():
                return node
            await asyncio.sleep(0.5)
        return (await self.c.get("/metrics/node")).json()


def start(data: Path, templates: Path) -> tuple[subprocess.Popen, str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    key = "e2b_" + secrets.token_hex(20)
    _clean_previous(data)
    shutil.rmtree(data, ignore_errors=True)
    env = dict(os.environ, FORKYARD_DATA_DIR=str(data), FORKYARD_TEMPLATES_DIR=str(templates), FORKYARD_API_KEY=key,
               FORKYARD_PORT=str(port), FORKYARD_NET_PREFIX=PREFIX, FORKYARD_OUTER_NET=OUTER)
    # the log holds ids and tokens: 0600 (also an older one), in a 0700 directory
    log = os.fdopen(os.open(data.parent / f"{data.name}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab")
    os.fchmod(log.fileno(), 0o600)
    proc = subprocess.Popen([sys.executable, "-m", "forkyard.cli.main", "serve", "--no-build-base",
                             "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
                return proc, url, key
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"server did not start; see {data.parent / (data.name + '.log')}")


async def soak_run(args, proc: subprocess.Popen, url: str, key: str) -> tuple[dict, dict, Soak, float]:
    """Baseline, the cycles, settle, final state: ``(before, after, soak, seconds)``."""
    soak = Soak(url, key)
    port = int(url.rsplit(":", 1)[1])
    try:
        node = await soak.settle()
        before = await soak.quiet_state(args.data, proc.pid, port)
        fds_before = list(host_state.fd_targets)  # type: ignore[attr-defined]
        t0 = time.time()
        sem = asyncio.Semaphore(args.concurrency)
        pool = [s for s in args.scenarios.split(",") if s in SCENARIOS] or list(SCENARIOS)
        plan = [random.choice(pool) for _ in range(args.cycles)]

        async def one(scenario: str) -> None:
            async with sem:
                await soak.cycle(scenario)

        await asyncio.gather(*(one(s) for s in plan))
        took = time.time() - t0
        # Every cycle kills what it made: a sandbox still listed here (before the final
        # sweep) was left behind, e.g. a fork child nobody was told of.
        soak.left_live = [s["sandboxID"] for s in (await soak.c.get("/v2/sandboxes")).json()]
        node = await soak.settle()
        after = await soak.quiet_state(args.data, proc.pid, port)
        rest = list(host_state.fd_targets)  # type: ignore[attr-defined]
        gone = []
        for t in fds_before:
            if t in rest:
                rest.remove(t)
            else:
                gone.append(t)
        soak.new_fds, soak.gone_fds = rest, gone
    finally:
        await soak.c.aclose()
    return before, after, soak, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=1000, help="cycles to run (default 1000)")
    ap.add_argument("--concurrency", type=int, default=4, help="cycles in flight at once (default 4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list to draw from (default: all)")
    ap.add_argument("--data", type=Path, default=Path("/var/lib/forkyard-soak/server"))
    args = ap.parse_args()
    random.seed(args.seed)
    args.data.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(args.data.parent, 0o700)
    proc, url, key = start(args.data, templates_dir())
    try:
        before, after, soak, took = asyncio.run(soak_run(args, proc, url, key))
    finally:
        proc.terminate()
        proc.wait(60)
    # Collect what the image GC keeps for its grace period (FORKYARD_GC_GRACE_S, 1 h):
    # with the server stopped no commit is in flight, so grace 0 is safe here.
    from forkyard.repository.config import RepoConfig
    from forkyard.repository.repo import Repository

    repo_dir = args.data / "snapshots" / "repository"
    gc = Repository(RepoConfig.from_env(repo_dir, env={}).open_backend()).gc(0) if repo_dir.is_dir() else {}
    after["repository_bytes"] = repository_bytes(repo_dir)
    leaks = {k: after[k] - before[k] for k in before}
    leaks["sandboxes_left_by_cycles"] = len(getattr(soak, "left_live", []))
    report = {"cycles": args.cycles, "concurrency": args.concurrency, "seconds": round(took, 1),
              "outcomes": dict(sorted(soak.outcomes.items())), "before": before, "after": after, "leaked": leaks,
              "final_gc": {k: gc.get(k) for k in ("chunks_freed", "bytes_freed", "chunks_kept")},
              "new_fds": getattr(soak, "new_fds", []), "gone_fds": getattr(soak, "gone_fds", []),
              "sockets_to_sandboxes": [f for f in getattr(soak, "new_fds", []) if _to_sandbox(f)],
              "errors": soak.errors[:20]}
    print(json.dumps(report, indent=1))
    from forkyard.network.slots import NetnsNetwork

    NetnsNetwork(None, outer_net=OUTER, prefix=PREFIX).teardown_host()
    return 1 if any(v > 0 for v in leaks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
