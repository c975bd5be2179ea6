"""Mutation run over envd's process and filesystem services (docs/testing.md).

Not a test module (pytest does not collect it). gremlins (``go install
github.com/go-gremlins/gremlins/cmd/gremlins@v0.6.0``) lists the mutants; this script
applies each one to a scratch copy of ``envd/`` and runs ``go test`` of
``internal/server`` (the tests that drive both services through real Connect calls):
KILLED when the tests fail, LIVED when they pass. gremlins' own ``unleash -i`` reported
nearly every mutant LIVED on this module (3 of 83), while applying the same mutants by
hand failed the tests, so its results are not used.

    cd envd && gremlins unleash --dry-run -i \\
        --coverpkg ./internal/process/...,./internal/filesystem/... \\
        -E 'internal/(fsutil|httpapi|identity|reaper|rpcutil|server|spec|state)/' -E '^cmd/' -E 'main.go' . \\
        | grep -E 'RUNNABLE|NOT COVERED' > /tmp/mutants.txt
    nice -n 10 .venv/bin/python tests/mutation_go.py /tmp/mutants.txt /tmp/gomut.json

About 9 s a mutant on 2 shared cores (a ``go test`` build and run each).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENVD = Path(__file__).resolve().parent.parent / "envd"
NEGATE = {"==": "!=", "!=": "==", "<=": ">", ">=": "<", "<": ">=", ">": "<="}
BOUNDARY = {"<": "<=", "<=": "<", ">": ">=", ">=": ">"}
ARITHMETIC = {"+": "-", "-": "+", "*": "/", "/": "*", "%": "*"}
TABLES = {"CONDITIONALS_NEGATION": NEGATE, "CONDITIONALS_BOUNDARY": BOUNDARY, "ARITHMETIC_BASE": ARITHMETIC}


def mutate(line: str, col: int, kind: str) -> str | None:
    """``line`` with the operator at 1-based ``col`` replaced as gremlins' ``kind`` does,
    or None when no such operator is there."""
    c = col - 1
    if kind == "INVERT_NEGATIVES":
        return line[:c] + line[c + 1:] if line[c] == "-" else None
    table = TABLES.get(kind, {})
    op = line[c:c + 2] if line[c:c + 2] in table else line[c]
    return line[:c] + table[op] + line[c + len(op):] if op in table else None


def main(listing: str, out_path: str) -> None:
    env = dict(os.environ, GOFLAGS="-count=1", PATH=os.environ["PATH"] + ":/usr/local/go/bin")
    work = Path(tempfile.mkdtemp(prefix="gomut-")) / "envd"
    shutil.copytree(ENVD, work, ignore=shutil.ignore_patterns("bin"))
    results = []
    try:
        for row in (ln.split() for ln in Path(listing).read_text().splitlines() if "RUNNABLE" in ln):
            kind, where = row[1], row[3]
            path, ln, col = where.rsplit(":", 2)
            f = work / path
            orig = f.read_text()
            lines = orig.splitlines(keepends=True)
            new = mutate(lines[int(ln) - 1], int(col), kind)
            if new is None:
                results.append({"where": where, "kind": kind, "status": "NOT APPLIED"})
                continue
            lines[int(ln) - 1] = new
            f.write_text("".join(lines))
            t0 = time.time()
            try:
                r = subprocess.run(["go", "test", "-timeout", "90s", "./internal/server/"], cwd=work, env=env,
                                   capture_output=True, text=True, timeout=180)
                status = "LIVED" if r.returncode == 0 else "KILLED"
                if "[build failed]" in r.stdout:
                    status = "NOT VIABLE"
            except subprocess.TimeoutExpired:
                status = "TIMED OUT"
            finally:
                f.write_text(orig)
            results.append({"where": where, "kind": kind, "status": status, "s": round(time.time() - t0, 1),
                            "to": new.strip()})
            print(status, where, kind, new.strip()[:100], flush=True)
            Path(out_path).write_text(json.dumps(results, indent=1))
    finally:
        shutil.rmtree(work.parent, ignore_errors=True)
    counts = {s: sum(1 for r in results if r["status"] == s) for s in {r["status"] for r in results}}
    print(counts)


if __name__ == "__main__":
    main(*sys.argv[1:3])
