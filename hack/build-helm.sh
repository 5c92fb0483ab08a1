#!/usr/bin/env bash
# build-helm.sh builds the helm v3 CLI from its Go module (helm.sh/helm/v3) at a
# pinned version and caches it by version outside the repository. The chart
# tests (go test ./charts/) run it themselves.
#
# Usage: hack/build-helm.sh            # prints the path of the helm binary
#   HELM_VERSION  (default v3.19.0; the proxy refuses listings: name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
set -euo pipefail
source "$(dirname "$0")/lib/gotool.sh"

HELM_VERSION=${HELM_VERSION:-v3.19.0}
# As helm's Makefile: the default Kubernetes version of `helm template` and
# `helm lint` is the one of the client-go helm is built with (else v1.20).
helm_ldflags() {
  local k8s p ld
  k8s=$(sed -n 's/^[[:space:]]*k8s.io\/client-go v0\.\([0-9]*\)\..*/\1/p' "$1/go.mod" | head -1)
  [ -n "$k8s" ] || { echo "build-helm: no k8s.io/client-go version in helm's go.mod" >&2; return 1; }
  ld="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
  for p in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
    ld="$ld -X $p.k8sVersionMajor=1 -X $p.k8sVersionMinor=$k8s"
  done
  echo "$ld"
}
build_module_tool helm helm.sh/helm/v3 "$HELM_VERSION" ./cmd/helm helm_ldflags version --short
