#!/usr/bin/env bash
# Start / stop a hand-started dockerd on a host whose PID 1 is not systemd, and undo what
# dockerd did to the host's networking when it stops.
#
#   deploy/docker/dockerd.sh start    # no-op when a dockerd already answers (then it is not ours)
#   deploy/docker/dockerd.sh stop     # stops only a dockerd this script started; cleans up
#   deploy/docker/dockerd.sh leftovers  # prints docker chains/bridges/processes still on the host
#
# What dockerd (20.10, Debian's docker.io) leaves behind when it exits, and what `stop`
# removes (measured on Debian 12, kernel 6.18, iptables-nft):
#   - filter: chains DOCKER, DOCKER-USER, DOCKER-ISOLATION-STAGE-1/2 and their jumps, which
#     it inserts AHEAD of every existing FORWARD rule; nat: chain DOCKER, the PREROUTING /
#     OUTPUT jumps into it and a MASQUERADE rule per bridge subnet;
#   - the docker0 bridge (and br-<id> bridges of networks it did not get to remove);
#   - if net.ipv4.ip_forward was 0 when it started, it sets it to 1 and the FORWARD policy
#     to DROP. `start` sets ip_forward=1 first (forkyard's node does the same and leaves it
#     on), so dockerd keeps the policy; `stop` restores the recorded policy anyway.
# ip_forward stays 1 after `stop`: a forkyard server on this host needs it.
# State (pid, policy, bridges that existed before) lives in $STATE; log in $LOG.
set -euo pipefail
STATE=${FORKYARD_DOCKERD_STATE:-/run/forkyard-dockerd.state}
LOG=${FORKYARD_DOCKERD_LOG:-/var/log/forkyard-dockerd.log}
PIDFILE=/run/forkyard-dockerd.pid
say() { printf '==> %s\n' "$*" >&2; }

docker_up() { timeout 10 docker info >/dev/null 2>&1; }
bridges() { ip -o link show type bridge 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E '^(docker0|br-[0-9a-f]{12})$' || true; }

# Delete every rule of table $1 chain $2 that matches the extended regex $3.
delete_rules() {
  local t=$1 c=$2 re=$3 rule
  { iptables -t "$t" -S "$c" 2>/dev/null || true; } | { grep -E -- "$re" || true; } | sed 's/^-A /-D /' \
    | while read -r rule; do eval "iptables -t $t $rule" || true; done
}
drop_chain() { iptables -t "$1" -F "$2" 2>/dev/null || true; iptables -t "$1" -X "$2" 2>/dev/null || true; }

start() {
  if docker_up; then
    say "a dockerd already answers; using it (this script will not stop it)"
    return 0
  fi
  command -v dockerd >/dev/null || { echo "dockerd missing: apt-get install docker.io docker-compose" >&2; exit 1; }
  local policy ipf
  policy=$(iptables -S FORWARD | awk '$1=="-P"{print $3}')
  ipf=$(cat /proc/sys/net/ipv4/ip_forward)
  # Forwarding on before dockerd starts, so dockerd does not switch FORWARD to DROP.
  echo 1 > /proc/sys/net/ipv4/ip_forward
  {
    echo "policy=$policy"
    echo "ip_forward_before=$ipf"
    echo "bridges_before='$(bridges | tr '\n' ' ')'"
  } > "$STATE"
  say "starting dockerd (log: $LOG)"
  setsid dockerd --pidfile "$PIDFILE" >>"$LOG" 2>&1 < /dev/null &
  echo "pid=$!" >> "$STATE"
  for _ in $(seq 1 120); do  # up to 60 s
    docker_up && { say "dockerd is up"; return 0; }
    kill -0 "$(sed -n 's/^pid=//p' "$STATE")" 2>/dev/null || break
    sleep 0.5
  done
  echo "dockerd did not come up; last log lines:" >&2
  tail -20 "$LOG" >&2
  stop
  exit 1
}

stop() {
  if [ ! -f "$STATE" ]; then
    say "no dockerd started by this script (no $STATE); nothing to stop"
    return 0
  fi
  # shellcheck disable=SC1090
  . "$STATE"
  # dockerd's own pidfile first (the recorded $! is the same process unless setsid forked).
  if [ -s "$PIDFILE" ]; then pid=$(cat "$PIDFILE"); fi
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd still alive after 30 s: SIGKILL"; kill -KILL "$pid"; }
  fi
  # containerd (started by dockerd as its child) and shims of containers, if any outlived it.
  for p in $(pgrep -f '^containerd --config /var/run/docker/containerd/containerd.toml' || true) \
           $(pgrep -f 'containerd-shim-runc-v2 -namespace moby' || true); do
    kill -TERM "$p" 2>/dev/null || true
  done
  say "removing dockerd's iptables chains and bridges"
  delete_rules filter FORWARD '(-j DOCKER|docker0|br-[0-9a-f]{12})'
  for c in DOCKER-USER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2 DOCKER; do drop_chain filter "$c"; done
  delete_rules nat PREROUTING '-j DOCKER'
  delete_rules nat OUTPUT '-j DOCKER'
  delete_rules nat POSTROUTING '(docker0|br-[0-9a-f]{12})'
  drop_chain nat DOCKER
  if [ -n "${policy:-}" ]; then iptables -P FORWARD "$policy"; fi
  for b in $(bridges); do
    case " ${bridges_before:-} " in *" $b "*) ;; *) ip link delete "$b" 2>/dev/null || true ;; esac
  done
  # Network namespaces dockerd bind-mounted for containers (normally gone with them).
  { grep -o ' /run/docker/netns/[^ ]*' /proc/self/mounts 2>/dev/null || true; } \
    | while read -r m; do umount "$m" 2>/dev/null || true; done
  rm -f "$STATE"
  say "dockerd stopped and cleaned up"
}

leftovers() {
  pgrep -a dockerd || true
  pgrep -af 'containerd-shim|containerd --config /var/run/docker' || true
  iptables -S 2>/dev/null | grep -E 'DOCKER|docker0|br-[0-9a-f]{12}' || true
  iptables -t nat -S 2>/dev/null | grep -E 'DOCKER|docker0|br-[0-9a-f]{12}' || true
  bridges
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  leftovers) leftovers ;;
  *) echo "usage: $0 start|stop|leftovers" >&2; exit 2 ;;
esac
