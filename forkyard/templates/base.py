"""The ``base`` template: a Debian bookworm rootfs shared read-only by sandboxes.

Layout under ``<settings.templates_dir>/base``::

    rootfs/            the finished root filesystem (read-only bind mount of itself)
    .complete          completion marker, written last
    .rootfs.partial/   build in progress (removed and rebuilt if a build was interrupted)
    .lock              flock held while building

Sandboxes never write into ``rootfs``: the runtime gives each sandbox its own writable
layer (gVisor ``--overlay2``), and the directory is additionally made read-only on the
host with a read-only bind mount onto itself, so even a runtime bug cannot modify it.
The bind mount does not survive a host reboot; :func:`build_base` (and
:func:`protect_rootfs`) re-establish it whenever called.

Run ``python -m forkyard.templates.base`` to build it from the command line.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from forkyard.config import Settings
from forkyard.guest import sudo as sudo_broker
from forkyard.guest.files import host_nameservers, hosts_file

TEMPLATE_NAME = "base"
#: Bumped whenever the build changes; a build with another version is redone.
BUILD_VERSION = 9
SUITE = "bookworm"
#: Packages on top of debootstrap's ``minbase``: what an E2B ``base`` user expects.
PACKAGES = [
    "python3",
    "python-is-python3",  # `python` as in E2B's base
    "python3-pip",
    "python3-venv",
    "git",
    "curl",
    "wget",
    "ca-certificates",
    "sudo",
    "procps",
    "bash",
    "iproute2",
    "netbase",
    "less",
    "unzip",
    "zip",
    "jq",
    "nano",
    "vim-tiny",
    "build-essential",
    "python3-dev",  # Python.h: building C extensions (pip wheels with C code, cffi, Cython)
]
#: Installed with apt inside the rootfs after debootstrap (debootstrap's own resolver
#: cannot configure npm's dependency tree): Node.js with npm, as in E2B's base.
APT_PACKAGES = ["nodejs", "npm"]
USER_NAME = "user"
USER_UID = 1000
DEFAULT_HOSTNAME = "forkyard"
SOURCES_FILE = Path("/etc/apt/sources.list.d/debian.sources")
SOURCES_LIST = Path("/etc/apt/sources.list")
#: Locally added trust anchors of the host (update-ca-certificates' input directory).
HOST_LOCAL_CAS = Path("/usr/local/share/ca-certificates")

Progress = Callable[[str], None]


class TemplateBuildError(Exception):
    """Building a template failed; the message carries the failing tool's output tail."""


# --------------------------------------------------------------------------- helpers


def debian_mirrors(
    sources: Path = SOURCES_FILE, sources_list: Path = SOURCES_LIST
) -> tuple[str, str | None]:
    """Return ``(main_mirror, security_mirror_or_None)`` from the host's apt config.

    Reads the deb822 ``URIs:`` lines of ``debian.sources`` (falls back to one-line
    ``sources.list``). The mirror whose suites include ``bookworm`` is the main one; the
    one with ``bookworm-security`` the security one.

    Raises:
        TemplateBuildError: no Debian mirror is configured on the host.
    """
    main: str | None = None
    security: str | None = None
    if sources.exists():
        for stanza in re.split(r"\n\s*\n", sources.read_text()):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line:
                    continue
                key, _, value = line.partition(":")
                fields[key.strip().lower()] = value.strip()
            uris = fields.get("uris", "").split()
            suites = fields.get("suites", "").split()
            types = fields.get("types", "deb").split()
            if not uris or "deb" not in types:
                continue
            if any(s.endswith("-security") for s in suites):
                security = security or uris[0]
            elif SUITE in suites and main is None:
                main = uris[0]
    if main is None and sources_list.exists():
        for line in sources_list.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb":
                uri_idx = 2 if parts[1].startswith("[") else 1
                uri, suite = parts[uri_idx], parts[uri_idx + 1]
                if suite.endswith("-security"):
                    security = security or uri
                elif suite == SUITE and main is None:
                    main = uri
    if main is None:
        raise TemplateBuildError(f"no Debian {SUITE} mirror found in {sources} or {sources_list}")
    return main, security


