"""What forkyard imports from outside the standard library is declared in pyproject.toml
(issue 20: e2b and packaging were imported by the client and CLI but not declared, so a
plain install failed on the first `forkyard exec`). Reads source files only."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
#: Imports that are optional by design, the module that guards each (ImportError is
#: caught and turned into a message naming the extra) and the extra that provides it.
OPTIONAL = {"opentelemetry": ("obs/tracing.py", "otel")}
#: Code that runs inside code-interpreter sandboxes, in their own venv: its imports are
#: forkyard.templates.code_interpreter.PACKAGES (or installed with them: traitlets comes
#: with ipykernel), not forkyard's dependencies.
GUEST_VENV = "guest/code_interpreter/"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports() -> dict[str, set[str]]:
    """Top-level third-party module name -> the forkyard files importing it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "forkyard").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top != "forkyard" and top not in sys.stdlib_module_names:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT / "forkyard")))
    return found


def test_every_imported_distribution_is_declared():
    from forkyard.templates import code_interpreter as ci

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {_norm(Requirement(r).name) for r in project["dependencies"]}
    extras = {k: {_norm(Requirement(r).name) for r in v} for k, v in project["optional-dependencies"].items()}
    dists = packages_distributions()
    missing = []
    for top, files in sorted(_imports().items()):
        provided_by = {_norm(d) for d in dists.get(top, [top])}
        if top in OPTIONAL:
            module, extra = OPTIONAL[top]
            assert files == {module}, f"{top} is optional: import it only in {module} ({sorted(files)})"
            assert provided_by & extras[extra], f"{top}: not in the {extra} extra"
            continue
        if all(f.startswith(GUEST_VENV) for f in files):
            pinned = {_norm(Requirement(r).name) for r in ci.PACKAGES} | {"traitlets"}
            assert provided_by & pinned, f"{top} (from {sorted(files)}) is not in code_interpreter.PACKAGES"
            continue
        if not provided_by & declared:
            missing.append(f"{top} (from {', '.join(sorted(files))}; distribution {', '.join(sorted(provided_by))})")
    assert not missing, "imported at run time but not in [project] dependencies:\n" + "\n".join(missing)


def test_default_paths_point_into_the_checkout(monkeypatch):
    """Defaults computed from the settings module's own place (envd's binary) name the
    checkout's files: ``./deploy/up.sh`` builds ``envd/bin/envd`` and the server must find
    it there without ``FORKYARD_ENVD`` (moving config.py into a package once made the
    default ``forkyard/envd/bin/envd``, and README command 1 failed)."""
    from forkyard.config import Settings

    monkeypatch.delenv("FORKYARD_ENVD", raising=False)
    assert Settings().envd_binary == ROOT / "envd" / "bin" / "envd"
