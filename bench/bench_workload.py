"""Workload speed: the same agent steps inside a sandbox and natively, in one run (issue 18 §6).

Each step is a bash snippet run as ``user`` in ``~/bench`` with an untimed set-up; the
timed part is measured inside, with bash's ``$EPOCHREALTIME`` (no process of its own),
so neither the command round trip nor the chroot's start counts:

  files        2,000 small files created from bash (``echo > f``: open/write/close)
  spawn        100 process spawns (``/bin/true``)
  git_commit   ``git init && git add -A && git commit`` of 2,000 files in 20 directories
  git_status   ``git status`` of that repo with one file changed
  python       python3 start-up (``python3 -c pass``)
  gcc          ``gcc -O1`` of a hello world (cpp, cc1, as, collect2, ld)
  sqlite       100 committed transactions (Python's sqlite3; each commit fsyncs)
  write_200mb  ``head -c 200M /dev/zero > big``

"sandbox" is a ``base`` sandbox of a server started from this checkout (the e2b SDK's
``commands.run``); "native" is the same snippet in a host chroot of the same template
rootfs (an overlayfs over it, private mount and PID namespaces: tests/workloads/_chroot.py),
as ``user``, writing to a fresh ext4 disk image as the sandbox does (:class:`Native`). The two alternate per step and swap order every round, so both see the same
host load; the host's 1-minute load average is printed for every round. Printed per step:
best of N and p50/p95 (ms), sandbox and native, and the ratio of the best times; then the
whole set — the sum of the steps' best times (and of their p50s), sandbox over native —
and the geometric mean of the per-step ratios.

Not the same on both sides: ``fsync`` inside a sandbox reaches gVisor's file store (on the
sandbox's disk image) without forcing the host disk, so the sqlite step (and any
fsync-heavy work) reads faster inside than a native run that really syncs.

Then the RL rollout loop (``--rollouts R`` rounds, default 2): a source sandbox holding a
2,000-file git repo is forked 16 times (``POST /sandboxes/{id}/fork``); each child runs one
step (python + ``git status`` + gcc of a hello world, run) and is killed; a round's
wall time, from the fork request to the last kill, gives rollouts/min = 16 / wall × 60.

Usage: ``python bench/bench_workload.py [-n 7] [--rollouts 2] [--steps a,b] [--runsc-flags '...']``.
``--runsc-flags`` (experiments): extra runsc flags for every sandbox of this run, through a
wrapper given as ``FORKYARD_RUNSC`` (inserted just before runsc's subcommand, so they
override the driver's). State under ``$FORKYARD_BENCH_DATA`` (default
/var/lib/forkyard-bench); templates from ``$FORKYARD_TEMPLATES_DIR``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests" / "workloads"))
from _common import DATA, pct, start_server, stop_server, templates_dir  # noqa: E402

import _chroot  # noqa: E402  (tests/workloads/_chroot.py)

#: A 2,000-file tree in 20 directories of 100 (the workload suite's git repo).
MAKE_TREE = r"""python3 - "$1" <<'EOF'
import os, sys
for i in range(2000):
    d = os.path.join(sys.argv[1], f"d{i // 100}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, f"f{i}.txt"), "w") as f:
        f.write(f"line {i}\n")
EOF"""
HELLO = r"""cat > hello.c <<'EOF'
#include <stdio.h>
int main(int argc, char **argv) { printf("hello %s\n", argc > 1 ? argv[1] : "world"); return 0; }
EOF"""
SQLITE = r"""python3 - <<'EOF'
import sqlite3
db = sqlite3.connect("t.db")
db.execute("create table t (k integer primary key, v text)")
for i in range(100):
    with db:
        db.execute("insert into t (v) values (?)", (f"v{i}",))
db.close()
EOF"""
GIT = "git -c user.name=b -c user.email=b@x"

#: (name, untimed set-up, timed body, untimed clean-up), run in that order as one script.
STEPS: list[tuple[str, str, str, str]] = [
    ("files", "rm -rf files", "mkdir files && for i in {1..2000}; do echo $i > files/f$i; done", ""),
    ("spawn", "", "for i in {1..100}; do /bin/true; done", ""),
    ("git_commit", "rm -rf repo && mt repo", f"cd repo && git init -q && git add -A && {GIT} commit -qm init", ""),
    ("git_status", "echo x >> repo/d3/f300.txt", "cd repo && git status >/dev/null", ""),
    ("python", "", "python3 -c pass", ""),
    ("gcc", HELLO, "gcc -O1 -o hello hello.c", ""),
    ("sqlite", "rm -f t.db", SQLITE, ""),
    ("write_200mb", "rm -f big", "head -c 200M /dev/zero > big", "rm -f big"),
]
#: The rollout step each fork child runs.
ROLLOUT_STEP = (f"cd ~/repo && python3 -c 'import json; print(json.dumps(1))' && git status --porcelain "
                f"&& gcc -O1 -o /tmp/h ~/hello.c && /tmp/h")


def script(setup: str, body: str, cleanup: str) -> str:
    """The bash script of one step: prints ``T <start> <end>`` (s, ``$EPOCHREALTIME``)."""
    return "\n".join([
        "set -e", f"mt() {{ {MAKE_TREE}\n}}", "mkdir -p ~/bench && cd ~/bench", setup or ":",
        "t0=$EPOCHREALTIME", f"{{ {body}\n}}", "t1=$EPOCHREALTIME", "cd ~/bench", cleanup or ":", 'echo "T $t0 $t1"',
    ])


def parse_ms(out: str) -> float:
    for line in out.splitlines():
        if line.startswith("T "):
            _, a, b = line.split()
            return (float(b) - float(a)) * 1000
    raise RuntimeError(f"no timing in output: {out[-2000:]}")


def runsc_wrapper(flags: str, real: str) -> str:
    """A script that runs ``real`` with ``flags`` inserted before runsc's subcommand
    (the first argument not starting with ``-``). It names patch 0002's annotation so
    the driver still finds it (it searches the binary for the name)."""
    path = DATA / "runsc-wrapper"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/usr/bin/env python3
# bench_workload.py runsc wrapper (dev.forkyard.tmp)
import os, shlex, sys
args = sys.argv[1:]
i = next((k for k, a in enumerate(args) if not a.startswith("-")), len(args))
extra = shlex.split({flags!r})
os.execv({real!r}, [{real!r}, *args[:i], *(extra if i < len(args) else []), *args[i:]])
""")
    path.chmod(0o755)
    return str(path)


