#!/bin/sh
# Container entrypoint (/usr/local/bin/forkyard-entrypoint): runs `forkyard "$@"`.
#
# For `forkyard node` only: container runtimes mount /proc/sys read-only (Docker's and
# Kubernetes' default masked/read-only paths), but the node writes sysctls of its sandboxes'
# network namespaces (e.g. net.ipv4.ip_forward inside each one). With CAP_SYS_ADMIN and
# AppArmor unconfined (the node's required settings, docs/deploy.md) this remounts /proc/sys
# read-write inside the container's own mount namespace; the host's /proc is untouched.
# Docker's `--security-opt systempaths=unconfined` does the same from outside (docker run
# only: Compose 1.29 and Kubernetes have no such option).
set -e
if [ "${1:-}" = node ] && [ "${2:-}" != drain ] && [ "${2:-}" != undrain ] && [ "${2:-}" != ls ] \
   && ! [ -w /proc/sys/net/ipv4/ip_forward ]; then
  mount -o remount,rw /proc/sys || {
    echo "forkyard-entrypoint: /proc/sys is read-only and cannot be remounted: give the container" \
         "CAP_SYS_ADMIN and AppArmor unconfined (see docs/deploy.md)" >&2
    exit 1
  }
fi
exec /opt/forkyard/venv/bin/forkyard "$@"
