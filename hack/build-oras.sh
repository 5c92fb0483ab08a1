#!/usr/bin/env bash
# build-oras.sh builds the oras CLI (https://oras.land) from its Go module at a
# pinned version and caches it by version outside the repository.
#
# Usage: hack/build-oras.sh            # prints the path of the oras binary
#   ORAS_VERSION  (default v1.2.3; the proxy refuses listings: name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
set -euo pipefail
source "$(dirname "$0")/lib/gotool.sh"

ORAS_VERSION=${ORAS_VERSION:-v1.2.3}
oras_ldflags() {
  echo "-s -w -X oras.land/oras/internal/version.Version=${ORAS_VERSION#v} -X oras.land/oras/internal/version.BuildMetadata=qemu-kubelet"
}
build_module_tool oras oras.land/oras "$ORAS_VERSION" ./cmd/oras oras_ldflags version
