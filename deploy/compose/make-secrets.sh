#!/usr/bin/env bash
# Writes the simulated cluster's secrets into DIR (created 0700; files 0600), the files
# deploy/compose/docker-compose.yml reads through FORKYARD_SECRETS=DIR:
#   cluster_secret   the control plane's master secret (scheduler and gateway only; not
#                    the users' key)
#   node1_key ...    each node's own key, bound to its id and URL (http://nodeN:3000),
#                    derived from cluster_secret (`forkyard cluster node-key`): a node
#                    holds only its own key
#   api_key          the users' API key (E2B_API_KEY), the same on gateway and nodes
#   redis.conf       `requirepass ...` for the redis service
#   redis.env        FORKYARD_REDIS_URL with that password (scheduler and gateway only)
#   secrets.env      S3 credentials for moto (every forkyard service)
# Existing files are kept. Usage: deploy/compose/make-secrets.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
src=$(cd "$(dirname "$0")/../.." && pwd)
umask 077
mkdir -p "$dir"
chmod 0700 "$dir"
rand() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
[ -s "$dir/cluster_secret" ] || rand > "$dir/cluster_secret"
[ -s "$dir/api_key" ] || echo "e2b_$(rand | cut -c1-40)" > "$dir/api_key"
[ -s "$dir/redis.conf" ] || echo "requirepass $(rand)" > "$dir/redis.conf"
pw=$(sed -n 's/^requirepass //p' "$dir/redis.conf")
[ -s "$dir/redis.env" ] || echo "FORKYARD_REDIS_URL=redis://:$pw@redis:6379/0" > "$dir/redis.env"
if [ ! -s "$dir/secrets.env" ]; then
  printf 'AWS_ACCESS_KEY_ID=forkyard\nAWS_SECRET_ACCESS_KEY=%s\n' "$(rand)" > "$dir/secrets.env"
fi
sed -i '/^FORKYARD_REDIS_URL=/d' "$dir/secrets.env"  # an older DIR gave it to the nodes too
for n in 1 2 3; do  # stdlib-only module: no installed forkyard needed
  [ -s "$dir/node${n}_key" ] || FY_SECRET_FILE="$dir/cluster_secret" PYTHONPATH="$src" python3 -c '
import os, sys
from forkyard.cluster.nodekeys import node_key
print(node_key(open(os.environ["FY_SECRET_FILE"]).read().strip(), sys.argv[1], sys.argv[2]))' \
    "node$n" "http://node$n:3000" > "$dir/node${n}_key"
done
chmod 0600 "$dir"/*
