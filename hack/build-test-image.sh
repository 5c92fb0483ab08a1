#!/usr/bin/env bash
# build-test-image.sh builds the bootable test OS images the qemu package tests
# (and later the provider tests) boot under QEMU, from Debian packages, at test
# time. Nothing it produces is committed.
#
# Output (printed on stdout as the last line): a directory
#   ${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/testimage/<version>/
# holding
#   vmlinuz                    Debian kernel: linux-image-*-cloud-amd64,
#                              linux-image-*-arm64; with
#                              QK_TESTIMAGE_KERNEL=minimal (amd64) the
#                              kernel hack/build-guest-kernel.sh builds
#   initramfs-acpi.cpio.gz     busybox init (virtio drivers, virtio_balloon for free
#                              page reporting, at the command line's
#                              page_reporting.page_reporting_order, which
#                              6.1's driver would override; the module
#                              files deleted once loaded): prints QK-BOOT-OK on the serial
#                              console (ttyS0; ttyAMA0 on arm64), serves
#                              "QK-HTTP-OK" over HTTP on guest port 8080 (GET
#                              /cgi-bin/burn?SECS burns a vCPU for SECS s,
#                              /cgi-bin/idle stops that), echoes
#                              console lines back as "QK-ECHO: <line>", powers
#                              off on the ACPI power button (busybox acpid);
#                              on the host's architecture it runs
#                              qemu-guest-agent (Debian's qemu-guest-agent
#                              with the shared libraries ldd finds for it) on
#                              the org.qemu.guest_agent.0 virtio-serial port,
#                              unless the kernel command line has qk.noagent,
#                              and an sshd on guest port 22 (Debian's
#                              dropbear-bin, its libraries likewise; password
#                              login, host keys made at first use); from a
#                              NoCloud seed (FAT labelled CIDATA) it applies
#                              only the guest login of vendor-data's
#                              chpasswd.users (user and password), as
#                              qemu-kubelet seeds it for a Jumpstarter
#                              exporter pod: no cloud-init
#   initramfs-noacpi.cpio.gz   same, but ignores the ACPI power button
#   initramfs-panic.cpio.gz    prints the marker, then panics the kernel
#                              (pvpanic reports it to QEMU)
#   disk.qcow2                 firmware-bootable disk holding vmlinuz + the
#                              acpi initramfs. amd64: FAT + SYSLINUX, boot
#                              with -machine pc/q35 and SeaBIOS, no -kernel.
#                              arm64: FAT with systemd-boot as
#                              EFI/BOOT/BOOTAA64.EFI, boot with -machine virt
#                              and AAVMF (UEFI), no -kernel
#   cmdline                    kernel command line for the initramfs variants
#                              (cgroup.memory=nokmem: the image has no cgroups)
#   VERSION                    what it was built from (kernel=debian or
#                              minimal, the packages' versions)
#
# Usage: build-test-image.sh [ARCH]   ARCH: a Debian architecture, amd64 or
# arm64 (default: $QK_TESTIMAGE_ARCH, else the host's). A foreign ARCH's
# packages (kernel, busybox-static, systemd-boot-efi) are downloaded with a
# private apt state under the cache (its own package lists for ARCH, from the
# host's apt sources): the host's dpkg architectures are not touched.
#
# Cached by version; idempotent; safe under concurrent runs (flock + atomic
# rename). Needs: apt-get, dpkg-deb, busybox-static, cpio, gzip, qemu-img,
# dosfstools, mtools, syslinux (amd64).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CACHE="${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/testimage"
SCRIPT_REV=2
log() { echo "build-test-image: $*" >&2; }

HOSTARCH="$(dpkg --print-architecture)"
ARCH="${1:-${QK_TESTIMAGE_ARCH:-$HOSTARCH}}"
case "$ARCH" in
  amd64) CONSOLE=ttyS0 ;;
  arm64) CONSOLE=ttyAMA0 ;;
  *) log "unsupported architecture $ARCH (want amd64 or arm64)"; exit 2 ;;
esac

