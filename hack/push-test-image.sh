#!/usr/bin/env bash
# push-test-image.sh pushes the small test OS image that `make run` serves
# (the direct-boot variant of hack/build-test-image.sh: Debian cloud kernel,
# busybox initramfs, kernel command line) to a registry of yours, with oras
# (hack/build-oras.sh), so that config/samples work on a real cluster.
#
# Usage: hack/push-test-image.sh REF [ORAS_PUSH_FLAGS...]
#   REF              e.g. registry.example.com/qemu-kubelet/test-os:v1
#   ORAS_PUSH_FLAGS  passed to `oras push`, e.g. --plain-http, --username/--password
#                    (or run `$(hack/build-oras.sh) login REGISTRY` first)
# Prints REF on success. Needs what build-test-image.sh needs (Debian packages:
# hack/install-deps.sh) and Go (oras is built from the module proxy, cached).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ] || [ -z "$1" ] || [[ "$1" == -* ]]; then
  echo "usage: $0 REF [oras push flags...]   e.g. $0 registry.example.com/qemu-kubelet/test-os:v1" >&2
  exit 2
fi
REF=$1; shift
IMG="$("$HERE/build-test-image.sh" | tail -1)"
ORAS="$("$HERE/build-oras.sh" | tail -1)"
# oras names each layer after the file as given: stage the files under the
# names the node recognises (images.md: kernel, initrd, cmdline roles).
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
ln -s "$IMG/vmlinuz" "$WORK/vmlinuz"
ln -s "$IMG/initramfs-acpi.cpio.gz" "$WORK/initramfs.cpio.gz"
ln -s "$IMG/cmdline" "$WORK/cmdline"
(cd "$WORK" && "$ORAS" push "$@" --artifact-type application/vnd.qemu-kubelet.os-image.v1 \
  "$REF" vmlinuz initramfs.cpio.gz cmdline >&2)
echo "$REF"
