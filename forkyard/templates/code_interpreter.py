"""Template ``code-interpreter-v1``, the one the ``e2b-code-interpreter`` SDKs start by
default (their ``DEFAULT_TEMPLATE``), built on ``base`` from packages fetched on the
*client's* host (``forkyard template add code-interpreter``).

Sandboxes here cannot reach the package registries (their addresses are in the blocked
egress ranges), so nothing is downloaded inside the build sandbox: :func:`prepare_context`
runs ``pip download`` (wheels for ``base``'s Python, 3.11 on x86_64 glibc) and ``npm pack``
(Deno's Linux binary) on the host into a build context, and :func:`make_template` is an
E2B ``Template`` that COPYs that context into the build sandbox and installs it offline
(``pip install --no-index``). Its start command runs forkyard's own server
(``forkyard/guest/code_interpreter/server.py``, port 49999) as root, as E2B's template
runs its Jupyter server, and the build waits for ``GET /health``.

What differs from E2B's template (github.com/e2b-dev/code-interpreter ``template/``):
kernels are Python (ipykernel) and JavaScript/TypeScript (Deno's kernel, where E2B uses
ijavascript); no R, Java or Bash kernels; the Python packages are :data:`PACKAGES` (plus
``extra``), not E2B's ~40 (no scipy, scikit-learn, seaborn, plotly, …); no Jupyter server
(``jupyter_client`` drives the kernels directly).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from forkyard import fsperms

NAME = "code-interpreter-v1"
#: ``base`` is Debian bookworm: CPython 3.11, glibc 2.36, x86_64.
PYTHON_VERSION = "3.11"
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64", "any"]
#: The kernels' and the server's packages, pinned (their dependencies are resolved by pip
#: at download time). e2b-charts: E2B's chart extractor for ``result.chart``.
PACKAGES = [
    "ipykernel==7.4.0", "jupyter_client==8.10.0", "ipython==9.18.1", "matplotlib==3.11.2", "numpy==2.4.6",
    "pandas==3.1.1", "pillow==13.0.0", "e2b-charts==1.0.0", "starlette==1.10.0", "uvicorn==0.55.0",
]
#: Deno's Linux build on npm (one static binary, ~96 MB); its ``deno jupyter --kernel`` is
#: the JavaScript/TypeScript kernel.
DENO_PACKAGE = "@deno/linux-x64-glibc@2.9.6"
PREFIX = "/opt/code-interpreter"
#: Memory (MiB) of its sandboxes unless the build says otherwise: ``base``'s 512 MiB is too
#: little for both kernels once pandas, matplotlib and Deno's TypeScript compiler are
#: loaded (measured: such a sandbox was killed out of memory at 512).
MEMORY_MB = 1024
GUEST = Path(__file__).resolve().parent.parent / "guest" / "code_interpreter"
#: Seconds the host's pip and npm may take.
DOWNLOAD_TIMEOUT_S = 900


class PrepareError(Exception):
    """Fetching the packages on the host failed (no pip/npm, no network, a package with no
    wheel for the sandbox's platform); the message says which and what to do."""


def _kernel_specs() -> dict[str, dict]:
    """kernel.json of each kernel, as jupyter_client reads them (``argv``, ``env``)."""
    return {
        "python3": {"argv": [f"{PREFIX}/venv/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                    "display_name": "Python 3", "language": "python",
                    "env": {"IPYTHONDIR": f"{PREFIX}/ipython", "MPLBACKEND": "module://matplotlib_inline.backend_inline"}},
        "javascript": {"argv": [f"{PREFIX}/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"],
                       "display_name": "JavaScript (Deno)", "language": "typescript",
                       "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1"}},
    }


INSTALL_SH = f"""set -eu
src=$(dirname "$0")
python3 -m venv {PREFIX}/venv
{PREFIX}/venv/bin/pip install -q --no-index --no-cache-dir --find-links "$src/wheels" -r "$src/requirements.txt"
mkdir -p {PREFIX}/bin {PREFIX}/ipython/profile_default/startup
tar -xzf "$src"/npm/*.tgz -C "$src/npm"
install -m 0755 "$src/npm/package/deno" {PREFIX}/bin/deno
install -m 0644 "$src/server.py" {PREFIX}/server.py
install -m 0644 "$src/ipython_startup.py" {PREFIX}/ipython/profile_default/startup/00-e2b-formats.py
for k in "$src"/kernels/*; do
  mkdir -p {PREFIX}/venv/share/jupyter/kernels/$(basename "$k")
  install -m 0644 "$k/kernel.json" {PREFIX}/venv/share/jupyter/kernels/$(basename "$k")/kernel.json
done
rm -rf "$src"
"""


def _run(cmd: list[str], what: str) -> None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except FileNotFoundError:
        raise PrepareError(f"{what}: {cmd[0]} is not installed on this host") from None
    except subprocess.TimeoutExpired:
        raise PrepareError(f"{what}: no answer within {DOWNLOAD_TIMEOUT_S} s (is a package registry reachable?)") from None
    if p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-6:])
        raise PrepareError(f"{what} failed (exit {p.returncode}):\n{tail}")


