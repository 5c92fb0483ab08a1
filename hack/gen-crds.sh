#!/usr/bin/env bash
# gen-crds.sh generates the deepcopy functions of api/v1alpha1 and the CRD
# manifests in config/crd with controller-gen, which it builds at a pinned
# version into the cache directory (not a go.mod dependency of the project).
#
# Usage: hack/gen-crds.sh [OUT_OBJECT_DIR OUT_CRD_DIR [OUT_JS_OBJECT_DIR [OUT_JS_CRD_DIR]]]
#   With no arguments it writes api/v1alpha1/zz_generated.deepcopy.go,
#   config/crd/*.yaml, api/jumpstarter/v1alpha1/zz_generated.deepcopy.go and
#   config/jumpstarter/crd/*.yaml in place; hack/verify-crds.sh passes
#   temporary dirs. config/jumpstarter/crd is the subset of Jumpstarter's
#   Exporter and Lease schema that the project's types describe, for the
#   tests only (Jumpstarter owns these CRDs and installs its own in a
#   cluster; the chart never ships them).
#   CONTROLLER_TOOLS_VERSION (default v0.20.1: k8s.io v0.35, like
#                             controller-runtime v0.23)
#   QK_CACHE_DIR             (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# The controller-gen build is idempotent and safe to run concurrently
# (flock; the binary directory appears by atomic rename).
set -euo pipefail

VERSION=${CONTROLLER_TOOLS_VERSION:-v0.20.1}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
DEST="$CACHE/tools/controller-gen-$VERSION"
BIN="$DEST/controller-gen"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OBJ_DIR=${1:-$ROOT/api/v1alpha1}
CRD_DIR=${2:-$ROOT/config/crd}
JS_OBJ_DIR=${3:-$ROOT/api/jumpstarter/v1alpha1}
JS_CRD_DIR=${4:-$ROOT/config/jumpstarter/crd}

build() {
  [ -x "$BIN" ] && return 0
  mkdir -p "$CACHE/tools"
  exec 9>"$CACHE/tools/.controller-gen.lock"
  flock 9
  if [ ! -x "$BIN" ]; then
    local work
    work=$(mktemp -d "$CACHE/tools/.build.XXXXXX")
    echo "gen-crds: building sigs.k8s.io/controller-tools/cmd/controller-gen@$VERSION" >&2
    # `go install pkg@version` builds with the tool's own go.mod, not ours.
    if ! GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$work/bin" \
      go install -trimpath "sigs.k8s.io/controller-tools/cmd/controller-gen@$VERSION" >&2; then
      rm -rf "$work"; echo "gen-crds: building controller-gen $VERSION failed" >&2; exit 1
    fi
    rm -rf "$DEST"
    mv "$work/bin" "$DEST"
    rm -rf "$work"
  fi
  exec 9>&-
}

build
mkdir -p "$OBJ_DIR" "$CRD_DIR" "$JS_OBJ_DIR" "$JS_CRD_DIR"
cd "$ROOT"
"$BIN" object paths=./api/v1alpha1/... output:object:dir="$OBJ_DIR"
"$BIN" object paths=./api/jumpstarter/v1alpha1/... output:object:dir="$JS_OBJ_DIR"
"$BIN" crd:generateEmbeddedObjectMeta=true paths=./api/v1alpha1/... output:crd:dir="$CRD_DIR"
"$BIN" crd paths=./api/jumpstarter/v1alpha1/... output:crd:dir="$JS_CRD_DIR"
