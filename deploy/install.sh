#!/usr/bin/env bash
# Installs everything forkyard needs on a Debian 12 host (idempotent, quick when done):
#   runsc (gVisor built from source, pinned and patched, at /usr/local/lib/forkyard/runsc —
#   deploy/runsc/build.sh, docs/runtime.md), debootstrap, iproute2, iptables, skopeo; the Python
#   package with test extras in ./.venv; the static envd binary (envd/bin/envd); for the package
#   cache (FORKYARD_PACKAGE_CACHE=on, docs/templates.md) squid and its account forkyard-cache.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
[ "$(id -u)" = 0 ] || { echo "forkyard needs root (netns, iptables, runsc): run with sudo" >&2; exit 1; }

need_pkgs=()
# redis-server: the cluster's state store (tests start their own on a free port).
# skopeo: pulls template images from OCI registries (forkyard/templates/registry.py).
for p in debootstrap iproute2 iptables redis-server patch skopeo; do dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p"); done
# squid: the package cache's npm and apt proxy (forkyard/pkgcache); the OpenSSL build, which
# fetches from the npm registry over verified TLS. A squid already installed is kept.
command -v squid >/dev/null 2>&1 || [ -x /usr/sbin/squid ] || need_pkgs+=(squid-openssl)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  say "apt-get install ${need_pkgs[*]}"
  apt-get update -qq
  # Packages must not start services here (redis-server would otherwise start on :6379):
  # a policy-rc.d that refuses every start, removed again afterwards.
  had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" || { [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d
fi
# The package cache's services run as this account (FORKYARD_PACKAGE_CACHE_USER), never as root.
id -u forkyard-cache >/dev/null 2>&1 || useradd --system --no-create-home --home-dir /nonexistent \
  --shell /usr/sbin/nologin forkyard-cache
# gVisor: built from source, pinned and patched (docs/runtime.md); a no-op once built.
bash deploy/runsc/build.sh

# The project's own virtual environment, so checkouts never take over each other's
# (or the system's) Python packages.
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  "${PYTHON:-python3}" -m venv .venv
fi
if ! .venv/bin/python -c 'import forkyard, e2b, pytest, blake3, fastcdc.fastcdc_cy, boto3, redis' 2>/dev/null || [ pyproject.toml -nt .venv/.stamp ]; then
  say "pip install -e .[test] into .venv"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  touch .venv/.stamp
fi

say "building envd"
make -s -C envd
echo "ok: envd at envd/bin/envd"  # (build.sh said which runsc)
