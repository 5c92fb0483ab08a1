#!/usr/bin/env bash
# build-metrics-server.sh builds metrics-server
# (https://github.com/kubernetes-sigs/metrics-server) from its Go module at a
# pinned version and caches it by version outside the repository. The e2e
# uses it to show that metrics-server reads qemu-kubelet's /metrics/resource.
#
# Usage: hack/build-metrics-server.sh   # prints the path of the binary
#   METRICS_SERVER_VERSION  (default v0.7.2; name exact versions)
#   QK_CACHE_DIR  (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
set -euo pipefail
source "$(dirname "$0")/lib/gotool.sh"

# At its own dependency versions (k8s.io v0.29), not at ours (v0.35): its
# generated OpenAPI definitions must match its k8s.io/apiserver. v0.8.0 built
# at ours exits at start with "cannot find model definition for
# io.k8s.apimachinery.pkg.version.Info"; v0.7.2 does not compile there.
export QK_TOOL_OWN_DEPS=1

build_module_tool metrics-server sigs.k8s.io/metrics-server "${METRICS_SERVER_VERSION:-v0.7.2}" ./cmd/metrics-server "" --help
