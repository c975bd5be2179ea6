"""Volume benchmark (issue 23 item 5): 100 MiB written and read inside a sandbox, on an
E2B volume (``volumeMounts``) and on the sandbox's own disk, through the real e2b SDK.

Per round, in one sandbox that mounts the volume at ``/mnt``:
  * **write**: ``dd`` of 100 MiB of random bytes (made first in ``/dev/shm``, so no
    generator is timed) with ``bs=1M conv=fsync`` (the data is on the disk when it ends);
  * **read, warm**: ``dd`` of the file to ``/dev/null`` at once (caches full);
  * **read, host caches dropped**: the host's page cache dropped (``sync; echo 3 >
    /proc/sys/vm/drop_caches``), then read again. gVisor keeps its own cache of the
    sandbox's own disk (its overlay) and of gofer files, so this read may still hit memory;
  * **read, cold** (volume only): the host's caches dropped and the file read by a *new*
    sandbox mounting the volume (nothing cached anywhere: the first read after a move to
    another node).

dd's own figure (MB/s, 10^6 bytes) is reported, median over the rounds. The volume is
an ext4 image loop-mounted on the host (``FORKYARD_VOLUMES_DIR``: on a cluster a shared
mount; pass ``--volumes-dir`` to measure one) and bound into the sandbox through
runsc's gofer; the sandbox's own disk is its overlay (an ext4 image of its own).

Usage: ``python bench/bench_volumes.py [-n 3] [--volumes-dir DIR]`` (root).
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _common import start_server, stop_server, templates_dir  # noqa: E402

MIB = 100
_RATE = re.compile(r"copied, ([0-9.]+) s, ([0-9.]+) ([kMG]?B)/s")


def _mbps(out: str) -> float:
    """dd's rate in MB/s (10^6 bytes) from its last line."""
    m = _RATE.findall(out)
    if not m:
        raise RuntimeError(f"no dd rate in {out!r}")
    secs, rate, unit = m[-1]
    return float(rate) * {"kB": 1e-3, "B": 1e-6, "MB": 1.0, "GB": 1e3}[unit]


def _dd(sbx, args: str) -> float:
    r = sbx.commands.run(f"dd {args} 2>&1 | tail -1", user="root", timeout=300)
    return _mbps(r.stdout)


def _drop_host_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--volumes-dir", help="FORKYARD_VOLUMES_DIR for the server (default: its data dir)")
    args = ap.parse_args()
    if args.volumes_dir:
        os.environ["FORKYARD_VOLUMES_DIR"] = args.volumes_dir
    proc, url, _key = start_server(templates_dir())
    os.environ["E2B_VOLUME_API_URL"] = url
    from e2b import Sandbox, Volume

    vol = Volume.create("bench-" + secrets.token_hex(3))
    res: dict[str, list[float]] = {}
    try:
        for i in range(args.n):
            sbx = Sandbox.create("base", timeout=600, volume_mounts={"/mnt": vol})
            try:
                sbx.commands.run(f"head -c {MIB}M /dev/urandom > /dev/shm/src", user="root", timeout=120)
                for where, path in (("volume", "/mnt/f.bin"), ("own disk", "/home/user/f.bin")):
                    res.setdefault(f"{where}: write (conv=fsync)", []).append(
                        _dd(sbx, f"if=/dev/shm/src of={path} bs=1M conv=fsync"))
                    res.setdefault(f"{where}: read, warm", []).append(_dd(sbx, f"if={path} of=/dev/null bs=1M"))
                    _drop_host_caches()
                    res.setdefault(f"{where}: read, host caches dropped", []).append(
                        _dd(sbx, f"if={path} of=/dev/null bs=1M"))
            finally:
                sbx.kill()
            _drop_host_caches()
            fresh = Sandbox.create("base", timeout=600, volume_mounts={"/mnt": vol})
            try:
                res.setdefault("volume: read, cold (new sandbox)", []).append(
                    _dd(fresh, "if=/mnt/f.bin of=/dev/null bs=1M"))
            finally:
                fresh.kill()
            print(f"round {i + 1}/{args.n} done", file=sys.stderr)
    finally:
        Volume.destroy(vol.volume_id)
        stop_server(proc)
    print(f"{MIB} MiB inside a sandbox, MB/s (median of {args.n}; dd's figures):")
    for name, xs in res.items():
        print(f"  {name:<42} {statistics.median(xs):8.0f}   (all: {', '.join(f'{x:.0f}' for x in xs)})")


if __name__ == "__main__":
    main()
