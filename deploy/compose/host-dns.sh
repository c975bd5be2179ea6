#!/usr/bin/env bash
# Prints a DNS resolver that containers on this host can reach, for FORKYARD_DNS
# (deploy/compose/docker-compose.yml): the first nameserver of /etc/resolv.conf that is
# not on loopback; when the host resolves through a loopback stub (systemd-resolved
# 127.0.0.53, dnsmasq 127.0.0.1, ...), the upstream it uses (systemd-resolved's
# /run/systemd/resolve/resolv.conf). Exits 1 with a message when there is none.
set -euo pipefail
for f in /etc/resolv.conf /run/systemd/resolve/resolv.conf; do
  [ -r "$f" ] || continue
  ns=$(awk '$1 == "nameserver" && $2 !~ /^(127\.|::1$|0\.0\.0\.0$)/ {print $2; exit}' "$f")
  if [ -n "$ns" ]; then echo "$ns"; exit 0; fi
done
echo "no non-loopback DNS resolver found in /etc/resolv.conf or /run/systemd/resolve/resolv.conf:" \
     "set FORKYARD_DNS to one the containers can reach" >&2
exit 1
