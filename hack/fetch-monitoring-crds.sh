#!/usr/bin/env bash
# fetch-monitoring-crds.sh provides the Prometheus Operator's ServiceMonitor
# and PodMonitor CRDs (monitoring.coreos.com), taken from the
# prometheus-operator Go module at a pinned version, so the chart tests can
# dry-run the chart's monitors against the real schemas. Cached by version
# outside the repository.
#
# Usage: hack/fetch-monitoring-crds.sh     # prints the directory holding the CRDs
#   PROMETHEUS_OPERATOR_VERSION  (default v0.85.0; the proxy refuses listings)
#   QK_CACHE_DIR                 (default ${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet)
#
# Idempotent and safe to run concurrently (flock; the directory appears by
# atomic rename).
set -euo pipefail

VERSION=${PROMETHEUS_OPERATOR_VERSION:-v0.85.0}
CACHE=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
BASE="$CACHE/monitoring-crds"
DEST="$BASE/$VERSION"
FILES=(monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_podmonitors.yaml)

done_() { for f in "${FILES[@]}"; do [ -s "$DEST/$f" ] || return 1; done; }
if done_; then echo "$DEST"; exit 0; fi

mkdir -p "$BASE"
exec 9>"$BASE/.lock-$VERSION"
flock 9
if done_; then echo "$DEST"; exit 0; fi

export GOTOOLCHAIN=local GOFLAGS=-mod=mod
work=$(mktemp -d "$BASE/.fetch.XXXXXX")
trap 'rm -rf "$work"' EXIT
mod=github.com/prometheus-operator/prometheus-operator
echo "fetch-monitoring-crds: $mod@$VERSION" >&2
json=$(cd "$work" && go mod download -json "$mod@$VERSION") || {
  echo "fetch-monitoring-crds: cannot download $mod@$VERSION: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",*$/\1/p' <<<"$json")" >&2
  exit 1
}
src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
mkdir "$work/out"
for f in "${FILES[@]}"; do
  cp "$src/example/prometheus-operator-crd/$f" "$work/out/$f" || { echo "fetch-monitoring-crds: $f missing in $mod@$VERSION" >&2; exit 1; }
done
rm -rf "$DEST"
mv "$work/out" "$DEST"
echo "$DEST"
