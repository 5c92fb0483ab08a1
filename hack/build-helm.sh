#!/usr/bin/env bash
# build-helm.sh builds the helm v3 CLI from its Go module (helm.sh/helm/v3) at a
# pinned version and caches it by version outside the repository. The chart
# tests (go test ./charts/) run it themselves.
#
# Usage: hack/build-helm.sh            # prints the path of the helm binary
#   HELM_VERSION  (default v3.19.0; the proxy refuses listings: name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# Idempotent (a finished build is reused) and safe to run concurrently
# (flock; the binary appears atomically by rename).
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.19.0}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
DEST="$CACHE/helm/$HELM_VERSION"
BIN="$DEST/helm"

if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

mkdir -p "$DEST"
exec 9>"$DEST/.lock"
flock 9
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
work=$(mktemp -d "$DEST/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

# `go install helm.sh/helm/v3/cmd/helm@V` asks the proxy for the module's
# version list, which the proxy here refuses; build inside a copy of the module
# instead, with the module's own go.mod/go.sum.
echo "build-helm: building helm.sh/helm/v3@$HELM_VERSION" >&2
json=$(cd "$work" && go mod download -json "helm.sh/helm/v3@$HELM_VERSION") || {
  echo "build-helm: cannot download helm.sh/helm/v3@$HELM_VERSION: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",*$/\1/p' <<<"$json")" >&2
  exit 1
}
src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
[ -d "$src" ] || { echo "build-helm: go mod download gave no directory for helm.sh/helm/v3@$HELM_VERSION" >&2; exit 1; }
cp -r "$src" "$work/src"
chmod -R u+w "$work/src"
# As helm's Makefile: the default Kubernetes version of `helm template` and
# `helm lint` is the one of the client-go helm is built with (else v1.20).
k8s=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$work/src/go.mod" | head -1)
[ -n "$k8s" ] || { echo "build-helm: no k8s.io/client-go version in helm's go.mod" >&2; exit 1; }
ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
  ld="$ld -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$k8s"
done
(cd "$work/src" && go build -trimpath -o "$work/helm" -ldflags "$ld" ./cmd/helm)
"$work/helm" version --short >/dev/null
mv -f "$work/helm" "$BIN"
echo "$BIN"
