#!/usr/bin/env bash
# sync-chart-crds.sh copies the generated CRDs (config/crd/*.yaml, written by
# hack/gen-crds.sh) into the Helm chart (charts/qemu-kubelet/crds/), which
# Helm installs before the chart's templates. Run it after hack/gen-crds.sh;
# go test ./charts/ fails while the copies differ.
#
# Usage: hack/sync-chart-crds.sh           # copy
#        hack/sync-chart-crds.sh --check   # exit 1 (and list) when out of date
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
SRC="$ROOT/config/crd"
DST="$ROOT/charts/qemu-kubelet/crds"

if [ "${1:-}" = "--check" ]; then
  diff -r -q "$SRC" "$DST" >&2 || { echo "sync-chart-crds: $DST is out of date; run hack/sync-chart-crds.sh" >&2; exit 1; }
  exit 0
fi
mkdir -p "$DST"
# Remove CRDs that no longer exist, then copy the current set.
for f in "$DST"/*.yaml; do
  [ -e "$f" ] || continue
  [ -e "$SRC/$(basename "$f")" ] || rm -f "$f"
done
cp "$SRC"/*.yaml "$DST"/
