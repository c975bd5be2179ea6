#!/usr/bin/env bash
# README command 2: install what is missing, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/install.sh
# Test-only tools: docker-compose validates deploy/compose (tests/test_deploy.py); no service starts.
if ! command -v docker-compose >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose
fi
# Test-only tools for tests/test_observability.py and tests/test_console.py: a real
# Prometheus server (started by the test itself, never as a service: policy-rc.d refuses
# service starts during the install) and Debian's chromium for Playwright (browser
# downloads are unreachable; the test passes executable_path).
# Also docker.io: tests/test_deploy.py starts dockerd through deploy/docker/dockerd.sh and
# checks the host is left as it was (skipped where dockerd is missing).
# docker-registry: Debian's distribution registry, which tests/test_template_registry.py
# starts on loopback (never as a service) to push images to and pull templates from.
# gcc: builds tests/chaos/wallclock.c, the preload shim the chaos suite skews a process's
# wall clock with (tests/chaos/_faults.py).
obs_pkgs=()
command -v gcc >/dev/null || obs_pkgs+=(gcc libc6-dev)
command -v prometheus >/dev/null || obs_pkgs+=(prometheus)
command -v docker-registry >/dev/null || obs_pkgs+=(docker-registry)
command -v chromium >/dev/null || obs_pkgs+=(chromium)
command -v dockerd >/dev/null || obs_pkgs+=(docker.io)
if [ ${#obs_pkgs[@]} -gt 0 ]; then
  had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ $had_policy = 1 ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; }
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${obs_pkgs[@]}" >/dev/null \
    || { [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ $had_policy = 1 ] || rm -f /usr/sbin/policy-rc.d
fi
.venv/bin/python -c 'import playwright, prometheus_client, opentelemetry.sdk, opentelemetry.exporter.otlp.proto.http' 2>/dev/null \
  || .venv/bin/python -m pip install -q "playwright>=1.40" "prometheus-client>=0.20" \
       "opentelemetry-sdk>=1.20" "opentelemetry-exporter-otlp-proto-http>=1.20"
# The TypeScript SDK smoke test (tests/test_ts_sdk.py): node + npm and the pinned npm `e2b`.
if ! command -v npm >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm
fi
npm ci --prefix tests/ts --no-audit --no-fund --silent
npm ci --prefix tests/e2bcli --no-audit --no-fund --silent  # the E2B CLI (tests/test_e2b_cli.py)
export FORKYARD_TEST_DATA_DIR=${FORKYARD_TEST_DATA_DIR:-/var/lib/forkyard-test}
# MinIO: the tests' S3 server (real signatures, keys and regions, unlike an emulator).
# Built once from the Go module proxy (~2-4 min on 2 cores, 150 MB) and cached.
MINIO_MODULE=github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c
export FORKYARD_MINIO=${FORKYARD_MINIO:-$FORKYARD_TEST_DATA_DIR/bin/minio}
if [ ! -x "$FORKYARD_MINIO" ]; then
  echo "==> building MinIO for the S3 tests (once): go install $MINIO_MODULE"
  mkdir -p -m 0700 "$(dirname "$FORKYARD_MINIO")"
  CGO_ENABLED=0 GOBIN="$(dirname "$FORKYARD_MINIO")" go install "$MINIO_MODULE"
fi
# Test-only tooling stays root's: the directory 0700, the binary 0700 (also for a cache
# made before this line existed).
if [ "$FORKYARD_MINIO" = "$FORKYARD_TEST_DATA_DIR/bin/minio" ]; then
  chmod 0700 "$(dirname "$FORKYARD_MINIO")" "$FORKYARD_MINIO"
fi
exec .venv/bin/python -m pytest -v --durations=25 "$@"
