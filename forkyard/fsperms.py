"""Secrets at rest: the data directory is private to the user running forkyard.

The state database (and its WAL/SHM), checkpoint images, staging, the node cache and
logs hold envd access tokens and the env vars users pass in ``envs`` (their API keys).
So the data dir is 0700, every directory in it 0700 and every file 0600 — files created
later through the process umask (:func:`private_umask`), existing ones (an upgrade of an
older data dir) through :func:`lock_down` at start. A directory 0700 also keeps others
out of everything below it, whatever a file's own mode.

Not touched: a template's ``rootfs`` tree (its modes are the sandbox's own file modes:
``/etc/passwd`` must stay 0644 inside), mount points, symbolic links and a sandbox's ``bundle/etc`` (its ``/etc/hosts`` and
``/etc/hostname``, bind-mounted: 0644 so every user inside reads them; the 0700
directories above keep host users out).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("forkyard.fsperms")

#: umask for forkyard's processes: new files 0600, new directories 0700.
PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_umask() -> int:
    """Set the process umask to :data:`PRIVATE_UMASK`; returns the previous one."""
    return os.umask(PRIVATE_UMASK)


def _skip_dir(path: Path, root: Path) -> bool:
    rel = path.relative_to(root).parts
    if path.name == "etc" and path.parent.name == "bundle":  # a sandbox's bind-mounted /etc files
        return True
    # <data>/templates/<name>/rootfs… and <data>/templates/<name>/<build>/rootfs…
    return path.name == "rootfs" or (len(rel) >= 2 and rel[0] == "templates" and "rootfs" in rel)


def lock_down(root: Path) -> int:
    """Create ``root`` if needed and make it, every directory below it 0700 and every
    regular file 0600, skipping template rootfs trees, mount points and symlinks
    (never followed). Returns how many modes were changed. Errors on single entries
    (a file removed meanwhile) are ignored; one on ``root`` itself raises OSError."""
    root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    changed = 0
    if stat.S_IMODE(root.stat().st_mode) != DIR_MODE:
        root.chmod(DIR_MODE)
        changed += 1
    root_dev = root.stat().st_dev
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        keep = []
        for d in dirnames:
            p = here / d
            try:
                st = p.lstat()
                if stat.S_ISLNK(st.st_mode) or st.st_dev != root_dev or os.path.ismount(p) or _skip_dir(p, root):
                    continue
                if stat.S_IMODE(st.st_mode) != DIR_MODE:
                    os.chmod(p, DIR_MODE, follow_symlinks=False)
                    changed += 1
                keep.append(d)
            except OSError:
                continue
        dirnames[:] = keep
        for f in filenames:
            p = here / f
            try:
                st = p.lstat()
                if stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                    os.chmod(p, stat.S_IMODE(st.st_mode) & 0o700 or FILE_MODE, follow_symlinks=False)
                    changed += 1
            except OSError:
                continue
    if changed:
        log.info("data dir %s: made %d entries private (0700 dirs, 0600 files)", root, changed)
    return changed