# APT: the host's for the host architecture; for a foreign one, a private
# state (lists, cache, empty dpkg status) under the cache, refreshed daily.
APT_OPTS=()
if [ "$ARCH" != "$HOSTARCH" ]; then
  APTDIR="$CACHE/apt-$ARCH"
  mkdir -p "$APTDIR/lists/partial" "$APTDIR/cache/archives/partial"
  : >> "$APTDIR/status"
  APT_OPTS=(-o "APT::Architecture=$ARCH" -o "APT::Architectures::=$ARCH"
    -o "Dir::State::Lists=$APTDIR/lists" -o "Dir::Cache=$APTDIR/cache"
    -o "Dir::State::status=$APTDIR/status" -o "Debug::NoLocking=1" -o "APT::Sandbox::User=root")
  mkdir -p "$CACHE"
  exec 8>"$CACHE/.lock-apt-$ARCH"
  flock 8
  if [ -z "$(find "$APTDIR/lists" -maxdepth 1 -name '*_Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    log "updating the private $ARCH package lists in $APTDIR"
    apt-get "${APT_OPTS[@]}" update -qq >&2 || { log "apt-get update for $ARCH failed"; exit 1; }
  fi
  exec 8>&-
fi
aptcache() { apt-cache "${APT_OPTS[@]}" "$@"; }
candidate() { aptcache show --no-all-versions "$1" 2>/dev/null | sed -n 's/^Version: *//p' | head -1; }

# Kernel: what the meta-package points at (override with
# QK_TESTIMAGE_KERNEL_PKG=linux-image-<abi>-<flavour>). amd64: the cloud
# flavour (small, boots fast). arm64: the generic flavour, because the cloud
# one builds no gpio_keys: on the virt machine booted with a device tree the
# power button is a gpio-keys line, and without it a VM cannot be stopped
# gracefully.
#
# QK_TESTIMAGE_KERNEL=minimal (amd64; arm64 keeps Debian's) boots a kernel built from
# Debian's kernel source instead, everything the image uses built in and
# nothing else (hack/build-guest-kernel.sh): a test guest of a few MiB of
# kernel where the cloud kernel holds about 38 MiB of the guest's RAM.
# Default: debian.
case "$ARCH" in
  amd64) KMETA=linux-image-cloud-amd64 ;;
  arm64) KMETA=linux-image-arm64 ;;
esac
KIND="${QK_TESTIMAGE_KERNEL:-debian}"
MINDIR=""
case "$KIND" in
  debian) ;;
  minimal)
    if [ "$ARCH" = amd64 ]; then
      MINDIR="$("$HERE/build-guest-kernel.sh" | tail -1)" || { log "building the minimal guest kernel failed"; exit 1; }
    else
      log "QK_TESTIMAGE_KERNEL=minimal is built for amd64 only: the $ARCH image keeps Debian's kernel"
      KIND=debian
    fi
    ;;
  *) log "QK_TESTIMAGE_KERNEL=$KIND: want debian or minimal"; exit 2 ;;
esac
KPKG="${QK_TESTIMAGE_KERNEL_PKG:-}"
if [ -n "$MINDIR" ]; then
  KPKG="linux-minimal-$(sed -n 's/^kernel_release=//p' "$MINDIR/VERSION")"
  # The kernel build's own version (source, compiler, fragment): a new
  # kernel is a new image.
  KVER="$(sed -n 's/^version=//p' "$MINDIR/VERSION")"
elif [ -z "$KPKG" ]; then
  KPKG="$(aptcache show --no-all-versions "$KMETA" 2>/dev/null |
    sed -n "s/^Depends: *\(linux-image-[^ ,]*-$ARCH\).*/\1/p" | head -1)"
fi
[ -n "$MINDIR" ] && [ -n "${QK_TESTIMAGE_KERNEL_PKG:-}" ] && log "QK_TESTIMAGE_KERNEL_PKG=$QK_TESTIMAGE_KERNEL_PKG is not used: QK_TESTIMAGE_KERNEL=minimal"
[ -n "$KPKG" ] || { log "cannot resolve the kernel package from $KMETA (apt-get update?)"; exit 1; }
[ -n "$MINDIR" ] || KVER="$(candidate "$KPKG")"
[ -n "$KVER" ] || { log "no candidate version for $KPKG"; exit 1; }
if [ "$ARCH" = "$HOSTARCH" ]; then
  BBVER="$(dpkg-query -W -f='${Version}' busybox-static 2>/dev/null)" || { log "busybox-static is not installed (hack/install-deps.sh)"; exit 1; }
