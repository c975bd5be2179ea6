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
#
# Each sandbox's disk is a loop-mounted file. A container's /dev holds no loop devices:
# given /dev/loop-control and the right to make loop block devices (Docker:
# `--device /dev/loop-control --device-cgroup-rule 'b 7:* rmw'`), this makes
# the missing ones of /dev/loop0..N-1 (N = FORKYARD_LOOP_DEVICES, default 256): the kernel
# hands out free ones host-wide, so the numbers must exist, and a privileged container
# (Kubernetes) gets only the host's loop devices of the moment it started. Without any,
# every create fails (the warning below says why).
set -e
case "${1:-}/${2:-}" in
  node/drain|node/undrain|node/ls|node/which|node/--help) is_node=0 ;;
  node/*) is_node=1 ;;
  *) is_node=0 ;;
esac
if [ "$is_node" = 1 ] && ! [ -w /proc/sys/net/ipv4/ip_forward ]; then
  mount -o remount,rw /proc/sys || {
    echo "forkyard-entrypoint: /proc/sys is read-only and cannot be remounted: give the container" \
         "CAP_SYS_ADMIN and AppArmor unconfined (see docs/deploy.md)" >&2
    exit 1
  }
fi
if [ "$is_node" = 1 ] && [ -c /dev/loop-control ]; then
  i=0
  while [ "$i" -lt "${FORKYARD_LOOP_DEVICES:-256}" ]; do
    [ -e "/dev/loop$i" ] || mknod -m 0660 "/dev/loop$i" b 7 "$i" || {
      echo "forkyard-entrypoint: cannot make /dev/loop$i: allow loop block devices" \
           "(--device-cgroup-rule 'b 7:* rmw', Compose device_cgroup_rules; see docs/deploy.md)" >&2
      exit 1
    }
    i=$((i + 1))
  done
fi
# DNS for what the node builds: templates take their resolver from this container's
# /etc/resolv.conf, skipping loopback ones (Docker's 127.0.0.11 on user-defined networks,
# which neither a chroot nor a sandbox can use). FORKYARD_DNS (a resolver the containers
# reach, deploy/compose/host-dns.sh) is added after Docker's, which still answers first
# (service names).
if [ "$is_node" = 1 ] && [ -n "${FORKYARD_DNS:-}" ] && ! grep -qs "^nameserver ${FORKYARD_DNS}\$" /etc/resolv.conf; then
  echo "nameserver ${FORKYARD_DNS}" >> /etc/resolv.conf || echo "forkyard-entrypoint: cannot add FORKYARD_DNS to /etc/resolv.conf" >&2
fi
if [ "$is_node" = 1 ] && ! [ -c /dev/loop-control ] && ! [ -b /dev/loop0 ]; then
  echo "forkyard-entrypoint: warning: no loop devices in this container: every sandbox create will fail" \
       "(its disk is a loop mount). Add --device /dev/loop-control --device-cgroup-rule 'b 7:* rmw'" \
       "(see docs/deploy.md), or FORKYARD_DISK_MB=0 for disks without a size bound" >&2
fi
exec /opt/forkyard/venv/bin/forkyard "$@"
