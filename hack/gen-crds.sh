#!/usr/bin/env bash
# gen-crds.sh generates the deepcopy functions of api/v1alpha1 and the CRD
# manifests in config/crd with controller-gen, which it builds at a pinned
# version into the cache directory (not a go.mod dependency of the project).
#
# Usage: hack/gen-crds.sh [OUT_OBJECT_DIR OUT_CRD_DIR [OUT_JS_OBJECT_DIR [OUT_JS_CRD_DIR [OUT_VT_OBJECT_DIR [OUT_VT_CRD_DIR]]]]]
#   With no arguments it writes api/v1alpha1/zz_generated.deepcopy.go,
#   config/crd/*.yaml, api/jumpstarter/v1alpha1/zz_generated.deepcopy.go,
#   config/jumpstarter/crd/*.yaml,
#   api/virtualtarget/v1alpha1/zz_generated.deepcopy.go and
#   config/virtualtarget/crd/*.yaml in place; hack/verify-crds.sh passes
#   temporary dirs. config/jumpstarter/crd is the subset of Jumpstarter's
#   Exporter and Lease schema that the project's types describe, and
#   config/virtualtarget/crd the subset of upstream's own ExporterSet and
#   VirtualTargetClass (group virtualtarget.jumpstarter.dev), for the
#   tests only (Jumpstarter owns these CRDs and its operator installs them
#   in a cluster; the chart never ships them).
#   CONTROLLER_TOOLS_VERSION (default v0.20.1: k8s.io v0.35, like
#                             controller-runtime v0.23)
#   QK_CACHE_DIR             (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# controller-gen is built by hack/lib/gotool.sh (cached by version,
# idempotent, safe to run concurrently).
set -euo pipefail

VERSION=${CONTROLLER_TOOLS_VERSION:-v0.20.1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OBJ_DIR=${1:-$ROOT/api/v1alpha1}
CRD_DIR=${2:-$ROOT/config/crd}
JS_OBJ_DIR=${3:-$ROOT/api/jumpstarter/v1alpha1}
JS_CRD_DIR=${4:-$ROOT/config/jumpstarter/crd}
VT_OBJ_DIR=${5:-$ROOT/api/virtualtarget/v1alpha1}
VT_CRD_DIR=${6:-$ROOT/config/virtualtarget/crd}
source "$ROOT/hack/lib/gotool.sh"

# Built inside a copy of its module, controller-gen would call itself
# "(devel)" in the CRDs' version annotation: set the version as its release
# build does.
cgen_ldflags() { echo "-s -w -X sigs.k8s.io/controller-tools/pkg/version.version=$VERSION"; }
BIN=$(build_module_tool controller-gen sigs.k8s.io/controller-tools "$VERSION" ./cmd/controller-gen cgen_ldflags --version)
mkdir -p "$OBJ_DIR" "$CRD_DIR" "$JS_OBJ_DIR" "$JS_CRD_DIR" "$VT_OBJ_DIR" "$VT_CRD_DIR"
cd "$ROOT"
"$BIN" object paths=./api/v1alpha1/... output:object:dir="$OBJ_DIR"
"$BIN" object paths=./api/jumpstarter/v1alpha1/... output:object:dir="$JS_OBJ_DIR"
"$BIN" object paths=./api/virtualtarget/v1alpha1/... output:object:dir="$VT_OBJ_DIR"
"$BIN" crd:generateEmbeddedObjectMeta=true paths=./api/v1alpha1/... output:crd:dir="$CRD_DIR"
"$BIN" crd paths=./api/jumpstarter/v1alpha1/... output:crd:dir="$JS_CRD_DIR"
"$BIN" crd paths=./api/virtualtarget/v1alpha1/... output:crd:dir="$VT_CRD_DIR"
