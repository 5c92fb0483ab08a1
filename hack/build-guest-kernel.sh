#!/usr/bin/env bash
# build-guest-kernel.sh builds a minimal x86_64 guest kernel for the test
# image (QK_TESTIMAGE_KERNEL=minimal in hack/build-test-image.sh): Debian's
# own kernel source (the linux-source-<series> package, Debian's patches
# applied) configured from tinyconfig plus hack/testimage/minimal-kernel.config,
# everything the test image uses built in, no modules. Nothing it produces is
# committed.
#
# Output (printed on stdout as the last line): a directory
#   ${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/guestkernel/<version>/
# holding bzImage, config (the full .config) and VERSION.
#
# The series is QK_GUEST_KERNEL_SERIES (default 6.1, the series of Debian
# 12's cloud kernel). amd64 hosts only. Installs linux-source-<series> and the build tools
# (flex, bison, bc, libelf-dev, gcc, make) when missing (root or sudo).
# Cached by the source package's version, the fragment and the compiler
# (hack/lib/versioncache.sh: safe under concurrent runs). A cold build takes a
# few minutes of CPU.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/guestkernel"
FRAGMENT="$HERE/testimage/minimal-kernel.config"
SERIES="${QK_GUEST_KERNEL_SERIES:-6.1}"
SRCPKG="linux-source-$SERIES"
log() { echo "build-guest-kernel: $*" >&2; }

[ "$(dpkg --print-architecture)" = amd64 ] || { log "builds an x86_64 kernel on an amd64 host only"; exit 2; }

need=()
for p in "$SRCPKG" flex bison bc libelf-dev gcc make xz-utils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  # Two first runs at once (test packages in parallel) wait for each
  # other's dpkg lock instead of failing on it.
  APT=(apt-get -o DPkg::Lock::Timeout=600)
  $SUDO "${APT[@]}" install -y -qq --no-install-recommends "${need[@]}" >&2 ||
    { $SUDO "${APT[@]}" update -qq >&2 && $SUDO "${APT[@]}" install -y -qq --no-install-recommends "${need[@]}" >&2; } ||
    { log "cannot install ${need[*]}"; exit 1; }
fi

SRCVER="$(dpkg-query -W -f='${Version}' "$SRCPKG")"
TARBALL="/usr/src/$SRCPKG.tar.xz"
[ -f "$TARBALL" ] || { log "$SRCPKG $SRCVER is installed but $TARBALL is missing"; exit 1; }
GCCVER="$(dpkg-query -W -f='${Version}' "gcc-$(gcc -dumpversion)" 2>/dev/null || gcc -dumpfullversion)"
# The fragment's and this script's lines but comments: editing a comment
# does not rebuild the kernel.
SUM="$(cat "$FRAGMENT" "$HERE/build-guest-kernel.sh" | grep -v '^[[:space:]]*#' | sha256sum | cut -c1-12)"
VERSION="$(echo "${SRCPKG}_${SRCVER}_gcc${GCCVER}_${SUM}" | tr -c 'A-Za-z0-9._\n-' '_')"
# shellcheck source=lib/versioncache.sh
. "$HERE/lib/versioncache.sh"
cache_open "$CACHE" "$VERSION"
TMP="$CACHE_TMP"
log "building $VERSION in $TMP"
tar -xJf "$TARBALL" -C "$TMP"
SRC="$TMP/$SRCPKG"
mk() { make -C "$SRC" -s "$@" >&2; }
# Kconfig's notes (each option the fragment overrides) go to a log shown
# only if a step fails.
(cd "$SRC" && make -s tinyconfig && scripts/kconfig/merge_config.sh -m -O . .config "$FRAGMENT" && make -s olddefconfig) >"$TMP/kconfig.log" 2>&1 ||
  { cat "$TMP/kconfig.log" >&2; log "configuring the kernel failed"; exit 1; }
# Every option the fragment sets must be so after olddefconfig: one whose
# dependencies are missing is dropped silently (the image would boot
# without it), one another option selects stays on.
missing="$(sed -n 's/^\(CONFIG_[A-Z0-9_]*\)=y$/\1/p' "$FRAGMENT" | while read -r o; do
  grep -qx "$o=y" "$SRC/.config" || echo "$o"
done)"
[ -z "$missing" ] || { log "options of $FRAGMENT not in the configuration (a dependency is missing): $(echo "$missing" | tr '\n' ' ')"; exit 1; }
forced="$(sed -n 's/^\(CONFIG_[A-Z0-9_]*\)=n$/\1/p' "$FRAGMENT" | while read -r o; do
  grep -qx "$o=y" "$SRC/.config" && echo "$o"
done || true)"
[ -z "$forced" ] || { log "options $FRAGMENT turns off are on in the configuration (another option selects them): $(echo "$forced" | tr '\n' ' ')"; exit 1; }
mk -j"$(nproc)" bzImage KBUILD_BUILD_USER=qemu-kubelet KBUILD_BUILD_HOST=build KBUILD_BUILD_TIMESTAMP="$(date -u -r "$TARBALL" "+%F %T UTC")"
RELEASE="$(make -C "$SRC" -s kernelrelease)"
[ -n "$RELEASE" ] || { log "the kernel's release is empty"; exit 1; }
mkdir -p "$TMP/out"
cp "$SRC/arch/x86/boot/bzImage" "$TMP/out/bzImage"
cp "$SRC/.config" "$TMP/out/config"
{
  echo "version=$VERSION"
  echo "source_package=$SRCPKG"
  echo "source_version=$SRCVER"
  echo "kernel_release=$RELEASE"
  echo "gcc=$GCCVER"
  echo "fragment_sum=$SUM"
} > "$TMP/out/VERSION"
chmod -R a+rX "$TMP/out"
log "built $CACHE_OUT"
cache_publish "$TMP/out"