else
  BBVER="$(candidate busybox-static)"
  [ -n "$BBVER" ] || { log "no candidate version for busybox-static:$ARCH"; exit 1; }
fi
# qemu-guest-agent: a dynamically linked binary; its libraries are found
# with ldd, which only works for the host's architecture, so a foreign
# architecture's image has no agent.
QGAVER=""
if [ "$ARCH" = "$HOSTARCH" ]; then
  QGAVER="$(candidate qemu-guest-agent)"
  [ -n "$QGAVER" ] || { log "no candidate version for qemu-guest-agent (apt-get update?)"; exit 1; }
fi
# dropbear (sshd) likewise, with the two libraries it links that the host
# need not have (libtomcrypt, libtommath), taken from their packages.
DBVER="" TCVER="" TMVER=""
if [ "$ARCH" = "$HOSTARCH" ]; then
  DBVER="$(candidate dropbear-bin)"
  TCVER="$(candidate libtomcrypt1)"
  TMVER="$(candidate libtommath1)"
  [ -n "$DBVER" ] && [ -n "$TCVER" ] && [ -n "$TMVER" ] || { log "no candidate version for dropbear-bin, libtomcrypt1 or libtommath1 (apt-get update?)"; exit 1; }
fi
TOOLS="dpkg-deb cpio gzip qemu-img mkfs.vfat mcopy"
[ -n "$QGAVER" ] && TOOLS="$TOOLS ldd"
[ "$ARCH" = amd64 ] && TOOLS="$TOOLS syslinux"
for tool in $TOOLS; do
  command -v "$tool" >/dev/null || { log "missing tool $tool (run hack/install-deps.sh)"; exit 1; }
done
INIT_SUM="$(cat "$HERE/testimage/init.sh" "$HERE/build-test-image.sh" | sha256sum | cut -c1-12)"
VERSION="${KPKG#linux-image-}_${KVER}_bb${BBVER}${QGAVER:+_ga$QGAVER}${DBVER:+_db${DBVER}_tc${TCVER}_tm${TMVER}}_r${SCRIPT_REV}_${INIT_SUM}"
[ "$ARCH" = amd64 ] || VERSION="${ARCH}_${VERSION}"
VERSION="$(echo "$VERSION" | tr -c 'A-Za-z0-9._\n-' '_')"
# shellcheck source=lib/versioncache.sh
. "$HERE/lib/versioncache.sh"
cache_open "$CACHE" "$VERSION"
TMP="$CACHE_TMP"
log "building $VERSION in $TMP"

# Packages (cached separately: the kernel is the slow part).
DEBDIR="$CACHE/debs"; mkdir -p "$DEBDIR"
fetchdeb() { # $1 package, $2 version; prints the cached .deb
  local f
  f="$(ls "$DEBDIR/${1}_"*"_$ARCH.deb" 2>/dev/null | grep -F "_$(echo "$2" | sed 's/:/%3a/')_" | head -1 || true)"
  if [ -z "$f" ]; then
    (cd "$TMP" && apt-get "${APT_OPTS[@]}" download "$1:$ARCH=$2" >&2)
    f="$(ls "$TMP/${1}_"*"_$ARCH.deb" | head -1)"
    mv "$f" "$DEBDIR/$(basename "$f")"
    f="$DEBDIR/$(basename "$f")"
  fi
  echo "$f"
}
DEB=""
[ -n "$MINDIR" ] || DEB="$(fetchdeb "$KPKG" "$KVER")"
BUSYBOX=/bin/busybox
if [ "$ARCH" != "$HOSTARCH" ]; then
  mkdir -p "$TMP/busybox"
  dpkg-deb -x "$(fetchdeb busybox-static "$BBVER")" "$TMP/busybox"
  BUSYBOX="$TMP/busybox/bin/busybox"
