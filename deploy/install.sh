#!/usr/bin/env bash
# Installs everything forkyard needs on a Debian 12 host (idempotent, quick when done):
#   runsc (gVisor 20240729 from Debian trixie, pinned to that one package — see
#   shared/DESIGN.md §2), debootstrap, iproute2, iptables; the Python package with test
#   extras in ./.venv; the static envd binary (envd/bin/envd).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
[ "$(id -u)" = 0 ] || { echo "forkyard needs root (netns, iptables, runsc): run with sudo" >&2; exit 1; }

need_pkgs=()
# (no `grep -q` here: it closes the pipe early and pipefail then fails the check)
runsc_ok() { [[ "$(runsc --version 2>/dev/null)" == *20240729* ]]; }
runsc_ok || need_pkgs+=(runsc)
# redis-server: the cluster's state store (tests start their own on a free port).
for p in debootstrap iproute2 iptables redis-server; do dpkg -s "$p" >/dev/null 2>&1 || need_pkgs+=("$p"); done
if [ ${#need_pkgs[@]} -gt 0 ]; then
  if [[ " ${need_pkgs[*]} " == *" runsc "* ]] && [ ! -f /etc/apt/sources.list.d/forkyard-trixie.sources ]; then
    say "adding a trixie apt source pinned to the runsc package only"
    # Reuse the mirror this machine is already configured with.
    uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    [ -n "$uri" ] || uri=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list)
    cat > /etc/apt/sources.list.d/forkyard-trixie.sources <<EOS
Types: deb
URIs: $uri
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
    cat > /etc/apt/preferences.d/forkyard-trixie <<EOS
Package: *
Pin: release n=trixie
Pin-Priority: 1

Package: runsc
Pin: release n=trixie
Pin-Priority: 990
EOS
  fi
  say "apt-get install ${need_pkgs[*]}"
  apt-get update -qq
  # Packages must not start services here (redis-server would otherwise start on :6379):
  # a policy-rc.d that refuses every start, removed again afterwards.
  had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; }
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" || { [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d
fi
runsc_ok || { echo "runsc 20240729 did not install; see shared/DESIGN.md §2" >&2; exit 1; }

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
echo "ok: runsc $(runsc --version | head -1 | awk '{print $3}'), envd at envd/bin/envd"
