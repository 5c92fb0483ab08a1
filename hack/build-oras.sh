#!/usr/bin/env bash
# build-oras.sh builds the oras CLI (https://oras.land) from its Go module at a
# pinned version and caches it by version outside the repository.
#
# Usage: hack/build-oras.sh            # prints the path of the oras binary
#   ORAS_VERSION  (default v1.2.3; the proxy refuses listings: name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# Idempotent (a finished build is reused) and safe to run concurrently
# (flock; the binary appears atomically by rename).
set -euo pipefail

ORAS_VERSION=${ORAS_VERSION:-v1.2.3}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
DEST="$CACHE/oras/$ORAS_VERSION"
BIN="$DEST/oras"

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

mkdir -p "$DEST"
exec 9>"$DEST/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
work=$(mktemp -d "$DEST/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# `go install oras.land/oras/cmd/oras@V` asks the proxy for the module's version
# list (deprecation check), which the proxy here refuses; build inside a copy of
# the module instead, with the module's own go.mod/go.sum.
echo "build-oras: building oras.land/oras@$ORAS_VERSION" >&2
src=$(cd "$work" && go mod download -json "oras.land/oras@$ORAS_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || { echo "build-oras: cannot download oras.land/oras@$ORAS_VERSION" >&2; exit 1; }
cp -r "$src" "$work/src"
chmod -R u+w "$work/src"
(cd "$work/src" && go build -trimpath -o "$work/oras" \
  -ldflags "-s -w -X oras.land/oras/internal/version.Version=${ORAS_VERSION#v} -X oras.land/oras/internal/version.BuildMetadata=qemu-kubelet" \
  ./cmd/oras)
"$work/oras" version >/dev/null
mv -f "$work/oras" "$BIN"
echo "$BIN"