fi
QGAROOT=""
addbin() { # $1 binary, $2 a tree of extracted library packages (or ""):
  # copies it to $QGAROOT/bin with what it links (the loader and libraries
  # at the paths ldd prints, those from $2 at their paths in their
  # package), nothing else from its package.
  local bin lib libs dst libdir=""
  [ -n "$2" ] && libdir="$(dirname "$(find "$2" -name '*.so.*' | head -1)")"
  bin="$QGAROOT/bin/$(basename "$1")"
  cp "$1" "$bin"
  libs="$(LD_LIBRARY_PATH="$libdir" ldd "$bin")" || { log "ldd $1 failed"; exit 1; }
  if echo "$libs" | grep -q 'not found'; then
    log "$(basename "$1") needs libraries the host lacks: $(echo "$libs" | grep 'not found' | tr -s ' \t\n' ' ')"; exit 1
  fi
  for lib in $(echo "$libs" | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
    dst="$lib"
    [ -n "$2" ] && case "$lib" in "$2"/*) dst="${lib#"$2"}" ;; esac
    mkdir -p "$QGAROOT$(dirname "$dst")"
    cp -L "$lib" "$QGAROOT$dst"
  done
}
if [ -n "$QGAVER" ]; then
  # qemu-ga, and dropbear (the sshd: dropbear-bin's server only, with
  # libtomcrypt1's and libtommath1's libraries).
  QGAROOT="$TMP/qga"
  mkdir -p "$TMP/qgadeb" "$TMP/dbdeb" "$QGAROOT/bin"
  dpkg-deb -x "$(fetchdeb qemu-guest-agent "$QGAVER")" "$TMP/qgadeb"
  addbin "$TMP/qgadeb/usr/sbin/qemu-ga" ""
  for d in "$(fetchdeb dropbear-bin "$DBVER")" "$(fetchdeb libtomcrypt1 "$TCVER")" "$(fetchdeb libtommath1 "$TMVER")"; do
    dpkg-deb -x "$d" "$TMP/dbdeb"
  done
  addbin "$TMP/dbdeb/usr/sbin/dropbear" "$TMP/dbdeb"
fi
mkdir -p "$TMP/kernel" "$TMP/img"
if [ -n "$MINDIR" ]; then
  # Everything built in: no modules to ship.
  cp "$MINDIR/bzImage" "$TMP/img/vmlinuz"
  cp "$MINDIR/config" "$TMP/img/kernel-config"
  MODROOT="$TMP/kernel"
else
  dpkg-deb -x "$DEB" "$TMP/kernel"
  cp "$TMP/kernel/boot/vmlinuz-"* "$TMP/img/vmlinuz"
  MODROOT="$(echo "$TMP/kernel/lib/modules/"*)/kernel"
  cp "$TMP/kernel/boot/config-"* "$TMP/img/kernel-config"
fi

# Modules the cloud kernel builds as modules but the test images need, in
# dependency order (modules.dep is generated at install time, not shipped).
# arm64 virt: the power button is a PL061 GPIO line (gpio_keys, KEY_POWER).
MODS="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_mmio
failover net_failover virtio_net virtio_blk virtio_console virtio_balloon
pvpanic pvpanic-mmio pvpanic-pci evdev button gpio-pl061 gpio_keys
fat vfat nls_cp437 nls_ascii nls_utf8 cdrom isofs"

mkroot() { # $1 variant
  local r="$TMP/root-$1"
  mkdir -p "$r/bin" "$r/lib/modules" "$r/etc" "$r/proc" "$r/sys" "$r/dev" "$r/tmp"
  cp "$BUSYBOX" "$r/bin/busybox"
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
  if [ -n "$QGAROOT" ] && [ "$1" != panic ]; then cp -a "$QGAROOT/." "$r/"; fi
  sed "s/@VARIANT@/$1/;s/@CONSOLE@/$CONSOLE/" "$HERE/testimage/init.sh" > "$r/init"
  chmod 0755 "$r/init"
  (cd "$r" && find . | LC_ALL=C sort | cpio -o -H newc --quiet --reproducible 2>/dev/null | gzip -6 -n) > "$TMP/img/initramfs-$1.cpio.gz"
}
for v in acpi noacpi panic; do mkroot "$v"; done
# cgroup.memory=nokmem: the image runs no cgroups, so the guest kernel's
# accounting of its own memory to them is only cost: with it on, Linux
# 6.1 zeroes an array of one pointer per 4 bytes of each per-CPU chunk
# (4 MiB for the first 2 MiB chunk), guest RAM every test VM holds.
CMDLINE="console=$CONSOLE panic=-1 quiet cgroup.memory=nokmem"
echo "$CMDLINE" > "$TMP/img/cmdline"

truncate -s 64M "$TMP/disk.raw"
mkfs.vfat -n QKBOOT "$TMP/disk.raw" >/dev/null
mc() { MTOOLS_SKIP_CHECK=1 mcopy -i "$TMP/disk.raw" "$@"; }
if [ "$ARCH" = amd64 ]; then
  # Bootable disk: FAT "superfloppy" with SYSLINUX in its boot sector, holding
  # the kernel and the acpi initramfs. SeaBIOS boots it as a hard disk.
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
  mc "$TMP/img/vmlinuz" ::vmlinuz
  mc "$TMP/syslinux.cfg" ::syslinux.cfg
else
  # UEFI disk: FAT holding systemd-boot as the removable-media loader
  # (EFI/BOOT/BOOTAA64.EFI), one entry and no menu timeout. The kernel is
  # loaded as an EFI application: its EFI stub needs the plain Image, so a
  # gzip-compressed vmlinuz is unpacked.
  SDVER="$(candidate systemd-boot-efi)"
  [ -n "$SDVER" ] || { log "no candidate version for systemd-boot-efi:$ARCH"; exit 1; }
  mkdir -p "$TMP/sdboot"
  dpkg-deb -x "$(fetchdeb systemd-boot-efi "$SDVER")" "$TMP/sdboot"
  if [ "$(head -c2 "$TMP/img/vmlinuz" | od -An -tx1 | tr -d ' ')" = 1f8b ]; then
    gzip -dc "$TMP/img/vmlinuz" > "$TMP/Image"
  else
    cp "$TMP/img/vmlinuz" "$TMP/Image"
  fi
  printf 'default qk.conf\ntimeout 0\nconsole-mode keep\n' > "$TMP/loader.conf"
  printf 'title qk\nlinux /vmlinuz\ninitrd /initrd.gz\noptions %s\n' "$CMDLINE" > "$TMP/qk.conf"
  MTOOLS_SKIP_CHECK=1 mmd -i "$TMP/disk.raw" ::EFI ::EFI/BOOT ::loader ::loader/entries
  mc "$TMP/sdboot/usr/lib/systemd/boot/efi/systemd-bootaa64.efi" ::EFI/BOOT/BOOTAA64.EFI
  mc "$TMP/loader.conf" ::loader/loader.conf
  mc "$TMP/qk.conf" ::loader/entries/qk.conf
  mc "$TMP/Image" ::vmlinuz
  echo "systemd_boot_efi=$SDVER" > "$TMP/img/VERSION.extra"
fi
mc "$TMP/img/initramfs-acpi.cpio.gz" ::initrd.gz
qemu-img convert -q -f raw -O qcow2 "$TMP/disk.raw" "$TMP/img/disk.qcow2"

{
  echo "arch=$ARCH"
  echo "console=$CONSOLE"
  echo "kernel=$KIND"
  echo "kernel_package=$KPKG"
  echo "kernel_version=$KVER"
  echo "busybox_static=$BBVER"
  [ -n "$QGAVER" ] && echo "qemu_guest_agent=$QGAVER"
  [ -n "$DBVER" ] && echo "dropbear_bin=$DBVER" && echo "ssh_port=22"
  echo "script_rev=$SCRIPT_REV"
  echo "boot_marker=QK-BOOT-OK"
  echo "http_port=8080"
  echo "http_body=QK-HTTP-OK"
  cat "$TMP/img/VERSION.extra" 2>/dev/null || true
} > "$TMP/img/VERSION.new"
rm -f "$TMP/img/VERSION.extra"
mv "$TMP/img/VERSION.new" "$TMP/img/VERSION"

chmod -R a+rX "$TMP/img"
log "built $CACHE_OUT"
cache_publish "$TMP/img"
