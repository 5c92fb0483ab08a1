#!/usr/bin/env bash
# build-metrics-server.sh builds metrics-server
# (https://github.com/kubernetes-sigs/metrics-server) from its Go module at a
# pinned version and caches it by version outside the repository. The e2e
# uses it to show that metrics-server reads qemu-kubelet's /metrics/resource.
#
# Usage: hack/build-metrics-server.sh   # prints the path of the binary
#   METRICS_SERVER_VERSION  (default v0.7.2; name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# Idempotent (a finished build is reused) and safe to run concurrently
# (flock; the binary appears atomically by rename).
set -euo pipefail

VERSION=${METRICS_SERVER_VERSION:-v0.7.2}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
DEST="$CACHE/metrics-server/$VERSION"
BIN="$DEST/metrics-server"

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

mkdir -p "$DEST"
exec 9>"$DEST/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
work=$(mktemp -d "$DEST/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Build inside a copy of the module with its own go.mod/go.sum (`go install
# m@v` asks the proxy for version lists, which it refuses here).
echo "build-metrics-server: building sigs.k8s.io/metrics-server@$VERSION" >&2
src=$(cd "$work" && go mod download -json "sigs.k8s.io/metrics-server@$VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
[ -d "$src" ] || { echo "build-metrics-server: cannot download sigs.k8s.io/metrics-server@$VERSION" >&2; exit 1; }
cp -r "$src" "$work/src"
chmod -R u+w "$work/src"
(cd "$work/src" && go build -trimpath -o "$work/metrics-server" -ldflags "-s -w" ./cmd/metrics-server)
"$work/metrics-server" --help >/dev/null 2>&1 || { echo "build-metrics-server: built binary does not run" >&2; exit 1; }
mv -f "$work/metrics-server" "$BIN"
echo "$BIN"
