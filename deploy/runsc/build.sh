#!/usr/bin/env bash
# Builds the gVisor runtime forkyard runs (runsc) from source, pinned, with forkyard's
# patches (deploy/runsc/patches/*.patch, each explains itself), and installs it as
#   $PREFIX/runsc-<tag>      (the build; never overwritten, so running nodes keep theirs;
#                             <tag> = its version, plus -boot.<hash> of boot-only patches)
#   $PREFIX/runsc            (a link to the newest build; forkyard's default FORKYARD_RUNSC)
# PREFIX defaults to /usr/local/lib/forkyard. Idempotent: a no-op once that build exists.
# Needs Go >= 1.26 (gVisor's go.mod) and the Go module proxy; ~2 min on 2 idle cores.
# Why this build and not a distribution package: docs/runtime.md.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# gVisor's `go` branch (the Go-module form of the source) at commit 160fafc42237, 2026-09-05.
GVISOR_MODULE=gvisor.dev/gvisor
GVISOR_VERSION=v0.0.0-20260905035102-160fafc42237
PREFIX=${PREFIX:-/usr/local/lib/forkyard}
patches=("$here"/patches/*.patch)
# The version stamped into the binary names the checkpoint format: gVisor's commit and
# fy.<hash> of the patches that change what a checkpoint holds or how a restore reads it.
# runsc restores an image only with the same version string (and forkyard records it in
# every image), so patches marked "Restore-compatible: yes" (they change nothing a
# checkpoint holds, so images of builds with and without them restore with either: 0002
# acts only when a sandbox boots, 0020 only behind its own flags and writes stock images)
# are left out of it and named in the file name alone (-boot.<hash>): adding one keeps
# every checkpoint restorable (docs/runtime.md).
state=() boot=()
for p in "${patches[@]}"; do
  if grep -q '^Restore-compatible: yes$' "$p"; then boot+=("$p"); else state+=("$p"); fi
done
version="0.0~20260905-160fafc42237-fy.$(cat "${state[@]}" </dev/null | sha256sum | cut -c1-8)"
tag=$version
[ ${#boot[@]} -eq 0 ] || tag="$version-boot.$(cat "${boot[@]}" | sha256sum | cut -c1-8)"
out="$PREFIX/runsc-$tag"
link() { ln -sfn "runsc-$tag" "$PREFIX/.runsc.new" && mv -Tf "$PREFIX/.runsc.new" "$PREFIX/runsc"; }

if [ -x "$out" ] && [ "$("$out" --version 2>/dev/null | head -1)" = "runsc version $version" ]; then
  link
  echo "ok: runsc $tag at $out"
  exit 0
fi
export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "building runsc needs Go >= 1.26 (https://go.dev/dl; /usr/local/go/bin)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "==> building gVisor runsc $tag from $GVISOR_MODULE@$GVISOR_VERSION (~2-4 min)"
src=$(cd "$work" && go mod download -json "$GVISOR_MODULE@$GVISOR_VERSION" \
      | python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
cp -r "$src" "$work/gvisor"
chmod -R u+w "$work/gvisor"
for p in "${patches[@]}"; do
  echo "    patch $(basename "$p")"
  patch -d "$work/gvisor" -p1 --quiet --forward < "$p"
done
# Patch 0030's generator embeds the sentry's and the gofer's seccomp programs (what
# gVisor's Bazel build does; the Go-module source ships empty stubs): ~10 s.
if [ -d "$work/gvisor/tools/fyprecompile" ]; then
  echo "    precompiling seccomp filters"
  (cd "$work/gvisor" && CGO_ENABLED=0 go run ./tools/fyprecompile | sed 's/^/      /')
fi
(cd "$work/gvisor" && CGO_ENABLED=0 go build -trimpath \
   -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$version" -o "$work/runsc" ./runsc)
[ "$("$work/runsc" --version | head -1)" = "runsc version $version" ]
mkdir -p "$PREFIX"
install -m 0755 "$work/runsc" "$out.tmp"
sync "$out.tmp"
mv -f "$out.tmp" "$out"
link
echo "ok: runsc $tag at $out"
