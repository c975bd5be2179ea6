#!/usr/bin/env bash
# Builds the forkyard container image ($IMAGE, default forkyard:local) with no registry:
#   1. the local base image (deploy/docker/make-base-image.sh, skipped when present),
#   2. envd (make -C envd) and the pinned gVisor runsc (deploy/runsc/build.sh),
#   3. docker build from a small staged context (pyproject.toml, forkyard/, envd/bin/envd,
#      runsc, deploy/docker/{Dockerfile,entrypoint.sh})
#      instead of the whole checkout, so .venv and caches are never sent to dockerd.
# Needs a running dockerd (deploy/docker/dockerd.sh start). Measured here (2 cores): base
# image ~35 s, image build ~90 s the first time (apt + pip), seconds when cached.
set -euo pipefail
cd "$(dirname "$0")/../.."
IMAGE=${IMAGE:-forkyard:local}
BASE_IMAGE=${BASE_IMAGE:-forkyard/bookworm:local}
say() { printf '==> %s\n' "$*" >&2; }

if [ "$BASE_IMAGE" = forkyard/bookworm:local ]; then
  IMAGE=$BASE_IMAGE bash deploy/docker/make-base-image.sh
fi
say "building envd"
make -s -C envd
say "building runsc (once; cached in /usr/local/lib/forkyard)"
bash deploy/runsc/build.sh >&2
ctx=$(mktemp -d /var/tmp/forkyard-ctx.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/envd/bin" "$ctx/deploy/docker" "$ctx/runsc"
cp pyproject.toml "$ctx/"
cp -r forkyard "$ctx/"
find "$ctx/forkyard" -name __pycache__ -prune -exec rm -rf {} +
cp envd/bin/envd "$ctx/envd/bin/envd"
cp -L /usr/local/lib/forkyard/runsc "$ctx/runsc/runsc"
cp deploy/docker/Dockerfile deploy/docker/entrypoint.sh "$ctx/deploy/docker/"
say "docker build -> $IMAGE (base $BASE_IMAGE)"
docker build -q -f "$ctx/deploy/docker/Dockerfile" --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$IMAGE" "$ctx" >/dev/null
docker image ls "$IMAGE"
