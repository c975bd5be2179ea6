"""What the package cache's services are told (squid's configuration, proxpi's
environment) and what a sandbox is given to use them (its ``pip``, ``npm`` and ``apt``
configuration files).

The upstreams are fixed here, and they are the allowlist: proxpi fetches from one
Python index (and the files that index lists), squid's npm port is a reverse proxy of
one registry (every request goes to it, whatever the request names), and squid's apt
port is a forward proxy that fetches plain-HTTP ``GET``/``HEAD`` from the listed Debian
hosts on port 80 and refuses anything else (another host, an address, ``CONNECT``). The
apt allowlist is by host name: what those names resolve to on the host is trusted (a
private mirror may be listed), except loopback, which squid never fetches from.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
import urllib.parse
from dataclasses import dataclass

from forkyard.config import PackageCacheSettings

#: TCP ports on the cache's address: Python packages (proxpi; devpi's usual port), apt
#: (squid as a forward proxy; apt-cacher-ng's usual port), npm (squid as a reverse proxy
#: of the registry; verdaccio's usual port).
PYPI_PORT, APT_PORT, NPM_PORT = 3141, 3142, 4873
PORTS = (PYPI_PORT, APT_PORT, NPM_PORT)
#: Connections squid may hold (its file descriptors; the supervisor raises its limit to
#: this): with at most ``HostServices.max_conns`` per sandbox, hundreds of sandboxes.
MAX_FDS = 16384
#: First line of every file forkyard writes into a sandbox for the cache: a file that
#: starts with it is forkyard's (rewritten at create, removed before a template build's
#: snapshot); any other file at that path is the image's and is left alone.
MARKER = "# forkyard package cache (FORKYARD_PACKAGE_CACHE=on): written by the node"
_HOST = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)+$")


class PackageCacheError(Exception):
    """The package cache cannot run as configured; the message is one line that names the
    setting or the missing part and what to do."""


@dataclass(frozen=True)
class Upstreams:
    """The checked upstreams (the allowlist).

    Attributes:
        pypi_index: the Python index URL (``https://…/``, ending in ``/``).
        npm_host / npm_port: the npm registry (HTTPS).
        apt_hosts: the hosts apt may fetch from (plain HTTP, port 80).
    """

    pypi_index: str
    npm_host: str
    npm_port: int
    apt_hosts: tuple[str, ...]


def check(settings: PackageCacheSettings) -> Upstreams:
    """Validate ``settings``' address, size and upstreams.

    Raises:
        PackageCacheError: one of them is malformed (the message names the setting).
    """
    try:
        addr = ipaddress.IPv4Address(settings.address)
    except ValueError:
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_ADDR: {settings.address!r} is not an IPv4 address") from None
    if addr.is_loopback or addr.is_multicast or addr.is_unspecified:
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_ADDR: {addr} cannot be reached from sandboxes "
                                "(use a link-local address such as 169.254.77.1)")
    if settings.size_mb < 64:
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_MB: {settings.size_mb} is too small (at least 64)")
    pypi = urllib.parse.urlsplit(settings.pypi_index)
    if pypi.scheme != "https" or not pypi.hostname or pypi.username or pypi.password or pypi.query:
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_PYPI: {settings.pypi_index!r} is not an https:// index URL "
                                "without credentials")
    npm = urllib.parse.urlsplit(settings.npm_registry)
    if npm.scheme != "https" or not npm.hostname or npm.path not in ("", "/") or npm.username or npm.query:
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_NPM: {settings.npm_registry!r} is not https://HOST[:PORT]")
    if not settings.apt_hosts or not all(_HOST.match(h) for h in settings.apt_hosts):
        raise PackageCacheError(f"FORKYARD_PACKAGE_CACHE_APT_HOSTS: {','.join(settings.apt_hosts)!r} is not a "
                                "comma-separated list of host names")
    index = settings.pypi_index if settings.pypi_index.endswith("/") else settings.pypi_index + "/"
    return Upstreams(index, npm.hostname, npm.port or 443, tuple(settings.apt_hosts))


def squid_conf(address: str, up: Upstreams, cache_dir: str, cache_mb: int) -> str:
    """squid's whole configuration: the npm reverse proxy on :data:`NPM_PORT`, the apt
    forward proxy on :data:`APT_PORT` (both on ``address`` only), a disk cache of
    ``cache_mb`` MiB in ``cache_dir`` (least recently used objects go first), logs on
    stdout/stderr (the supervisor bounds them), every time bounded."""
    apt = " ".join(up.apt_hosts)
    return f"""# forkyard package cache: written at every start (forkyard/pkgcache/config.py)
http_port {address}:{NPM_PORT} accel defaultsite={up.npm_host} no-vhost name=npm
http_port {address}:{APT_PORT} name=apt
icp_port 0
htcp_port 0
snmp_port 0
visible_hostname forkyard-package-cache
httpd_suppress_version_string on
via off
forwarded_for delete
client_db off
pinger_enable off
pid_filename none
coredump_dir none
cache_log /dev/stderr
access_log stdio:/dev/stdout squid
logfile_rotate 0
max_filedescriptors {MAX_FDS}
shutdown_lifetime 2 seconds

# npm: every request goes to the one registry over verified TLS
cache_peer {up.npm_host} parent {up.npm_port} 0 no-query no-digest originserver tls name=npm_registry
acl npm_port myportname npm
acl npm_site dstdomain -n {up.npm_host}
cache_peer_access npm_registry allow npm_port npm_site
cache_peer_access npm_registry deny all
never_direct allow npm_port

# apt: plain HTTP to the listed hosts, port 80, nothing else (-n: by the name in the
# request only; an address is never looked up, whose reverse name a tenant may control)
acl apt_port myportname apt
acl apt_hosts dstdomain -n {apt}
acl port80 port 80
acl fetch_methods method GET HEAD
always_direct allow apt_port

http_access deny manager
http_access deny CONNECT
http_access deny !fetch_methods
http_access deny to_localhost
http_access allow npm_port npm_site
http_access allow apt_port apt_hosts port80
http_access deny all
http_reply_access allow all
# Anonymous upstreams: a client's credentials never reach them (and never make an answer
# for one tenant's account land in the cache every tenant reads)
request_header_access Authorization deny all
request_header_access Proxy-Authorization deny all
request_header_access Cookie deny all
request_header_max_size 64 KB
request_body_max_size 64 KB
reply_header_max_size 64 KB

connect_timeout 30 seconds
peer_connect_timeout 30 seconds
read_timeout 5 minutes
request_timeout 1 minute
client_lifetime 1 hour
persistent_request_timeout 1 minute

cache_mem 64 MB
maximum_object_size_in_memory 1 MB
maximum_object_size 1024 MB
cache_dir ufs {cache_dir} {cache_mb} 16 256
cache_replacement_policy lru
# Package files never change under one name; indexes are revalidated at every use.
refresh_pattern -i \\.(deb|udeb|tgz)$ 129600 100% 129600
refresh_pattern /by-hash/ 129600 100% 129600
# npm metadata: fresh as long as the registry says (max-age: 5 min), or 5 min when the
# answer says nothing, also when npm asks to revalidate: many sandboxes installing at
# once ask the registry once
refresh_pattern -i ^http://{re.escape(up.npm_host)}/ 5 20% 5 ignore-reload
refresh_pattern (Release|Release\\.gpg|InRelease|Packages(\\.gz|\\.xz)?|Sources(\\.gz|\\.xz)?|Translation-.*)$ 0 0% 0 refresh-ims
refresh_pattern . 0 20% 4320
"""


def proxpi_env(up: Upstreams, cache_dir: str, cache_mb: int) -> dict[str, str]:
    """proxpi's environment: the one index, a file cache of ``cache_mb`` MiB in
    ``cache_dir`` (least used files go first), index listings kept 30 min, and every
    download waited for (proxpi would otherwise redirect a slow one to the upstream,
    which sandboxes cannot reach)."""
    return {
        "PROXPI_INDEX_URL": up.pypi_index,
        "PROXPI_CACHE_DIR": cache_dir,
        "PROXPI_CACHE_SIZE": str(cache_mb << 20),
        "PROXPI_INDEX_TTL": "1800",
        "PROXPI_DOWNLOAD_TIMEOUT": "600",
        "PROXPI_CONNECT_TIMEOUT": "30",
        "PROXPI_READ_TIMEOUT": "120",
        "PROXPI_LOGGING_LEVEL": "DEBUG",
    }


def guest_files(address: str, services: set[str]) -> dict[str, str]:
    """The files a sandbox gets for the services in ``services`` (``pypi``, ``npm``,
    ``apt``): path → content (each starting with :data:`MARKER`).

    * pip: ``/etc/xdg/pip/pip.conf`` (pip's site-wide file read before ``/etc/pip.conf``,
      so an image's own ``/etc/pip.conf`` still wins);
    * npm: ``/etc/npmrc`` (Debian's npm), ``/usr/etc/npmrc`` (Node.js in ``/usr``) and
      ``/usr/local/etc/npmrc`` (Node.js in ``/usr/local``, as the official images): the
      global config of each usual prefix; npm rewrites the registry's tarball URLs to the
      configured registry (``replace-registry-host``);
    * apt: ``/etc/apt/apt.conf.d/90forkyard-package-cache`` (an HTTP proxy, HTTPS sources
      are not proxied; cached index files may be a day old, which lets the immutable
      by-hash lists come from the cache, while squid revalidates ``InRelease``).
    """
    out: dict[str, str] = {}
    if "pypi" in services:
        out["/etc/xdg/pip/pip.conf"] = (f"{MARKER}\n[global]\nindex-url = http://{address}:{PYPI_PORT}/index/\n"
                                        f"trusted-host = {address}:{PYPI_PORT}\n")
    if "npm" in services:
        npmrc = f"{MARKER}\nregistry=http://{address}:{NPM_PORT}/\n"
        for path in ("/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc"):
            out[path] = npmrc
    if "apt" in services:
        # Max-Age: apt asks for index files with max-age=0 by default, which would fetch
        # the by-hash package lists (immutable) again for every sandbox; the cache itself
        # still revalidates Release/InRelease at every use.
        out["/etc/apt/apt.conf.d/90forkyard-package-cache"] = (
            f'{MARKER}\nAcquire::http::Proxy "http://{address}:{APT_PORT}/";\nAcquire::http::Max-Age "86400";\n')
    return out


#: Every path :func:`guest_files` may write (what a template build's finalize removes).
GUEST_PATHS = ("/etc/xdg/pip/pip.conf", "/etc/npmrc", "/usr/etc/npmrc", "/usr/local/etc/npmrc",
               "/etc/apt/apt.conf.d/90forkyard-package-cache")


def install_script(files: dict[str, str]) -> str:
    """A ``/bin/sh`` script (run as root) that writes ``files`` (mode 0644), each only
    where no file is or where the one there is forkyard's (:data:`MARKER`)."""
    q = shlex.quote
    lines = [f"m={q(MARKER)}",
             'put() { if [ -e "$1" ]; then IFS= read -r first < "$1" || first=; [ "$first" = "$m" ] || return 0; fi; '
             'mkdir -p "${1%/*}" && printf %s "$2" > "$1.fy$$" && chmod 0644 "$1.fy$$" && mv -f "$1.fy$$" "$1"; }']
    lines += [f"put {q(path)} {q(text)}" for path, text in sorted(files.items())]
    return "\n".join(lines) + "\n"


def remove_script(files: list[str]) -> str:
    """A ``/bin/sh`` script (run as root) that removes those of ``files`` that are
    forkyard's (:data:`MARKER`); the image's own stay."""
    q = shlex.quote
    lines = [f"m={q(MARKER)}",
             'drop() { [ -f "$1" ] || return 0; IFS= read -r first < "$1" || first=; '
             '[ "$first" = "$m" ] && rm -f "$1"; return 0; }']
    lines += [f"drop {q(path)}" for path in sorted(files)]
    return "\n".join(lines) + "\n"
