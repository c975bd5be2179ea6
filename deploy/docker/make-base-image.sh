#!/usr/bin/env bash
# Makes the local base image for deploy/docker/Dockerfile without any container registry:
# debootstraps Debian bookworm (variant minbase) from this host's apt mirror and
# `docker import`s the rootfs as $IMAGE (default forkyard/bookworm:local).
#
#   deploy/docker/make-base-image.sh [--force]
#
# Skips the work when $IMAGE exists (unless --force). Needs root, debootstrap and a running
# dockerd (deploy/docker/dockerd.sh start). Measured here: ~60-90 s, image ~120 MB.
# Where a registry is reachable, `docker build --build-arg BASE_IMAGE=debian:bookworm` works
# instead and this script is not needed.
set -euo pipefail
IMAGE=${IMAGE:-forkyard/bookworm:local}
SUITE=bookworm
say() { printf '==> %s\n' "$*" >&2; }

if [ "${1:-}" != --force ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
  say "$IMAGE exists (use --force to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap missing: apt-get install debootstrap" >&2; exit 1; }

# The mirrors this host already uses (deb822 first, then one-line sources.list), as
# deploy/install.sh and forkyard/templates/base.py do.
mirror=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}
security=$(awk '/^URIs:/ && /security/{print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
security=${security:-http://deb.debian.org/debian-security}

work=$(mktemp -d /var/tmp/forkyard-baseimg.XXXXXX)
trap 'rm -rf "$work"' EXIT
say "debootstrap $SUITE (minbase) from $mirror"
debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$work/rootfs" "$mirror" \
  > "$work/debootstrap.log" 2>&1 || { tail -30 "$work/debootstrap.log" >&2; exit 1; }

rm -f "$work/rootfs/etc/apt/sources.list"
cat > "$work/rootfs/etc/apt/sources.list.d/debian.sources" <<EOS
Types: deb
URIs: $mirror
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
# Like Docker's official debian images: no recommends, no docs, no apt caches kept.
cat > "$work/rootfs/etc/apt/apt.conf.d/90forkyard-image" <<'EOS'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
EOS
# Trust the CA certificates this host added locally (/usr/local/share/ca-certificates, e.g.
# a TLS-inspecting proxy's; none on most hosts), as forkyard's base template does, so pip and
# apt over https work in builds on this host.
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  say "trusting the host's local CA certificates"
  cp /usr/local/share/ca-certificates/*.crt "$work/rootfs/usr/local/share/ca-certificates/"
  chroot "$work/rootfs" update-ca-certificates >/dev/null
fi
rm -rf "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/cache/apt/"*.bin "$work/rootfs/var/cache/apt/archives/"*.deb
# Host files debootstrap copied in; the container gets its own from Docker.
: > "$work/rootfs/etc/resolv.conf"
: > "$work/rootfs/etc/hostname"

say "docker import -> $IMAGE"
tar --numeric-owner --xattrs -C "$work/rootfs" -c . \
  | docker import -c 'CMD ["/bin/bash"]' -c 'ENV LANG=C.UTF-8' - "$IMAGE" >/dev/null
docker image ls "$IMAGE"
