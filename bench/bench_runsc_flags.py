"""runsc options A/B: two sandboxes (A booted with extra runsc flags, B with the driver's
defaults) and the native chroot, alternated per step, in one run (issue 18 §6).

bench_workload.py compares one flag set with native per run; on this shared 2-core host
the load moved from 2 to 40 between runs and the native side's times with it, so two
runs' ratios could not tell a 10 % change from noise. Here A, B and native take turns
step by step (the order rotates through all six permutations), so A/B compares runtimes
under the same load. Printed per step: best wall time (ms) and p50 cgroup CPU time (ms,
less an empty command's) of A, B and native, and the ratios A/N, B/N, A/B of both.

Steps: bench_workload.py's (``--steps``) and these probes, which isolate one cost each:

  py_getppid        100,000 ``getppid()`` from python3 (the bare syscall round trip)
  py_stat           50,000 ``stat()`` of a file in the template rootfs (lower layer)
  py_open_close     20,000 ``open()``+``close()`` of a file in the writable layer
  py_create_unlink  5,000 × create, write 1 byte, close, unlink
  dd_null_8k        ``dd`` /dev/zero → /dev/null, 25,600 × 8 KiB (read+write syscalls only)
  dd_file_8k        the same into a file (what ``head -c 200M`` does)
  dd_file_1m        200 × 1 MiB into a file (the same bytes, 128× fewer syscalls)
  py_fork           50 × ``fork()`` + ``_exit`` + ``waitpid`` from python3 (no exec)
  py_touch_mem      touch every page of a fresh 200 MiB bytearray (page faults)

A's flags go to ``runsc run``/``restore``/``create`` only (the wrapper reads them from a
file when the sandbox boots), so ``runsc list``/``exec``/``kill`` keep the defaults.

Usage: ``python bench/bench_runsc_flags.py --flags='--systrap-disable-fast-path' [-n 3]
[--steps probes|all|a,b]``. State under ``$FORKYARD_BENCH_DATA`` as bench_workload.py.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_workload as bw  # noqa: E402
from _common import DATA, pct, start_server, stop_server, templates_dir  # noqa: E402


def _py(body: str) -> str:
    return f"python3 -c '{body}'"


#: (name, untimed set-up, timed body, untimed clean-up), as :data:`bench_workload.STEPS`.
PROBES: list[tuple[str, str, str, str]] = [
    ("py_getppid", "", _py("import os\nfor _ in range(100000): os.getppid()"), ""),
    ("py_stat", "", _py('import os\nfor _ in range(50000): os.stat("/usr/bin/git")'), ""),
    ("py_open_close", "touch x", _py('import os\nfor _ in range(20000): os.close(os.open("x", os.O_RDONLY))'), ""),
    ("py_create_unlink", "", _py('import os\nfor i in range(5000):\n  fd = os.open("y", os.O_CREAT | os.O_WRONLY)'
                                 '\n  os.write(fd, b"x"); os.close(fd); os.unlink("y")'), ""),
    ("dd_null_8k", "", "dd if=/dev/zero of=/dev/null bs=8k count=25600 status=none", ""),
    ("dd_file_8k", "rm -f big", "dd if=/dev/zero of=big bs=8k count=25600 status=none", "rm -f big"),
    ("dd_file_1m", "rm -f big", "dd if=/dev/zero of=big bs=1M count=200 status=none", "rm -f big"),
    ("py_fork", "", _py("import os\nfor _ in range(50):\n  p = os.fork()\n  if p == 0: os._exit(0)"
                        "\n  os.waitpid(p, 0)"), ""),
    ("py_touch_mem", "", _py("b = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1"), ""),
]
#: The six orders of A, B and native, one per round in turn.
ORDERS = ["ABN", "BNA", "NAB", "NBA", "ANB", "BAN"]


def boot_wrapper(flag_file: Path, real: str) -> str:
    """A runsc wrapper that adds the flags in ``flag_file`` (read at each call; none when
    missing) before the subcommand of ``run``/``restore``/``create`` and execs ``real``.
    Names patch 0002's annotation (dev.forkyard.tmp) so the driver still finds it."""
    path = DATA / "runsc-boot-wrapper"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""#!/usr/bin/env python3
# bench_runsc_flags.py runsc wrapper (dev.forkyard.tmp)
import os, shlex, sys
args = sys.argv[1:]
i = next((k for k, a in enumerate(args) if not a.startswith("-")), len(args))
extra = []
if i < len(args) and args[i] in ("run", "restore", "create"):
    try:
        extra = shlex.split(open({str(flag_file)!r}).read())
    except OSError:
        pass
