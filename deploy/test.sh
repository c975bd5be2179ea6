#!/usr/bin/env bash
# README command 2: install what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
# Test-only tools: docker-compose validates deploy/compose (tests/test_deploy.py); no service starts.
if ! command -v docker-compose >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose
fi
# The TypeScript SDK smoke test (tests/test_ts_sdk.py): node + npm and the pinned npm `e2b`.
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm
fi
npm ci --prefix tests/ts --no-audit --no-fund --silent
npm ci --prefix tests/e2bcli --no-audit --no-fund --silent  # the E2B CLI (tests/test_e2b_cli.py)
export FORKYARD_TEST_DATA_DIR=${FORKYARD_TEST_DATA_DIR:-/var/lib/forkyard-test}
exec .venv/bin/python -m pytest -v "$@"
