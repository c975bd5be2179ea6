#!/usr/bin/env bash
# Smoke test of the Compose cluster (deploy/compose/docker-compose.yml), end to end:
#   starts dockerd if none runs (deploy/docker/dockerd.sh), builds forkyard:local and
#   forkyard-support:local without a registry, brings up redis, s3 (moto), scheduler,
#   gateway and 3 nodes, waits for every healthcheck, runs deploy/compose/smoke_sdk.py (the
#   e2b SDK on every node: create, commands.run, pause, resume, fork, kill) against the
#   gateway, then removes the containers, networks and volumes, and stops dockerd if it
#   started it.
#
#   sudo deploy/compose/smoke.sh          # prints the time of each phase
#
# Settings: FORKYARD_SMOKE_TEMPLATES (host dir caching the `base` template between runs,
# default /var/lib/forkyard-smoke/templates; "volume" for a fresh volume, +~60 s),
# FORKYARD_SMOKE_KEEP=1 leaves the cluster up (and dockerd) for a look, FORKYARD_DNS (the
# containers' resolver; default: deploy/compose/host-dns.sh).
# Measured on this project's machines (2 cores): see docs/deploy.md "Compose".
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
COMPOSE_FILE=deploy/compose/docker-compose.yml
PROJECT=forkyard-smoke
T0=$(date +%s)
phase() { printf '\033[1m==> [%4ss] %s\033[0m\n' "$(( $(date +%s) - T0 ))" "$*" >&2; }
python=${PYTHON:-$REPO/.venv/bin/python}

secrets=$(mktemp -d /tmp/forkyard-smoke-secrets.XXXXXX)
export FORKYARD_SECRETS=$secrets
port=$("$python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
export FORKYARD_GATEWAY_PUBLISH=127.0.0.1:$port
templates=${FORKYARD_SMOKE_TEMPLATES:-/var/lib/forkyard-smoke/templates}
if [ "$templates" != volume ]; then mkdir -p "$templates"; export FORKYARD_TEMPLATES=$templates; fi
export FORKYARD_DNS=${FORKYARD_DNS:-$(bash deploy/compose/host-dns.sh)}
own_dockerd=0  # stop dockerd at the end only if this script (or dockerd.sh) started it
compose() { docker-compose -p "$PROJECT" -f "$COMPOSE_FILE" "$@"; }

cleanup() {
  rc=$?
  if [ "${FORKYARD_SMOKE_KEEP:-0}" = 1 ]; then
    phase "kept: FORKYARD_SECRETS=$secrets docker-compose -p $PROJECT -f $COMPOSE_FILE ..."
    exit $rc
  fi
  if [ $rc != 0 ] && docker info >/dev/null 2>&1; then
    compose ps >&2 || true
    compose logs --no-color --tail 40 >&2 || true
  fi
  phase "tearing down"
  docker info >/dev/null 2>&1 && compose down -v --remove-orphans -t 20 >/dev/null 2>&1 || true
  rm -rf "$secrets"
  [ "$own_dockerd" = 1 ] && bash deploy/docker/dockerd.sh stop || true
  phase "done (exit $rc)"
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

phase "dockerd"
[ -f /run/forkyard-dockerd.state ] || ! docker info >/dev/null 2>&1 && own_dockerd=1
bash deploy/docker/dockerd.sh start
phase "images (base, forkyard:local, forkyard-support:local)"
bash deploy/docker/build.sh
docker build -q -f deploy/compose/support.Dockerfile -t forkyard-support:local deploy/compose >/dev/null
if ! docker run --rm forkyard:local gateway --help >/dev/null 2>&1; then
  echo "this checkout's forkyard has no 'gateway' subcommand: the cluster code has not landed" >&2
  exit 1
fi
bash deploy/compose/make-secrets.sh "$secrets"
compose config -q
phase "compose up (the first start builds the shared base template unless cached)"
compose up -d
want="redis s3 scheduler gateway node1 node2 node3"
deadline=$(( $(date +%s) + 900 ))
while :; do
  bad=""
  for s in $want; do
    id=$(compose ps -q "$s")
    st=$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id" 2>/dev/null || echo missing)
    case "$st" in running/healthy) ;; exited/*|dead/*|missing) echo "$s: $st" >&2; exit 1 ;; *) bad="$bad $s" ;; esac
  done
  [ -z "$bad" ] && break
  [ "$(date +%s)" -lt "$deadline" ] || { echo "not healthy after 900 s:$bad" >&2; exit 1; }
  sleep 2
done
phase "all healthy; nodes as the scheduler sees them:"
compose exec -T scheduler forkyard node ls --scheduler http://127.0.0.1:9090 >&2 || true
phase "e2b SDK flow against the gateway at 127.0.0.1:$port"
E2B_API_URL=http://127.0.0.1:$port E2B_SANDBOX_URL=http://127.0.0.1:$port E2B_API_KEY=$(cat "$secrets/api_key") \
  "$python" deploy/compose/smoke_sdk.py 3
phase "smoke ok"
