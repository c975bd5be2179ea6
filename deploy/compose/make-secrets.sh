#!/usr/bin/env bash
# Writes the simulated cluster's secrets into DIR (created 0700; files 0600), the files
# deploy/compose/docker-compose.yml reads through FORKYARD_SECRETS=DIR:
#   cluster_secret   node <-> scheduler <-> gateway secret (not the users' key)
#   api_key          the users' API key (E2B_API_KEY), the same on gateway and nodes
#   redis.conf       `requirepass ...` for the redis service
#   secrets.env      FORKYARD_REDIS_URL with that password; S3 credentials for moto
# Existing files are kept. Usage: deploy/compose/make-secrets.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
umask 077
mkdir -p "$dir"
chmod 0700 "$dir"
rand() { python3 -c 'import secrets; print(secrets.token_hex(32))'; }
[ -s "$dir/cluster_secret" ] || rand > "$dir/cluster_secret"
[ -s "$dir/api_key" ] || echo "e2b_$(rand | cut -c1-40)" > "$dir/api_key"
if [ ! -s "$dir/redis.conf" ] || [ ! -s "$dir/secrets.env" ]; then
  pw=$(rand)
  echo "requirepass $pw" > "$dir/redis.conf"
  cat > "$dir/secrets.env" <<EOS
FORKYARD_REDIS_URL=redis://:$pw@redis:6379/0
AWS_ACCESS_KEY_ID=forkyard
AWS_SECRET_ACCESS_KEY=$(rand)
EOS
fi
chmod 0600 "$dir"/*
