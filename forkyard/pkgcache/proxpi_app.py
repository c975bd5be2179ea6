"""proxpi as the package cache serves it to sandboxes (gunicorn's app,
``forkyard.pkgcache.proxpi_app:app``; runs in proxpi's process, not the node's).

proxpi itself trusts its clients; sandboxes are tenants, so in front of it:

* only ``GET``/``HEAD`` of ``/health``, ``/index/``, ``/index/<project>/`` and
  ``/index/<project>/<file>``: proxpi's ``DELETE /cache/...`` (dropping its cached lists,
  which makes it fetch them again for everyone) and anything else is refused;
* ``<project>`` must be a valid project name (PEP 508) and is normalised (PEP 503)
  before proxpi sees it: proxpi keys its lists by the name as asked, so ``Six``,
  ``sIx``... were each fetched and kept in memory (a big project's list, thousands of
  files, under 2^n spellings filled the host's memory), and ``..`` made it fetch the
  index host's root page and the links on it;
* proxpi's file lists in memory are bounded (:data:`MAX_FILES` files in all, the least
  recently fetched lists go first), and so are its per-project locks; its per-URL hit
  statistics (kept forever at the DEBUG level) are off.
"""

from __future__ import annotations

import collections
import re
import threading

from proxpi import _cache, server

#: A project name (PEP 508), at most 200 characters.
_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,198}[A-Za-z0-9])?$")
_SEPARATORS = re.compile(r"[-_.]+")
#: The most files proxpi's cached project lists hold in all (about 1.5 KiB each).
MAX_FILES = 200_000
#: The most per-project locks kept (unheld ones are dropped beyond it).
MAX_LOCKS = 50_000


def normalise(name: str) -> str:
    """PEP 503's normal form of project ``name``."""
    return _SEPARATORS.sub("-", name).lower()


class _Lists(collections.OrderedDict):
    """proxpi's project lists (``_IndexCache._packages``), at most ``max_files`` files in
    all: storing one drops the least recently stored beyond it."""

    def __init__(self, max_files: int):
        super().__init__()
        self.max_files = max_files
        self.files = 0
        self._lock = threading.Lock()

    def __setitem__(self, key, value):
        with self._lock:
            old = super().pop(key, None)
            if old is not None:
                self.files -= len(old.files)
            super().__setitem__(key, value)
            self.files += len(value.files)
            while self.files > self.max_files and len(self) > 1:
                _, dropped = self.popitem(last=False)
                self.files -= len(dropped.files)

    def pop(self, key, *default):
        with self._lock:
            value = super().pop(key, *default)
            if value is not None and not (default and value is default[0]):
                self.files -= len(value.files)
            return value


class _Locks(_cache._Locks):
    """proxpi's per-project locks, bounded: beyond :data:`MAX_LOCKS` the unheld ones go."""

    def __getitem__(self, key: str) -> threading.Lock:
        if len(self._locks) > MAX_LOCKS:
            with self._lock:
                if len(self._locks) > MAX_LOCKS:
                    self._locks = {k: v for k, v in self._locks.items() if v.locked()}
        return super().__getitem__(key)


_cache._CacheStats._log_level = 1  # below DEBUG: no statistics kept
for _index in (server.cache.root_cache, *server.cache.extra_caches):
    _index._packages = _Lists(MAX_FILES)
    _index._package_locks = _Locks()


def _refuse(start_response, status: str, text: str):
    body = text.encode() + b"\n"
    start_response(status, [("Content-Type", "text/plain"), ("Content-Length", str(len(body))),
                            ("Allow", "GET, HEAD")])
    return [body]


def app(environ, start_response):
    """proxpi's WSGI app behind the checks of the module docstring."""
    if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
        return _refuse(start_response, "405 Method Not Allowed", "only GET and HEAD")
    path = environ.get("PATH_INFO", "")
    if path not in ("/health", "/index/"):
        parts = path.split("/")
        if len(parts) != 4 or parts[0] or parts[1] != "index" or not _NAME.match(parts[2]) \
                or parts[3] in (".", ".."):
            return _refuse(start_response, "404 Not Found", "not found")
        environ["PATH_INFO"] = f"/index/{normalise(parts[2])}/{parts[3]}"
    return server.app(environ, start_response)
