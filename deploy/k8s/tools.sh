#!/usr/bin/env bash
# Installs the two tools deploy/k8s/validate.sh needs, from package registries only, into
# $FORKYARD_TOOLS (default /var/cache/forkyard-tools), and prints that directory:
#   bin/kustomize             kustomize v5.8.1, built from the Go module proxy (~40 s once;
#                             v5.8.2+ need Go >= 1.27, this machine has 1.26)
#   venv/bin/kubernetes-validate  PyPI kubernetes-validate 1.37.0, which bundles the
#                             Kubernetes JSON schemas (validation then needs no network)
# Idempotent: quick when both are present.
set -euo pipefail
TOOLS=${FORKYARD_TOOLS:-/var/cache/forkyard-tools}
KUSTOMIZE_VERSION=v5.8.1
KV_VERSION=1.37.0
mkdir -p "$TOOLS/bin"
if ! "$TOOLS/bin/kustomize" version 2>/dev/null | grep -qx "$KUSTOMIZE_VERSION"; then
  command -v go >/dev/null || export PATH=$PATH:/usr/local/go/bin
  echo "==> go install kustomize $KUSTOMIZE_VERSION" >&2
  GOBIN=$TOOLS/bin CGO_ENABLED=0 GOFLAGS=-mod=mod go install "sigs.k8s.io/kustomize/kustomize/v5@$KUSTOMIZE_VERSION" >&2
fi
if ! "$TOOLS/venv/bin/kubernetes-validate" --version 2>/dev/null | grep -q "$KV_VERSION"; then
  echo "==> pip install kubernetes-validate==$KV_VERSION" >&2
  python3 -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/pip" install -q --disable-pip-version-check "kubernetes-validate==$KV_VERSION" >&2
fi
echo "$TOOLS"