os.execv({real!r}, [{real!r}, *args[:i], *extra, *args[i:]])
""")
    path.chmod(0o755)
    return str(path)


def compare(sides: dict, steps: list, n: int) -> None:
    """Run ``steps`` n rounds (after a warm-up round) on ``sides`` (``"A"``, ``"B"``,
    ``"N"`` → ``(run(text) -> stdout, cgroup dir)``) and print the table."""
    def timed(side: str, text: str) -> tuple[float, float]:
        run, cg = sides[side]
        c0 = bw.cpu_ns(cg)
        out = run(text)
        return bw.parse_ms(out), (bw.cpu_ns(cg) - c0) / 1e6

    all_steps = [("empty", "", ":", "")] + steps
    for _, *parts in all_steps:
        for side in "ABN":
            sides[side][0](bw.script(*parts))
    wall: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    loads = []
    for rnd in range(n):
        loads.append(os.getloadavg()[0])
        for name, *parts in all_steps:
            for side in ORDERS[rnd % len(ORDERS)]:
                w, c = timed(side, bw.script(*parts))
                wall.setdefault((name, side), []).append(w)
                cpu.setdefault((name, side), []).append(c)
    base = {s: pct(cpu[("empty", s)], 50) for s in "ABN"}
    print(f"host 1-min load per round: {' '.join(f'{x:.1f}' for x in loads)}")
    print(f"{'step':<17}{'A best':>8}{'B best':>8}{'N best':>8} |{'A cpu':>7}{'B cpu':>7}{'N cpu':>7} |"
          f"{'A/N':>6}{'B/N':>6}{'A/B':>6} wall |{'A/N':>6}{'B/N':>6}{'A/B':>6} cpu")
    tot = {k: 0.0 for k in ("wA", "wB", "wN", "cA", "cB", "cN")}

    def line(name: str, w: dict, c: dict) -> None:
        print(f"{name:<17}{w['A']:8.0f}{w['B']:8.0f}{w['N']:8.0f} |{c['A']:7.0f}{c['B']:7.0f}{c['N']:7.0f} |"
              f"{w['A'] / w['N']:6.2f}{w['B'] / w['N']:6.2f}{w['A'] / w['B']:6.2f}      |"
              f"{c['A'] / c['N']:6.2f}{c['B'] / c['N']:6.2f}{c['A'] / c['B']:6.2f}")

    for name, *_ in steps:
        w = {s: min(wall[(name, s)]) for s in "ABN"}
        c = {s: max(pct(cpu[(name, s)], 50) - base[s], 0.01) for s in "ABN"}
        for s in "ABN":
            tot["w" + s] += w[s]
            tot["c" + s] += c[s]
        line(name, w, c)
    line("whole set", {s: tot["w" + s] for s in "ABN"}, {s: tot["c" + s] for s in "ABN"})
    print("CPU of an empty command (subtracted, ms): " + ", ".join(f"{s} {v:.1f}" for s, v in base.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flags", required=True, help="runsc flags of sandbox A (use --flags='--x=y')")
    ap.add_argument("-n", type=int, default=3, help="rounds per step (best of n)")
    ap.add_argument("--steps", default="all", help="'all' (bench_workload's), 'probes', or comma-separated names")
    args = ap.parse_args()
    known = {s[0]: s for s in bw.STEPS + PROBES}
    if args.steps in ("all", "probes"):
        steps = bw.STEPS if args.steps == "all" else PROBES
    else:
        names = args.steps.split(",")
        unknown = set(names) - set(known)
        if unknown:
            ap.error(f"unknown steps {sorted(unknown)}")
        if "git_status" in names and "git_commit" not in names:
            ap.error("git_status needs git_commit (it changes the repo git_commit makes)")
        steps = [known[x] for x in names]

    from e2b import Sandbox

    from forkyard.config import Settings
    from forkyard.runtime.gvisor.spec import cgroup_path

    real = os.path.realpath(shutil.which(Settings().runsc) or Settings().runsc)
    flag_file = DATA / "runsc-boot-flags"
    os.environ["FORKYARD_RUNSC"] = boot_wrapper(flag_file, real)
    print(f"runsc flags A/B: A = {args.flags!r}, B = the driver's defaults; n={args.n}; "
          f"{os.cpu_count()} CPUs, host 1-min load {os.getloadavg()[0]:.1f}", flush=True)
    templates = templates_dir()
    proc, _, _ = start_server(templates)
    native = bw.Native(templates / "base" / "rootfs", DATA / "native")
    sandboxes = {}
    try:
        flag_file.write_text(args.flags)
        sandboxes["A"] = Sandbox.create("base", timeout=3600)
        flag_file.write_text("")
        sandboxes["B"] = Sandbox.create("base", timeout=3600)

        def runner(sbx):
            return lambda text: sbx.commands.run(text, user="user", timeout=600, request_timeout=300).stdout

        sides = {k: (runner(s), bw.cgroup_dir(cgroup_path(s.sandbox_id))) for k, s in sandboxes.items()}
        sides["N"] = (native.run, native.cgroup)
        compare(sides, steps, args.n)
    finally:
        for s in sandboxes.values():
            try:
                s.kill()
            except Exception as e:  # noqa: BLE001 (best effort; the server's stop kills the rest)
                print(f"warning: kill {s.sandbox_id}: {e}", file=sys.stderr)
        flag_file.unlink(missing_ok=True)
        native.close()
        stop_server(proc)


if __name__ == "__main__":
    main()
