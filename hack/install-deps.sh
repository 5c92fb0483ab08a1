#!/usr/bin/env bash
# install-deps.sh installs the Debian packages the build, tests and `make run`
# need, when they are missing. Safe to run repeatedly; does nothing when all are
# present. Needs root (or sudo) only when something is missing.
set -euo pipefail
PKGS=(qemu-system-x86 qemu-system-arm qemu-efi-aarch64 qemu-utils docker-registry skopeo busybox-static cpio xz-utils zstd apache2-utils jq iproute2 openssl dosfstools mtools syslinux ovmf systemd protobuf-compiler libprotobuf-dev buildah runc debootstrap umoci)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "install-deps: installing ${missing[*]}" >&2
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
# The registry service must not start on its own on port 5000: tests start their own.
$SUDO apt-get update -qq >&2
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
