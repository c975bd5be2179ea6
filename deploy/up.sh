#!/usr/bin/env bash
# README command 1: install what is missing, build the `base` template once (cached),
# start the server on 127.0.0.1:3000 with embedded defaults. Extra args go to `forkyard serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
exec .venv/bin/forkyard serve "$@"
