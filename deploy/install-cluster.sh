#!/usr/bin/env bash
# Installs forkyard cluster components as systemd services on a Debian 12 host.
#
#   sudo deploy/install-cluster.sh [--roles node,scheduler,gateway,redis] [--enable]
#   sudo deploy/install-cluster.sh --root DIR      # files only, under DIR (no packages, no systemctl)
#
# Roles (default: all four, a one-host cluster):
#   node       runsc, debootstrap, envd (through deploy/install.sh) + forkyard-node.service
#   scheduler  forkyard-scheduler.service          gateway  forkyard-gateway.service
#   redis      apt redis-server 7.0 + forkyard-redis.service (AOF on); Debian's own
#              redis-server.service is disabled so the two do not fight over port 6379
# What it writes:
#   /opt/forkyard/venv          the Python package (not editable) and its `forkyard` script
#   /opt/forkyard/bin/envd      the in-sandbox agent (node role)
#   /etc/systemd/system/forkyard-*.service
#   /etc/forkyard/{cluster,node,scheduler,gateway}.env   settings, 0644, kept if present
#   /etc/forkyard/redis.conf                              0644, kept if present
#   /etc/forkyard/cluster_secret, api_key, redis-secret.conf, secrets.env   0600, generated
#       once and kept (scheduler/gateway/redis roles): copy them to the other control-plane
#       hosts (same values); node hosts get api_key and secrets.env, never cluster_secret
#   /etc/forkyard/node_key      0600 (node role): this node's own key, minted from
#       cluster_secret when this host has it (a one-host cluster); on other node hosts copy
#       one minted with `forkyard cluster node-key ID --url URL` (docs/deploy.md)
# With --enable (and systemd as PID 1) the selected services are enabled and started;
# otherwise the systemctl commands are printed. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=$PWD
ROOT=""
ROLES="node,scheduler,gateway,redis"
ENABLE=0
PREFIX=/opt/forkyard
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --root) ROOT=$(realpath -m "$2"); shift 2 ;;
    --roles) ROLES=$2; shift 2 ;;
    --enable) ENABLE=1; shift ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
has_role() { [[ ",$ROLES," == *",$1,"* ]]; }
for r in ${ROLES//,/ }; do
  case "$r" in node|scheduler|gateway|redis) ;; *) echo "unknown role: $r" >&2; exit 2 ;; esac
done
[ "$(id -u)" = 0 ] || [ -n "$ROOT" ] || { echo "run as root (sudo)" >&2; exit 1; }

ETC=$ROOT/etc/forkyard
UNITS=$ROOT/etc/systemd/system

# --- packages and the Python package (skipped with --root) -------------------------------
if [ -z "$ROOT" ]; then
  if has_role node; then
    say "node: runsc, debootstrap, iptables, envd (deploy/install.sh)"
    bash deploy/install.sh
  fi
  need=()
  dpkg -s python3-venv >/dev/null 2>&1 || need+=(python3-venv)
  has_role redis && ! dpkg -s redis-server >/dev/null 2>&1 && need+=(redis-server)
  if [ ${#need[@]} -gt 0 ]; then
    say "apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi
  say "Python package into $PREFIX/venv"
  # Debian's interpreter, readable by the services' unprivileged users (DynamicUser=); an
  # interpreter under /root (e.g. pyenv) is not. Override with PYTHON=...
  [ -x "$PREFIX/venv/bin/python" ] || "${PYTHON:-/usr/bin/python3}" -m venv "$PREFIX/venv"
  "$PREFIX/venv/bin/pip" install -q --disable-pip-version-check --upgrade "$SRC"
  if has_role node; then
    install -D -m 0755 envd/bin/envd "$PREFIX/bin/envd"
  fi
fi

# --- configuration and secrets ---------------------------------------------------------
install -d -m 0755 "$ETC" "$UNITS"
keep_or_copy() {  # $1 source, $2 destination, $3 mode: never overwrite an edited file
  if [ -e "$2" ]; then say "keeping $2"; else install -m "$3" "$1" "$2"; fi
}
rand_hex() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
secret_file() {  # $1 path, $2 content[, $3 what to do with it]: create once, mode 0600
  if [ ! -s "$1" ]; then
    (umask 077; printf '%s\n' "$2" > "$1")
    say "generated $1 (0600): ${3:-copy it to the other hosts of the cluster that need it (docs/deploy.md)}"
  fi
  chmod 0600 "$1"
}
keep_or_copy deploy/systemd/etc/cluster.env "$ETC/cluster.env" 0644
if has_role scheduler || has_role gateway || has_role redis; then
  secret_file "$ETC/cluster_secret" "$(rand_hex)"
  secret_file "$ETC/redis-secret.conf" "requirepass $(rand_hex)"
fi
secret_file "$ETC/api_key" "e2b_$(rand_hex | cut -c1-40)"
secret_file "$ETC/secrets.env" "$(cat deploy/systemd/etc/secrets.env.example)"
if has_role node && [ ! -s "$ETC/node_key" ]; then
  if [ -s "$ETC/cluster_secret" ]; then
    # This host's node as node.env leaves it by default: id = host name, URL = http://127.0.0.1:3000
    # (the stdlib-only module, so no installed package is needed).
    key=$(FORKYARD_SECRET_FILE="$ETC/cluster_secret" PYTHONPATH="$SRC" python3 -c '
import os, socket
from forkyard.cluster.nodekeys import node_key
print(node_key(open(os.environ["FORKYARD_SECRET_FILE"]).read().strip(), socket.gethostname(), "http://127.0.0.1:3000"))')
    secret_file "$ETC/node_key" "$key" "this host's node key (never copy it to another host)"
  else
    say "no $ETC/node_key: on a scheduler host run \`forkyard cluster node-key $(hostname) --url URL --out FILE\` and copy FILE here (0600)"
  fi
fi

units=()
for r in node scheduler gateway redis; do
  has_role "$r" || continue
  case "$r" in
    redis) keep_or_copy deploy/systemd/etc/redis.conf "$ETC/redis.conf" 0644 ;;
    *) keep_or_copy "deploy/systemd/etc/$r.env" "$ETC/$r.env" 0644 ;;
  esac
  install -m 0644 "deploy/systemd/forkyard-$r.service" "$UNITS/forkyard-$r.service"
  units+=("forkyard-$r.service")
done
say "installed ${units[*]} into $UNITS"

# --- services ----------------------------------------------------------------------------
[ -n "$ROOT" ] && exit 0
if [ "$(cat /proc/1/comm 2>/dev/null)" != systemd ]; then
  say "PID 1 is not systemd: services not started. Start them by hand (see docs/deploy.md) or on a systemd host run:"
  echo "  systemctl daemon-reload && systemctl enable --now ${units[*]}"
  exit 0
fi
systemctl daemon-reload
if has_role redis && systemctl is-enabled -q redis-server.service 2>/dev/null; then
  say "disabling Debian's redis-server.service (forkyard-redis.service takes port 6379)"
  systemctl disable --now redis-server.service
fi
if [ "$ENABLE" = 1 ]; then
  systemctl enable --now "${units[@]}"
  systemctl --no-pager status "${units[@]}" | head -40
else
  echo "next: edit /etc/forkyard/*.env, then: systemctl enable --now ${units[*]}"
fi
