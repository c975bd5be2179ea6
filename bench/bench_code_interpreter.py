"""Code-interpreter benchmark: ``code-interpreter-v1`` through the unchanged
``e2b-code-interpreter`` SDK (PyPI). Starts a private server (bench/_common.py), builds
the template there (``forkyard template add code-interpreter``'s code path; the wheels
and Deno are fetched on this host into ``DATA/code-interpreter-context`` once), then
prints p50/p95 (ms) of:

* ``Sandbox.create()`` (the SDK's default template, kernels already running from the
  template's snapshot) until it returns;
* the first ``run_code("1 + 1")`` of a new sandbox;
* ``run_code("x = x + 1; x")`` in a warm Python kernel, and ``1 + 1`` in JavaScript;
* ``Sandbox.kill()`` is not timed.

Usage: ``python bench/bench_code_interpreter.py [-n 10]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DATA, row, start_server, stop_server, templates_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10, help="sandboxes (and runs per kind)")
    args = ap.parse_args()
    from e2b import Template
    from e2b_code_interpreter import Sandbox

    from forkyard.templates import code_interpreter as ci

    proc, _, _ = start_server(templates_dir())
    try:
        root = DATA / "code-interpreter-context"
        root.mkdir(parents=True, exist_ok=True)
        ci.prepare_context(root, log=lambda m: print(m, file=sys.stderr))
        t0 = time.monotonic()
        Template.build(ci.make_template(root), ci.NAME, memory_mb=ci.MEMORY_MB)
        print(f"template build: {time.monotonic() - t0:.0f} s", file=sys.stderr)
        creates, firsts, warm, js = [], [], [], []
        for _ in range(args.n):
            t = time.perf_counter()
            sbx = Sandbox.create(timeout=120)
            creates.append((time.perf_counter() - t) * 1000)
            try:
                t = time.perf_counter()
                assert sbx.run_code("1 + 1").text == "2"
                firsts.append((time.perf_counter() - t) * 1000)
                sbx.run_code("x = 0")
                for _ in range(3):
                    t = time.perf_counter()
                    sbx.run_code("x = x + 1; x")
                    warm.append((time.perf_counter() - t) * 1000)
                t = time.perf_counter()
                assert sbx.run_code("1 + 1", language="js").text == "2"
                js.append((time.perf_counter() - t) * 1000)
            finally:
                sbx.kill()
        print(row("Sandbox.create() code-interpreter-v1", creates))
        print(row("first run_code('1 + 1')", firsts))
        print(row("run_code, warm python kernel", warm))
        print(row("run_code('1 + 1', language='js')", js))
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
