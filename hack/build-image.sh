#!/usr/bin/env bash
# build-image.sh builds the Dockerfile's image without a Docker engine and
# without a container registry, as an OCI image layout under the cache, and
# prints its reference (oci:DIR:TAG) on the last line of stdout.
#
#   hack/build-image.sh [--tag TAG] [BIN_DIR]   # BIN_DIR: `make build`'s output (default bin)
#   hack/build-image.sh --print-containerfile    # the stage it builds, then exit
#
# `make image` runs `make build` and then this script.
#
# How it follows the Dockerfile: the build stage is `make build` (already done
# on this host, same command). The runtime stage (the Dockerfile's last FROM
# to its end) is built by buildah as written, except that
# `COPY --from=build /src/bin/X` copies BIN_DIR/X. Its base, debian:SUITE-slim,
# is not pulled: debootstrap --variant=minbase SUITE makes that root
# filesystem from Debian's packages and buildah stores it under that name
# (all builds run with --pull=never). build/dockerfile_test.go checks that
# --print-containerfile is the Dockerfile's runtime stage, so the package
# list here cannot drift from the Dockerfile's: it is the Dockerfile's.
#
# Caches, under ${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/image (one build
# at a time: flock):
#   base/SUITE-minbase-DEBOOTSTRAPVERSION.tar  the debootstrap root fs (slow: minutes)
#   storage/  buildah's store: that base, and the stage's packages as image
#             qemu-kubelet-deps:KEY, KEY = hash of the base and the stage's
#             instructions before its first COPY (so: of the package list)
#   oci/KEY/  the image, KEY = hash of the deps key, the rest of the stage and
#             the binaries; an existing one is reused as is (the newest 3 are kept)
# Needs root, buildah, runc and debootstrap (hack/install-deps.sh installs them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dockerfile="$root/Dockerfile"
tag=dev
bin="$root/bin"
print_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --print-containerfile) print_only=1; shift ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    -*) echo "build-image: unknown flag $1" >&2; exit 2 ;;
    *) bin="$1"; shift ;;
  esac
done
die() { echo "build-image: $*" >&2; exit 1; }
log() { echo "build-image: $*" >&2; }

# The runtime stage: from the last FROM to the end, COPY --from=build
# rewritten to the context's bin/. Backslash continuations stay as written.
stage="$(awk 'toupper($1)=="FROM"{n=NR} {l[NR]=$0} END{for(i=n;i<=NR;i++) print l[i]}' "$dockerfile")"
[ -n "$stage" ] || die "$dockerfile: no FROM"
if grep -Eiq '^[[:space:]]*COPY[[:space:]]+--from=' <<<"$stage" && grep -Ei '^[[:space:]]*COPY[[:space:]]+--from=' <<<"$stage" | grep -Evq '^[[:space:]]*COPY[[:space:]]+--from=build([[:space:]]+/src/bin/[^[:space:]]+)+[[:space:]]+[^[:space:]]+$'; then
  die "$dockerfile: the runtime stage may only COPY --from=build /src/bin/<binary>... DEST (make build's outputs)"
fi
containerfile="$(sed -E '/^[[:space:]]*COPY[[:space:]]+--from=build/{s#--from=build[[:space:]]+##; s#/src/bin/#bin/#g}' <<<"$stage")"
if [ "$print_only" = 1 ]; then
  printf '%s\n' "$containerfile"
  exit 0
fi

from="$(awk 'toupper($1)=="FROM"{print $2; exit}' <<<"$stage")"
[[ "$from" =~ ^debian:([a-z]+)-slim$ ]] || die "runtime base $from: expected debian:SUITE-slim (the base made with debootstrap)"
suite="${BASH_REMATCH[1]}"

[ "$(id -u)" -eq 0 ] || die "needs root (buildah's store, debootstrap and runc run as root)"
for t in buildah runc debootstrap; do
  command -v "$t" >/dev/null || die "$t not found: run hack/install-deps.sh"
done
binaries=($(grep -Ei '^[[:space:]]*COPY[[:space:]]+--from=build' <<<"$stage" | grep -o '/src/bin/[^[:space:]]*' | sed 's#/src/bin/##'))
for b in "${binaries[@]}"; do
  [ -x "$bin/$b" ] || die "$bin/$b missing: run make build (or make image)"
done

cache="${QK_CACHE_DIR:-$HOME/.cache/qemu-kubelet}/image"
mkdir -p "$cache/base" "$cache/oci" "$cache/storage"
exec 9>"$cache/.lock"
flock 9
t0=$(date +%s)

