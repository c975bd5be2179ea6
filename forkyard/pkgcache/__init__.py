"""A node-side package cache for sandboxes (``FORKYARD_PACKAGE_CACHE=on``; beyond E2B, off
by default): ``pip``, ``npm`` and ``apt`` in the node's sandboxes, template builds
included, fetch through caching servers the node runs (proxpi for Python packages, squid
for npm and apt), so packages many sandboxes install are downloaded once. Each server
fetches only from its configured upstreams (the allowlist, :mod:`.config`); the node
starts and supervises them (:mod:`.service`). docs/templates.md, "The package cache".
"""

from forkyard.pkgcache.config import (APT_PORT, GUEST_PATHS, MARKER, NPM_PORT, PORTS, PYPI_PORT, PackageCacheError, guest_files,
                                      install_script, remove_script)
from forkyard.pkgcache.service import PackageCache

__all__ = ["APT_PORT", "GUEST_PATHS", "MARKER", "NPM_PORT", "PORTS", "PYPI_PORT", "PackageCache", "PackageCacheError", "guest_files",
           "install_script", "remove_script"]
