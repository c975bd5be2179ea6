#!/usr/bin/env bash
# README command 2: install what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
export FORKYARD_TEST_DATA_DIR=${FORKYARD_TEST_DATA_DIR:-/var/lib/forkyard-test}
exec .venv/bin/python -m pytest -v "$@"
