#!/usr/bin/env bash
# build-test-image.sh builds the bootable test OS images the qemu package tests
# (and later the provider tests) boot under QEMU, from Debian packages, at test
# time. Nothing it produces is committed.
#
# Output (printed on stdout as the last line): a directory
#   ${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/testimage/<version>/
# holding
#   vmlinuz                    Debian linux-image-*-cloud-amd64 kernel
#   initramfs-acpi.cpio.gz     busybox init (virtio drivers, virtio_balloon for free
#                              page reporting): prints QK-BOOT-OK on ttyS0, serves
#                              "QK-HTTP-OK" over HTTP on guest port 8080 (GET
#                              /cgi-bin/burn?SECS burns a vCPU for SECS s,
#                              /cgi-bin/idle stops that), echoes
#                              console lines back as "QK-ECHO: <line>", powers
#                              off on the ACPI power button (busybox acpid)
#   initramfs-noacpi.cpio.gz   same, but ignores the ACPI power button
#   initramfs-panic.cpio.gz    prints the marker, then panics the kernel
#                              (pvpanic reports it to QEMU)
#   disk.qcow2                 firmware-bootable disk (FAT + SYSLINUX) holding
#                              vmlinuz + the acpi initramfs; boot with
#                              -machine pc/q35 and SeaBIOS, no -kernel
#   cmdline                    kernel command line for the initramfs variants
#   VERSION                    what it was built from
# Cached by version; idempotent; safe under concurrent runs (flock + atomic
# rename). Needs: apt-get, dpkg-deb, busybox-static, cpio, gzip, qemu-img,
# dosfstools, mtools, syslinux.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/testimage"
SCRIPT_REV=1
log() { echo "build-test-image: $*" >&2; }

# Kernel: what the linux-image-cloud-amd64 meta-package points at (override
# with QK_TESTIMAGE_KERNEL_PKG=linux-image-<abi>-cloud-amd64).
KPKG="${QK_TESTIMAGE_KERNEL_PKG:-}"
if [ -z "$KPKG" ]; then
  KPKG="$(apt-cache show --no-all-versions linux-image-cloud-amd64 2>/dev/null |
    sed -n 's/^Depends: *\(linux-image-[^ ,]*-cloud-amd64\).*/\1/p' | head -1)"
fi
[ -n "$KPKG" ] || { log "cannot resolve the cloud kernel package from linux-image-cloud-amd64 (apt-get update?)"; exit 1; }
KVER="$(apt-cache show --no-all-versions "$KPKG" | sed -n 's/^Version: *//p' | head -1)"
[ -n "$KVER" ] || { log "no candidate version for $KPKG"; exit 1; }
BBVER="$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null)" || { log "busybox-static is not installed (hack/install-deps.sh)"; exit 1; }
for tool in dpkg-deb cpio gzip qemu-img mkfs.vfat mcopy syslinux; do
  command -v "$tool" >/dev/null || { log "missing tool $tool (run hack/install-deps.sh)"; exit 1; }
done
INIT_SUM="$(cat "$HERE/testimage/init.sh" "$HERE/build-test-image.sh" | sha256sum | cut -c1-12)"
VERSION="${KPKG#linux-image-}_${KVER}_bb${BBVER}_r${SCRIPT_REV}_${INIT_SUM}"
VERSION="$(echo "$VERSION" | tr -c 'A-Za-z0-9._\n-' '_')"
OUT="$CACHE/$VERSION"

if [ -f "$OUT/VERSION" ]; then echo "$OUT"; exit 0; fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock-$VERSION"
flock 9
if [ -f "$OUT/VERSION" ]; then echo "$OUT"; exit 0; fi

TMP="$(mktemp -d "$CACHE/.build-$VERSION.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
log "building $VERSION in $TMP"

# Kernel package (cached separately: it is the slow part).
DEBDIR="$CACHE/debs"; mkdir -p "$DEBDIR"
DEB="$(ls "$DEBDIR/${KPKG}_"*"_amd64.deb" 2>/dev/null | head -1 || true)"
if [ -z "$DEB" ]; then
  (cd "$TMP" && apt-get download "$KPKG=$KVER" >&2 2>/dev/null) || (cd "$TMP" && apt-get download "$KPKG=$KVER" >&2)
  f="$(ls "$TMP/${KPKG}_"*.deb | head -1)"
  mv "$f" "$DEBDIR/$(basename "$f")"
  DEB="$DEBDIR/$(basename "$f")"