def _mountinfo_entry(path: Path) -> list[str] | None:
    """The /proc/self/mountinfo fields of the mount whose mount point is ``path``."""
    target = os.path.realpath(path)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            mnt = fields[4].encode().decode("unicode_escape")
            if mnt == target:
                found = fields  # last one wins (top of the stack)
    return found


#: Options of a template's protecting bind mount: read-only, and its set-id programs
#: and device nodes inert on the host (issue 25: an imported image's setuid-root file
#: must not be an escalation for a local user). gVisor applies its own mount flags
#: inside the sandbox, so ``sudo`` there is unaffected.
PROTECT_OPTIONS = ("ro", "nosuid", "nodev")


def is_protected(rootfs: Path) -> bool:
    """True when ``rootfs`` is a mount point with :data:`PROTECT_OPTIONS` (the protection is in place)."""
    entry = _mountinfo_entry(rootfs)
    return entry is not None and set(PROTECT_OPTIONS) <= set(entry[5].split(","))


def _real_dir(rootfs: Path) -> None:
    """Refuse a rootfs that is a symlink (``mount``/``umount`` would follow it to the host)."""
    if rootfs.is_symlink() or not rootfs.is_dir():
        raise TemplateBuildError(f"{rootfs} is not a directory (a link?); refusing to mount over it")


def protect_rootfs(rootfs: Path) -> None:
    """Make ``rootfs`` read-only on the host with a bind mount onto itself
    (:data:`PROTECT_OPTIONS`); an older protection without nosuid/nodev is remounted.

    Idempotent. Raises:
        TemplateBuildError: the bind mount failed, or ``rootfs`` is a symlink.
    """
    _real_dir(rootfs)
    if is_protected(rootfs):
        return
    if _mountinfo_entry(rootfs) is None:
        _run_quiet(["mount", "--bind", str(rootfs), str(rootfs)])
    _run_quiet(["mount", "-o", "remount,bind," + ",".join(PROTECT_OPTIONS), str(rootfs), str(rootfs)])


def unprotect_rootfs(rootfs: Path) -> None:
    """Remove every mount stacked on ``rootfs`` (used before rebuilding or deleting).
    Lazy (``umount -l``): sandboxes still using it keep their view. A symlink is left
    alone (its target is not ours to unmount)."""
    if rootfs.is_symlink():
        return
    while _mountinfo_entry(rootfs) is not None:
        _run_quiet(["umount", "-l", str(rootfs)])


def _run_quiet(argv: list[str]) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise TemplateBuildError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")


def _run_streamed(argv: list[str], progress: Progress, env: dict[str, str] | None = None) -> None:
    """Run ``argv``, passing each output line to ``progress``; raise with the tail on error."""
    tail: list[str] = []
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        tail = (tail + [line])[-30:]
        progress(line)
    rc = proc.wait()
    if rc != 0:
        raise TemplateBuildError(f"{' '.join(argv[:3])}… exited {rc}:\n" + "\n".join(tail))


def _chroot(root: Path, script: str, progress: Progress) -> None:
    env = {
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "DEBIAN_FRONTEND": "noninteractive",
        "LANG": "C.UTF-8",
        "HOME": "/root",
    }
    _run_streamed(["chroot", str(root), "/bin/sh", "-euc", script], progress, env=env)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink():
        path.unlink()
    path.write_text(text)
    path.chmod(mode)


# --------------------------------------------------------------------------- build