def inputs_hash(extra: list[str] = ()) -> str:
    """sha256 (hex, 16 chars) of what the build is made of (packages, server, startup
    file, kernels): a cached context or template with another hash is stale."""
    h = hashlib.sha256(json.dumps([PACKAGES, list(extra), DENO_PACKAGE, INSTALL_SH, _kernel_specs()]).encode())
    for f in ("server.py", "ipython_startup.py"):
        h.update((GUEST / f).read_bytes())
    return h.hexdigest()[:16]


def _requirement(spec: str) -> str:
    """``spec`` if it is a plain requirement from the package index (``name``, extras,
    version specifiers, markers: PEP 508 via ``packaging``); PrepareError for a URL or
    path (``name @ …``: pip would build it, running its code on this host), an option line
    (``--index-url …``) or more than one line."""
    from packaging.requirements import InvalidRequirement, Requirement

    if not isinstance(spec, str) or "\n" in spec or "\r" in spec or spec.strip().startswith("-"):
        raise PrepareError(f"--pip {spec!r}: give a package name with an optional version, e.g. 'scipy>=1.14'")
    try:
        req = Requirement(spec)
    except InvalidRequirement as e:
        raise PrepareError(f"--pip {spec!r} is not a requirement: {e}") from e
    if req.url:
        raise PrepareError(f"--pip {spec!r}: URLs and paths are refused (only packages from the index, as wheels)")
    return str(req)


def prepare_context(root: Path, extra: list[str] = (), log=print) -> Path:
    """Fill ``root/code-interpreter`` (the build context's one directory) with the wheels,
    Deno, the server and an install script; returns it. Downloads are kept in ``root`` and
    reused when ``inputs_hash(extra)`` is unchanged. Raises PrepareError."""
    extra = [_requirement(x) for x in extra]
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)  # the cache is the user's own: nothing in it for other local users
    ctx = root / "code-interpreter"
    stamp = root / "inputs.sha256"
    # what this writes is 0600/0700 (the umask below; install.sh sets the modes inside the
    # template), and so is an older cache's (only our own two entries: root may be the
    # user's --cache-dir)
    if ctx.is_dir() and not ctx.is_symlink():
        fsperms.lock_down(ctx)
    if stamp.is_file() and not stamp.is_symlink():
        stamp.chmod(0o600)
    digest = inputs_hash(extra)
    if stamp.exists() and stamp.read_text() == digest and (ctx / "install.sh").exists():
        log(f"using the packages fetched before ({ctx})")
        return ctx
    if shutil.which("npm") is None:
        raise PrepareError("npm is not installed on this host (needed to fetch Deno, the JavaScript kernel)")
    old = fsperms.private_umask()
    try:
        _fill(ctx, extra, log)
        fsperms.lock_down(ctx)  # pip and npm may set modes of their own on what they write
        stamp.write_text(digest)
    finally:
        os.umask(old)
    return ctx


def _fill(ctx: Path, extra: list[str], log) -> None:
    """Download the wheels and Deno into ``ctx`` (made anew) and write the kernels, the
    server and install.sh beside them. Raises PrepareError."""
    shutil.rmtree(ctx, ignore_errors=True)
    (ctx / "wheels").mkdir(parents=True)
    (ctx / "npm").mkdir()
    reqs = [*PACKAGES, *extra]
    (ctx / "requirements.txt").write_text("\n".join(reqs) + "\n")
    log(f"pip download {len(reqs)} packages for CPython {PYTHON_VERSION} (x86_64 glibc)")
    plats = [a for p in PLATFORMS for a in ("--platform", p)]
    _run([sys.executable, "-m", "pip", "download", "-q", "--dest", str(ctx / "wheels"), "--only-binary=:all:",
          "--python-version", PYTHON_VERSION, "--implementation", "cp", *plats, "-r", str(ctx / "requirements.txt")],
         "pip download")
    log(f"npm pack {DENO_PACKAGE}")
    _run(["npm", "pack", "--silent", "--pack-destination", str(ctx / "npm"), DENO_PACKAGE], "npm pack")
    for name, spec in _kernel_specs().items():
        (ctx / "kernels" / name).mkdir(parents=True)
        (ctx / "kernels" / name / "kernel.json").write_text(json.dumps(spec, indent=1))
    for f in ("server.py", "ipython_startup.py"):
        shutil.copy(GUEST / f, ctx / f)
    (ctx / "install.sh").write_text(INSTALL_SH)


def make_template(root: Path):
    """The E2B ``Template`` (e2b SDK) of ``code-interpreter-v1`` over the context
    :func:`prepare_context` filled in ``root``: from ``base``, install as root, then
    ``user`` in ``/home/user`` with the server as start command (as root, through sudo)
    and ``GET :49999/health`` as ready check."""
    from e2b import Template, wait_for_url

    return (
        Template(file_context_path=str(root))
        .from_template("base")
        .set_user("root")
        .copy("code-interpreter", "/tmp/code-interpreter-build")
        .run_cmd("sh /tmp/code-interpreter-build/install.sh")
        .set_user("user")
        .set_workdir("/home/user")
        .set_start_cmd(f"sudo {PREFIX}/venv/bin/python {PREFIX}/server.py", wait_for_url("http://localhost:49999/health"))
    )
