"""The package's layering (issue 20): the import-linter contracts in pyproject.toml hold,
and the contract type that forbids circles sees imports made inside functions.

No server, no sandbox: these read source files only (a few seconds).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"]


def _lint(*args: str, cwd: Path = ROOT, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath or ROOT), "NO_COLOR": "1"}
    return subprocess.run([*LINT, "--no-cache", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_contracts_in_pyproject_are_kept():
    """Every contract is kept: no new import against the layering, no new circle, and no
    ignore entry left over from an import that is gone (import-linter reports an
    unmatched ignore as an error)."""
    p = _lint()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "0 broken" in p.stdout, p.stdout


def _package(tmp_path: Path, a_body: str) -> Path:
    pkg = tmp_path / "src" / "circ"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(textwrap.dedent(a_body))
    (pkg / "b.py").write_text("from circ.a import A\n\n\ndef b():\n    return A\n")
    (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
        [importlinter]
        root_package = circ

        [importlinter:contract:no-cycles]
        name = no circles
        type = acyclic_siblings
        ancestors = circ
        """))
    return tmp_path


def test_a_circle_closed_by_a_function_level_import_is_found(tmp_path):
    """``a`` imports ``b`` only inside a function (the way forkyard's circles hid): the
    acyclic contract still reports the circle, so the project's contract sees such
    imports too. The same package without that import is clean (the check can pass)."""
    root = _package(tmp_path, """\
        class A:
            pass


        def late():
            from circ.b import b  # function-level: closes a -> b -> a

            return b()
        """)
    p = _lint("--config", str(root / ".importlinter"), cwd=root, pythonpath=root / "src")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "No cycles are allowed in circ" in p.stdout, p.stdout

    (root / "src" / "circ" / "a.py").write_text("class A:\n    pass\n")
    p = _lint("--config", str(root / ".importlinter"), cwd=root, pythonpath=root / "src")
    assert p.returncode == 0, p.stdout + p.stderr
