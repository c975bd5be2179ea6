#!/usr/bin/env bash
# Renders the Kubernetes manifests (deploy/k8s/base and every overlay) with kustomize and
# validates every object against the Kubernetes 1.37 schemas, offline and strict (unknown
# fields are errors). The validator runs without network (`unshare -n`) when it can, which
# proves the schemas come from the installed package.
#
#   deploy/k8s/validate.sh [OUTDIR]    # OUTDIR keeps the rendered YAML (one file per build)
# Exit status non-zero when a build or a validation fails.
set -euo pipefail
cd "$(dirname "$0")"
TOOLS=$(bash tools.sh)
out=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$out"' EXIT
mkdir -p "$out"
files=()
for dir in base overlays/*/; do
  dir=${dir%/}
  name=$(echo "$dir" | tr / -)
  "$TOOLS/bin/kustomize" build "$dir" > "$out/$name.yaml"
  files+=("$out/$name.yaml")
  echo "rendered $dir -> $out/$name.yaml ($(grep -c '^kind:' "$out/$name.yaml") objects)"
done
offline=()
if unshare -n true 2>/dev/null; then offline=(unshare -n); fi
"${offline[@]}" "$TOOLS/venv/bin/kubernetes-validate" --strict --quiet -k 1.37.0 "${files[@]}"
echo "valid against Kubernetes 1.37 (strict${offline:+, no network})"