fi
mkdir -p "$TMP/kernel" "$TMP/img"
dpkg-deb -x "$DEB" "$TMP/kernel"
cp "$TMP/kernel/boot/vmlinuz-"* "$TMP/img/vmlinuz"
MODROOT="$(echo "$TMP/kernel/lib/modules/"*)/kernel"
cp "$TMP/kernel/boot/config-"* "$TMP/img/kernel-config"

# Modules the cloud kernel builds as modules but the test images need, in
# dependency order (modules.dep is generated at install time, not shipped).
MODS="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_mmio
failover net_failover virtio_net virtio_blk virtio_console virtio_balloon
pvpanic pvpanic-mmio pvpanic-pci evdev button
fat vfat nls_cp437 nls_ascii nls_utf8 cdrom isofs"

mkroot() { # $1 variant
  local r="$TMP/root-$1"
  mkdir -p "$r/bin" "$r/lib/modules" "$r/etc" "$r/proc" "$r/sys" "$r/dev" "$r/tmp"
  cp /bin/busybox "$r/bin/busybox"
  : > "$r/etc/qk-modules"
  for m in $MODS; do
    f="$(find "$MODROOT" -name "$m.ko" -o -name "$m.ko.xz" | head -1)"
    [ -n "$f" ] || continue
    case "$f" in
      *.xz) xz -dc "$f" > "$r/lib/modules/$m.ko" ;;
      *) cp "$f" "$r/lib/modules/$m.ko" ;;
    esac
    echo "$m" >> "$r/etc/qk-modules"
  done
  if [ "$1" = noacpi ]; then sed -i '/^button$/d;/^evdev$/d' "$r/etc/qk-modules"; fi
  sed "s/@VARIANT@/$1/" "$HERE/testimage/init.sh" > "$r/init"
  chmod 0755 "$r/init"
  (cd "$r" && find . | LC_ALL=C sort | cpio -o -H newc --quiet --reproducible 2>/dev/null | gzip -6 -n) > "$TMP/img/initramfs-$1.cpio.gz"
}
for v in acpi noacpi panic; do mkroot "$v"; done
CMDLINE="console=ttyS0 panic=-1 quiet"
echo "$CMDLINE" > "$TMP/img/cmdline"

# Bootable disk: FAT "superfloppy" with SYSLINUX in its boot sector, holding
# the kernel and the acpi initramfs. SeaBIOS boots it as a hard disk.
truncate -s 64M "$TMP/disk.raw"
mkfs.vfat -n QKBOOT "$TMP/disk.raw" >/dev/null
syslinux --install "$TMP/disk.raw"
cat > "$TMP/syslinux.cfg" <<CFG
DEFAULT qk
PROMPT 0
TIMEOUT 0
LABEL qk
  KERNEL vmlinuz
  INITRD initrd.gz
  APPEND $CMDLINE
CFG
MTOOLS_SKIP_CHECK=1 mcopy -i "$TMP/disk.raw" "$TMP/img/vmlinuz" ::vmlinuz
MTOOLS_SKIP_CHECK=1 mcopy -i "$TMP/disk.raw" "$TMP/img/initramfs-acpi.cpio.gz" ::initrd.gz
MTOOLS_SKIP_CHECK=1 mcopy -i "$TMP/disk.raw" "$TMP/syslinux.cfg" ::syslinux.cfg
qemu-img convert -q -f raw -O qcow2 "$TMP/disk.raw" "$TMP/img/disk.qcow2"

{
  echo "kernel_package=$KPKG"
  echo "kernel_version=$KVER"
  echo "busybox_static=$BBVER"
  echo "script_rev=$SCRIPT_REV"
  echo "boot_marker=QK-BOOT-OK"
  echo "http_port=8080"
  echo "http_body=QK-HTTP-OK"
} > "$TMP/img/VERSION"

chmod -R a+rX "$TMP/img"
rm -rf "$OUT.old"; [ -d "$OUT" ] && mv "$OUT" "$OUT.old"
mv "$TMP/img" "$OUT"
rm -rf "$OUT.old"
log "built $OUT"
echo "$OUT"
