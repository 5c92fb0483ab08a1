#!/usr/bin/env bash
# build-control-plane.sh builds etcd, kube-apiserver, kube-scheduler,
# kube-controller-manager and kubectl from the Go module proxy at pinned
# versions and caches them by version outside the repository.
#
# Usage: hack/build-control-plane.sh            # prints the bin directory
#   KUBE_VERSION   (default v1.35.4, matches client-go v0.35.x)
#   ETCD_VERSION   (default v3.5.35)
#   QK_CACHE_DIR   (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# Idempotent (a finished build is reused) and safe to run concurrently
# (flock; the result directory appears atomically by rename).
#
# Why a wrapper module: k8s.io/kubernetes cannot be `go install`ed because its
# go.mod replaces the staging modules (k8s.io/api, ...) with ./staging paths.
# The wrapper requires k8s.io/kubernetes and replaces every staging module with
# its published v0.X.Y version instead.
#
# The wrapper also requires this repository's own requirements (its go.mod;
# hack/lib/gotool.sh says why), so the modules both builds use (client-go,
# apimachinery, grpc, protobuf, x/net, ...) are at the same versions and the
# Go build cache compiles their ~1,100 packages once for the control plane
# and the repository's tests. If kubernetes does not build at those
# versions, it is built at its own (go mod tidy) instead.
set -euo pipefail
source "$(dirname "$0")/lib/gotool.sh" # qk_requirements

KUBE_VERSION=${KUBE_VERSION:-v1.35.4}
ETCD_VERSION=${ETCD_VERSION:-v3.5.35}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
DEST="$CACHE/control-plane/kube-$KUBE_VERSION-etcd-$ETCD_VERSION"
BINS=(etcd kube-apiserver kube-scheduler kube-controller-manager kubectl)

complete() {
  for b in "${BINS[@]}"; do [ -x "$DEST/bin/$b" ] || return 1; done
}

if complete; then echo "$DEST/bin"; exit 0; fi

mkdir -p "$CACHE/control-plane"
exec 9>"$CACHE/control-plane/.lock"
flock 9
if complete; then echo "$DEST/bin"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod
work=$(mktemp -d "$CACHE/control-plane/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT

minor=${KUBE_VERSION#v1.}; minor=${minor%%.*}
staging_version="v0.${KUBE_VERSION#v1.}"

log() { echo "build-control-plane: $*" >&2; }

# --- kubernetes components -------------------------------------------------
mkdir -p "$work/k8s" "$work/out"
cd "$work/k8s"
cat > go.mod <<MOD
module local/controlplane

go 1.25
MOD
log "resolving k8s.io/kubernetes@$KUBE_VERSION"
kgomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)".*/\1/p')
[ -f "$kgomod" ] || { log "cannot download k8s.io/kubernetes@$KUBE_VERSION go.mod"; exit 1; }
{
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  echo "replace ("
  grep -E '^\s*k8s\.io/[A-Za-z0-9._-]+ => \./staging/' "$kgomod" \
    | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} >> go.mod
cat > tools.go <<'SRC'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
SRC
ld="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ld="$ld -X $pkg.gitVersion=$KUBE_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
build_k8s() {
  go build -trimpath -ldflags "$ld" -o "$work/out/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl >&2
}
ours=$(qk_requirements) || ours=
cp go.mod go.mod.own
if [ -n "$ours" ]; then
  # shellcheck disable=SC2086 # one -require=path@version per word
  go mod edit $ours
  log "building kube-apiserver kube-controller-manager kube-scheduler kubectl (at this module's dependency versions)"
  if build_k8s; then aligned=1; else aligned=0; fi
else
  aligned=0
fi
if [ "$aligned" = 0 ]; then
  log "building kube-apiserver kube-controller-manager kube-scheduler kubectl (at kubernetes' own dependency versions)"
  cp go.mod.own go.mod
  rm -f go.sum
  go mod tidy >&2
  build_k8s
fi

# --- etcd -------------------------------------------------------------------
mkdir -p "$work/etcd"
cd "$work/etcd"
cat > go.mod <<MOD
module local/etcd

go 1.25

require go.etcd.io/etcd/server/v3 $ETCD_VERSION
MOD
cat > tools.go <<'SRC'
//go:build tools

package tools

import _ "go.etcd.io/etcd/server/v3"
SRC
log "building etcd $ETCD_VERSION"
go mod tidy >&2
go build -trimpath -ldflags "-s -w" -o "$work/out/etcd" go.etcd.io/etcd/server/v3 >&2

for b in "${BINS[@]}"; do [ -x "$work/out/$b" ] || { log "missing $b after build"; exit 1; }; done
rm -rf "$DEST.tmp"
mkdir -p "$DEST.tmp"
mv "$work/out" "$DEST.tmp/bin"
rm -rf "$DEST"
mv "$DEST.tmp" "$DEST"
log "done: $DEST/bin"
echo "$DEST/bin"
