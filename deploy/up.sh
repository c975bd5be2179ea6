#!/usr/bin/env bash
# README command 1: install what is missing, build the `base` template once (cached),
# start the server on 127.0.0.1:3000 with embedded defaults. Extra args go to `forkyard serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    cat <<'EOT'
Usage: ./deploy/up.sh [forkyard serve options]   (as root)
Installs what is missing (runsc, the Python environment, envd), builds the `base`
template once, then runs `forkyard serve` on 127.0.0.1:3000 with these options
(see `.venv/bin/forkyard serve --help` once installed). Settings come from the
environment: FORKYARD_PORT, FORKYARD_DATA_DIR (default /var/lib/forkyard); a second
server on the same host also needs its own FORKYARD_NET_PREFIX and FORKYARD_OUTER_NET
(README, "Settings").
EOT
    exit 0
  fi
done
bash deploy/install.sh
exec .venv/bin/forkyard serve "$@"