# --- the base root fs: debootstrap, cached by suite and debootstrap version.
dbver="$(dpkg-query -W -f='${Version}' debootstrap 2>/dev/null || echo unknown)"
basetar="$cache/base/${suite}-minbase-${dbver}.tar"
if [ ! -s "$basetar" ]; then
  # The host's own apt sources for SUITE, SUITE-updates and SUITE-security
  # (so no mirror is named here); debootstrap's default mirror otherwise.
  mapfile -t srcs < <(apt-get indextargets --format '$(REPO_URI) $(RELEASE)' 'Identifier: Packages' 2>/dev/null \
    | awk -v s="$suite" '$2==s || $2==s"-updates" || $2==s"-security"' | sort -u)
  mirror=""
  for l in "${srcs[@]}"; do [ "${l#* }" = "$suite" ] && mirror="${l%% *}"; done
  tmp="$(mktemp -d "$cache/base/tmp.XXXXXX")"
  trap 'rm -rf "$tmp"' EXIT
  log "debootstrap --variant=minbase $suite ${mirror:-(default mirror)} (first build only: a few minutes)..."
  debootstrap --variant=minbase "$suite" "$tmp/rootfs" ${mirror:+"$mirror"} >"$tmp/debootstrap.log" 2>&1 \
    || { tail -20 "$tmp/debootstrap.log" >&2; die "debootstrap failed (log above)"; }
  if [ ${#srcs[@]} -gt 0 ]; then
    for l in "${srcs[@]}"; do echo "deb ${l%% *} ${l#* } main"; done >"$tmp/rootfs/etc/apt/sources.list"
  fi
  # As the slim images do: no apt caches or logs in the image.
  rm -rf "$tmp"/rootfs/var/cache/apt/archives/*.deb "$tmp"/rootfs/var/lib/apt/lists/* "$tmp"/rootfs/var/log/*.log
  tar -C "$tmp/rootfs" --numeric-owner -cf "$tmp/rootfs.tar" .
  mv "$tmp/rootfs.tar" "$basetar"
  rm -rf "$tmp"
  trap - EXIT
  log "base root fs $(basename "$basetar") in $(( $(date +%s) - t0 ))s"
fi

# --- buildah, with its store in the cache. overlay unless the cache itself is
# on overlayfs (a container's root), where only vfs works.
driver="${QK_BUILDAH_DRIVER:-}"
if [ -z "$driver" ]; then
  driver=overlay
  [ "$(stat -f -c %T "$cache/storage")" = overlayfs ] && driver=vfs
fi
B=(buildah --root "$cache/storage" --runroot "$cache/run" --storage-driver "$driver")
exists() { "${B[@]}" inspect --type image "$1" >/dev/null 2>&1; }
label() { "${B[@]}" inspect --type image --format "{{index .OCIv1.Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }

baseref="docker.io/library/debian:${suite}-slim"
if [ "$(label "$baseref" io.qemu-kubelet.base)" != "$(basename "$basetar")" ]; then
  log "importing $(basename "$basetar") as $baseref"
  ctr="$("${B[@]}" from scratch)"
  "${B[@]}" add "$ctr" "$basetar" / >/dev/null
  "${B[@]}" config --label "io.qemu-kubelet.base=$(basename "$basetar")" --cmd /bin/bash "$ctr"
  "${B[@]}" commit --quiet --rm "$ctr" "$baseref" >/dev/null
fi

sha() { sha256sum | cut -c1-16; }
ctx="$(mktemp -d)"
trap 'rm -rf "$ctx"' EXIT
# The stage up to its first COPY --from=build (packages, user) is one image,
# reused while the base and those instructions are unchanged.
first_copy="$(grep -Ein '^[[:space:]]*COPY[[:space:]]+--from=build' <<<"$stage" | head -1 | cut -d: -f1)"
[ -n "$first_copy" ] || die "the runtime stage copies no binaries from the build stage"
deps_part="$(head -n $((first_copy - 1)) <<<"$containerfile")"
rest_part="$(tail -n +"$first_copy" <<<"$containerfile")"
depskey="$( { basename "$basetar"; printf '%s\n' "$deps_part"; } | sha)"
depsref="localhost/qemu-kubelet-deps:$depskey"
if ! exists "$depsref"; then
  log "building the runtime stage's packages ($depsref; first build only: a few minutes)..."
  printf '%s\n' "$deps_part" >"$ctx/Containerfile.deps"
  "${B[@]}" bud --pull=never --force-rm --network=host --layers=false -f "$ctx/Containerfile.deps" -t "$depsref" "$ctx" >"$ctx/deps.log" 2>&1 \
    || { tail -30 "$ctx/deps.log" >&2; die "buildah bud of the runtime stage's packages failed (log above)"; }
fi

mkdir -p "$ctx/bin"
for b in "${binaries[@]}"; do cp "$bin/$b" "$ctx/bin/$b"; done
key="$( { echo "$depskey"; printf '%s\n' "$rest_part"; (cd "$ctx/bin" && sha256sum "${binaries[@]}"); echo "$tag"; } | sha)"
out="$cache/oci/$key"
if [ ! -f "$out/index.json" ]; then
  { echo "FROM $depsref"; printf '%s\n' "$rest_part"; } >"$ctx/Containerfile"
  imgref="localhost/qemu-kubelet-build:$key"
  log "building $imgref..."
  "${B[@]}" bud --pull=never --force-rm --network=none --layers=false -f "$ctx/Containerfile" -t "$imgref" "$ctx" >"$ctx/bud.log" 2>&1 \
    || { tail -30 "$ctx/bud.log" >&2; die "buildah bud failed (log above)"; }
  rm -rf "$out.tmp"
  "${B[@]}" push --quiet "$imgref" "oci:$out.tmp:$tag" >&2 || die "buildah push to $out.tmp failed"
  "${B[@]}" rmi "$imgref" >/dev/null
  mv "$out.tmp" "$out"
fi
touch "$out"

# Keep the newest 3 images and only the current deps image.
ls -1dt "$cache"/oci/*/ 2>/dev/null | tail -n +4 | xargs -r rm -rf
"${B[@]}" images --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep '^localhost/qemu-kubelet-deps:' | grep -v ":$depskey\$" \
  | xargs -r "${B[@]}" rmi >/dev/null 2>&1 || true
log "image ready in $(( $(date +%s) - t0 ))s"
echo "oci:$out:$tag"