def _configure(root: Path, mirror: str, security: str | None, progress: Progress) -> None:
    """Post-debootstrap configuration of the rootfs at ``root``."""
    lines = [f"deb {mirror} {SUITE} main", f"deb {mirror} {SUITE}-updates main"]
    if security:
        lines.append(f"deb {security} {SUITE}-security main")
    _write(root / "etc/apt/sources.list", "\n".join(lines) + "\n")

    servers = host_nameservers()
    if not servers:
        progress("warning: no usable nameserver in the host's resolv.conf; DNS will not work")
    _write(root / "etc/resolv.conf", "".join(f"nameserver {s}\n" for s in servers))
    _write(root / "etc/hostname", DEFAULT_HOSTNAME + "\n")
    _write(root / "etc/hosts", hosts_file(DEFAULT_HOSTNAME))
    _write(root / "etc/default/locale", "LANG=C.UTF-8\n")

    sudo_setup = sudo_broker.install(root)
    # Sandboxes egress through the host's network path; if the host trusts extra CAs
    # (e.g. a TLS-inspecting egress proxy), pip/curl/git inside need them too.
    local_cas = sorted(HOST_LOCAL_CAS.rglob("*.crt")) if HOST_LOCAL_CAS.is_dir() else []
    for ca in local_cas:
        dest = root / "usr/local/share/ca-certificates" / ca.relative_to(HOST_LOCAL_CAS)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ca, dest)
        dest.chmod(0o644)
    if local_cas:
        progress(f"trusting {len(local_cas)} local CA certificate(s) of the host")
    _chroot(
        root,
        f"""
        if ! id -u {USER_NAME} >/dev/null 2>&1; then
            useradd --create-home --home-dir /home/{USER_NAME} --uid {USER_UID} \
                    --user-group --groups sudo --shell /bin/bash {USER_NAME}
        fi
        {sudo_setup}
        {"update-ca-certificates" if local_cas else ":"}
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends {" ".join(APT_PACKAGES)}
        apt-get clean
        rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt/* /var/log/dpkg.log
        """,
        progress,
    )
    _write(root / f"etc/sudoers.d/{USER_NAME}", f"{USER_NAME} ALL=(ALL:ALL) NOPASSWD: ALL\n", 0o440)
    # Every commands.run is `bash -l -c CMD` (envd, as E2B's); Debian's /etc/profile asks
    # `$(id -u)` twice, a process start that costs ~15-25 ms under gVisor (measured: bash -l
    # -c true 43.7 ms p50 vs 17.6 ms without the profile). bash knows its EUID; other
    # shells still run `id -u`.
    profile = root / "etc/profile"
    if profile.is_file():
        text = profile.read_text()
        profile.write_text(text.replace('"$(id -u)"', '"${EUID:-$(id -u)}"'))
    # Debian marks the system Python as externally managed (PEP 668); E2B users expect a
    # plain `pip install` to work, as in E2B's own base image.
    for marker in (root / "usr/lib").glob("python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    # Mount point for the injected envd binary (bind-mounted read-only by the runtime).
    envd = root / "usr/local/bin/envd"
    envd.parent.mkdir(parents=True, exist_ok=True)
    if not envd.exists():
        envd.touch(mode=0o755)


def template_rootfs(settings: Settings, name: str = TEMPLATE_NAME) -> Path:
    """Path of template ``name``'s rootfs (it may not be built yet)."""
    return settings.templates_dir / name / "rootfs"


def _marker_version(marker: Path) -> int | None:
    try:
        m = re.search(r"^version (\d+)$", marker.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def is_built(settings: Settings) -> bool:
    """True when the ``base`` rootfs has been completely built by this build version."""
    base = settings.templates_dir / TEMPLATE_NAME
    return (_marker_version(base / ".complete") or 0) >= BUILD_VERSION and (base / "rootfs").is_dir()


def build_base(settings: Settings, progress: Progress = print, force: bool = False) -> Path:
    """Build (once) and return the ``base`` template rootfs directory.

    Cached: returns at once when the completion marker exists (re-establishing the
    host-side read-only protection). Otherwise any half-built leftovers are removed and
    the rootfs is rebuilt with debootstrap (``minbase`` + :data:`PACKAGES`) from the
    host's configured Debian mirror, then configured (user ``user`` uid 1000 with
    passwordless sudo — through the broker of :mod:`forkyard.guest.sudo`, since
    gVisor ignores set-user-ID bits —, resolv.conf from the host's nameservers, the
    host's locally added CA certificates, hostname files). A build of an older :data:`BUILD_VERSION` is redone; the old tree is moved
    aside (sandboxes may still use it) and deleted by a later call. A file lock
    serialises concurrent builders. Takes about 45 s on this project's machines.

    Args:
        settings: where to build (``settings.templates_dir / "base"``).
        progress: called with each output line (debootstrap, chroot steps).
        force: rebuild even if a complete build exists.

    Returns:
        Path of the rootfs directory (read-only bind mount).

    Raises:
        TemplateBuildError: debootstrap or a configuration step failed (message includes
            the tail of its output), or no Debian mirror is configured.
    """
    base = settings.templates_dir / TEMPLATE_NAME
    rootfs = base / "rootfs"
    partial = base / ".rootfs.partial"
    marker = base / ".complete"
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_old_builds(base, min_age_s=600)
        if force and marker.exists():
            marker.unlink()
        complete = marker.exists() and rootfs.is_dir()
        if complete and (_marker_version(marker) or 0) >= BUILD_VERSION:  # a newer build serves older code too
            protect_rootfs(rootfs)
            return rootfs
        if complete:
            progress(f"base template at {rootfs} is from an older build; rebuilding it")

        started = time.monotonic()
        unprotect_rootfs(partial)
        if partial.exists():
            progress(f"removing incomplete build {partial}")
            shutil.rmtree(partial)
        if rootfs.exists() and not complete:
            unprotect_rootfs(rootfs)
            progress(f"removing incomplete build {rootfs}")
            shutil.rmtree(rootfs)

        mirror, security = debian_mirrors()
        progress(f"debootstrap {SUITE} (minbase + {len(PACKAGES)} packages) into {partial}")
        _run_streamed(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=" + ",".join(PACKAGES),
                SUITE,
                str(partial),
                mirror,
            ],
            progress,
        )
        progress("configuring rootfs")
        _configure(partial, mirror, security, progress)
        if rootfs.exists():
            # An older complete build: move it aside rather than delete it, so sandboxes
            # still running on it keep working; it is removed by a later build_base.
            marker.unlink(missing_ok=True)
            unprotect_rootfs(rootfs)
            aside = base / f".rootfs.old.{int(time.time())}"
            rootfs.rename(aside)
            os.utime(aside)  # its age now counts from being replaced
        partial.rename(rootfs)
        protect_rootfs(rootfs)
        marker.write_text(
            f"version {BUILD_VERSION}\n"
            f"built {time.strftime('%Y-%m-%dT%H:%M:%S')} in {time.monotonic() - started:.1f}s\n"
        )
        progress(f"base template ready at {rootfs} ({time.monotonic() - started:.1f} s)")
        return rootfs


def _remove_old_builds(base: Path, min_age_s: float) -> None:
    """Delete replaced builds (``.rootfs.old.*``) older than ``min_age_s`` seconds."""
    for old in base.glob(".rootfs.old.*"):
        try:
            if time.time() - old.stat().st_mtime >= min_age_s:
                unprotect_rootfs(old)
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def remove_base(settings: Settings) -> None:
    """Delete the ``base`` template (unmounting its protection first). Idempotent."""
    base = settings.templates_dir / TEMPLATE_NAME
    for path in (base / "rootfs", base / ".rootfs.partial", *base.glob(".rootfs.old.*")):
        unprotect_rootfs(path)
    shutil.rmtree(base, ignore_errors=True)


def main(argv: Iterable[str] | None = None) -> int:
    """CLI: ``python -m forkyard.templates.base [--force]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    force = "--force" in args
    try:
        path = build_base(Settings(), progress=lambda line: print(line, flush=True), force=force)
    except TemplateBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