class Native:
    """The steps in a host chroot of ``rootfs``, as ``user``; its writes (an overlayfs
    upper layer, kept across steps as the sandbox's disk is) go to a fresh ext4 image of
    the sandbox's disk size under ``scratch``, loop-mounted as the sandbox's disk is,
    with ext4's default features (a journal, as a VM's root disk has).

    Neither the host's own filesystem nor an image made like the sandbox's (no
    journal): without a journal ext4 refuses to reuse an inode deleted less than ~30 s
    before and scans inode tables for one (``recently_deleted`` in
    ``__ext4_new_inode``), so creating 2,000 files where 2,000 were just deleted cost
    0.5 s the first time and 4.2 s the third (1.3 s of system time), against
    0.6-0.8 s with a journal (measured on this host). Inside a sandbox the files are
    in gVisor's in-memory overlay, only their data in one file on that disk, so no
    ext4 inode is made per file."""

    def __init__(self, rootfs: Path, scratch: Path, disk_mb: int = 4096):
        self.rootfs, self.scratch = rootfs, scratch
        self.close()
        scratch.mkdir(parents=True)
        image = scratch / "disk.img"
        with open(image, "wb") as f:
            f.truncate(disk_mb << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "nodiscard", str(image)],
                       check=True, capture_output=True)
        (scratch / "fs").mkdir()
        subprocess.run(["mount", "-o", "loop,nosuid,nodev", str(image), str(scratch / "fs")], check=True)
        #: The cgroup the chroot runs in (its CPU time is counted).
        self.cgroup = cgroup_dir(f"forkyard-bench-native-{os.getpid()}")
        self.cgroup.mkdir(exist_ok=True)

    def run(self, text: str) -> str:
        r = _chroot.run(self.rootfs, self.scratch / "fs", text, {}, timeout=600, cgroup=self.cgroup)
        if r.returncode != 0:
            raise RuntimeError(f"native step failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
        return r.stdout

    def close(self) -> None:
        fs = self.scratch / "fs"
        if fs.is_dir() and os.path.ismount(fs):
            subprocess.run(["umount", str(fs)], check=False)
        shutil.rmtree(self.scratch, ignore_errors=True)
        cgroup = getattr(self, "cgroup", None)
        if cgroup is not None:
            try:
                cgroup.rmdir()
            except OSError:
                pass


def cpu_ns(cgroup: Path) -> int:
    """CPU time (ns) used so far by cgroup directory ``cgroup`` (v1 ``cpuacct`` or v2)."""
    v1 = cgroup / "cpuacct.usage"
    if v1.exists():
        return int(v1.read_text())
    stat = dict(line.split() for line in (cgroup / "cpu.stat").read_text().splitlines() if line.strip())
    return int(stat["usage_usec"]) * 1000


def cgroup_dir(rel: str) -> Path:
    """``rel`` under cgroup v1's ``cpuacct`` hierarchy when the host has it, else v2's root."""
    v1 = Path("/sys/fs/cgroup/cpuacct")
    return (v1 if v1.is_dir() else Path("/sys/fs/cgroup")) / rel.lstrip("/")


def steps_table(sbx, native: Native, names: list[str], n: int, verbose: bool = False) -> None:
    """Run the steps ``names`` n rounds (after one warm-up round), alternating sandbox and
    native per step, and print the table. Each side's CPU time per step is its cgroup's
    (the sandbox's: sentry, gofer and application; native: the chroot's processes)
    over the step's command, less that of an empty step (starting the command)."""
    from forkyard.runtime.gvisor.spec import cgroup_path

    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    loads = []
    sbx_cg = cgroup_dir(cgroup_path(sbx.sandbox_id))

    def in_sbx(text: str) -> str:
        return sbx.commands.run(text, user="user", timeout=600, request_timeout=300).stdout

    def progress(what: str) -> None:
        if verbose:
            print(f"  {time.strftime('%H:%M:%S')} {what}", file=sys.stderr, flush=True)

    def timed(side: str, text: str) -> tuple[float, float]:
        cg = sbx_cg if side == "sandbox" else native.cgroup
        c0 = cpu_ns(cg)
        out = in_sbx(text) if side == "sandbox" else native.run(text)
        return parse_ms(out), (cpu_ns(cg) - c0) / 1e6

    steps = [("empty", "", ":", "")] + [s for s in STEPS if s[0] in names]
    for name, *parts in steps:  # a warm-up round (page cache, first runs), not counted
        progress(f"warm-up {name}")
        in_sbx(script(*parts))
        native.run(script(*parts))
    for rnd in range(n):
        loads.append(os.getloadavg()[0])
        sides = ["sandbox", "native"] if rnd % 2 == 0 else ["native", "sandbox"]
        for name, *parts in steps:
            for side in sides:
                progress(f"round {rnd} {name} {side}")
                w, c = timed(side, script(*parts))
                wall.setdefault((name, side), []).append(w)
                cpu.setdefault((name, side), []).append(c)
    loads.append(os.getloadavg()[0])

    base = {side: pct(cpu[("empty", side)], 50) for side in ("sandbox", "native")}
    print(f"\nworkload steps, n={n} rounds (ms); host 1-min load per round: " + " ".join(f"{x:.1f}" for x in loads))
    print(f"{'':12} {'---------- sandbox ----------':>34}   {'----------- native -----------':>34}   "
          f"{'------ ratio ------':>21}")
    print(f"{'step':<12} {'best':>8} {'p50':>8} {'p95':>8} {'cpu p50':>8}   {'best':>8} {'p50':>8} {'p95':>8} "
          f"{'cpu p50':>8}   {'best':>6} {'p50':>6} {'cpu':>6}")
    tot = dict.fromkeys(("sb", "s50", "sc", "nb", "n50", "nc"), 0.0)
    logs = []
    for name, *_ in steps[1:]:
        s, nat = wall[(name, "sandbox")], wall[(name, "native")]
        sc = max(pct(cpu[(name, "sandbox")], 50) - base["sandbox"], 0.0)
        nc = max(pct(cpu[(name, "native")], 50) - base["native"], 0.0)
        row = {"sb": min(s), "s50": pct(s, 50), "sc": sc, "nb": min(nat), "n50": pct(nat, 50), "nc": nc}
        for k, v in row.items():
            tot[k] += v
        logs.append(math.log(row["sb"] / row["nb"]))
        print(f"{name:<12} {row['sb']:8.1f} {row['s50']:8.1f} {pct(s, 95):8.1f} {sc:8.1f}   {row['nb']:8.1f} "
              f"{row['n50']:8.1f} {pct(nat, 95):8.1f} {nc:8.1f}   {row['sb'] / row['nb']:5.2f}x "
              f"{row['s50'] / row['n50']:5.2f}x {sc / nc if nc else float('nan'):5.2f}x")
    print(f"{'whole set':<12} {tot['sb']:8.1f} {tot['s50']:8.1f} {'':8} {tot['sc']:8.1f}   {tot['nb']:8.1f} "
          f"{tot['n50']:8.1f} {'':8} {tot['nc']:8.1f}   {tot['sb'] / tot['nb']:5.2f}x {tot['s50'] / tot['n50']:5.2f}x "
          f"{tot['sc'] / tot['nc']:5.2f}x")
    print(f"geometric mean of the step ratios (best): {math.exp(sum(logs) / len(logs)):.2f}x; "
          f"CPU of an empty command (subtracted): sandbox {base['sandbox']:.1f} ms, native {base['native']:.1f} ms")


def rollouts(url: str, key: str, rounds: int, fan: int = 16) -> None:
    from e2b import Sandbox

    api = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=900)
    src = Sandbox.create("base", timeout=3600)
    try:
        setup = "\n".join(["set -e", f"mt() {{ {MAKE_TREE}\n}}", "cd ~", HELLO, "mt repo", "cd repo",
                           f"git init -q && git add -A && {GIT} commit -qm init", "echo x >> d3/f300.txt"])
        src.commands.run(setup, user="user", timeout=600, request_timeout=300)

        def child(sid: str) -> tuple[float, float]:
            t = time.perf_counter()
            r = Sandbox.connect(sid).commands.run(ROLLOUT_STEP, user="user", timeout=600, request_timeout=300)
            assert "hello world" in r.stdout, r.stdout
            t2 = time.perf_counter()
            api.delete(f"/sandboxes/{sid}").raise_for_status()
            return (t2 - t) * 1000, (time.perf_counter() - t2) * 1000

        walls, forks, steps, kills = [], [], [], []
        with concurrent.futures.ThreadPoolExecutor(fan) as pool:
            for _ in range(rounds):
                t0 = time.perf_counter()
                r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": fan, "timeout": 600})
                assert r.status_code == 201, r.text[:2000]
                ids = [e["sandbox"]["sandboxID"] for e in r.json() if "sandbox" in e]
                assert len(ids) == fan, r.text[:2000]
                forks.append((time.perf_counter() - t0) * 1000)
                for s, k in pool.map(child, ids):
                    steps.append(s)
                    kills.append(k)
                walls.append(time.perf_counter() - t0)
        print(f"\nRL rollout loop: fork {fan} -> python + git status + gcc in each -> kill; {rounds} rounds, "
              f"host 1-min load {os.getloadavg()[0]:.1f}")
        print(f"  round wall (s): {' '.join(f'{w:.2f}' for w in walls)}   "
              f"rollouts/min best {fan / min(walls) * 60:.0f}, median {fan / pct(walls, 50) * 60:.0f}")
        print(f"  fork {fan} (ms): p50 {pct(forks, 50):.0f}   child step (ms): p50 {pct(steps, 50):.0f} "
              f"p95 {pct(steps, 95):.0f}   kill (ms): p50 {pct(kills, 50):.0f}")
    finally:
        src.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=7, help="rounds per step (best of n)")
    ap.add_argument("--rollouts", type=int, default=2, help="rounds of the fork-16 rollout loop (0: skip)")
    ap.add_argument("--steps", default=",".join(s[0] for s in STEPS), help="comma-separated step names")
    ap.add_argument("-v", action="store_true", help="print progress to stderr")
    ap.add_argument("--runsc-flags", default="", help="extra runsc flags (experiments)")
    args = ap.parse_args()
    names = args.steps.split(",") if args.steps else []
    unknown = set(names) - {s[0] for s in STEPS}
    if unknown:
        ap.error(f"unknown steps {sorted(unknown)}")

    templates = templates_dir()
    from forkyard.config import Settings

    real = os.path.realpath(shutil.which(Settings().runsc) or Settings().runsc)
    if args.runsc_flags:
        os.environ["FORKYARD_RUNSC"] = runsc_wrapper(args.runsc_flags, real)
    version = subprocess.run([real, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    print(f"forkyard workload benchmark: {version} ({real}); extra flags: {args.runsc_flags or 'none'}; "
          f"{os.cpu_count()} CPUs, host 1-min load {os.getloadavg()[0]:.1f}")
    proc, url, key = start_server(templates)
    native = Native(templates / "base" / "rootfs", DATA / "native")
    try:
        if names:
            from e2b import Sandbox

            sbx = Sandbox.create("base", timeout=3600)
            try:
                steps_table(sbx, native, names, args.n, args.v)
            finally:
                sbx.kill()
        if args.rollouts:
            rollouts(url, key, args.rollouts)
    finally:
        native.close()
        stop_server(proc)


if __name__ == "__main__":
    main()
