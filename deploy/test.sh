#!/usr/bin/env bash
# README command 2: install what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
# Test-only tools: docker-compose validates deploy/compose (tests/test_deploy.py); no service starts.
if ! command -v docker-compose >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose
fi
export FORKYARD_TEST_DATA_DIR=${FORKYARD_TEST_DATA_DIR:-/var/lib/forkyard-test}
# MinIO: the tests' S3 server (real signatures, keys and regions, unlike an emulator).
# Built once from the Go module proxy (~2-4 min on 2 cores, 150 MB) and cached.
MINIO_MODULE=github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c
export FORKYARD_MINIO=${FORKYARD_MINIO:-$FORKYARD_TEST_DATA_DIR/bin/minio}
if [ ! -x "$FORKYARD_MINIO" ]; then
  echo "==> building MinIO for the S3 tests (once): go install $MINIO_MODULE"
  mkdir -p "$(dirname "$FORKYARD_MINIO")"
  CGO_ENABLED=0 GOBIN="$(dirname "$FORKYARD_MINIO")" go install "$MINIO_MODULE"
fi
exec .venv/bin/python -m pytest -v "$@"
