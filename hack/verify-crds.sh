#!/usr/bin/env bash
# verify-crds.sh fails when the committed deepcopy functions
# (api/v1alpha1, api/jumpstarter/v1alpha1, api/virtualtarget/v1alpha1) or
# CRDs (config/crd, the tests' config/jumpstarter/crd and
# config/virtualtarget/crd) differ from what hack/gen-crds.sh generates from
# the current Go types.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$ROOT/hack/gen-crds.sh" "$tmp/obj" "$tmp/crd" "$tmp/jsobj" "$tmp/jscrd" "$tmp/vtobj" "$tmp/vtcrd"
rc=0
diff -u "$ROOT/api/v1alpha1/zz_generated.deepcopy.go" "$tmp/obj/zz_generated.deepcopy.go" || rc=1
diff -u "$ROOT/api/jumpstarter/v1alpha1/zz_generated.deepcopy.go" "$tmp/jsobj/zz_generated.deepcopy.go" || rc=1
diff -ru "$ROOT/config/crd" "$tmp/crd" || rc=1
diff -ru "$ROOT/config/jumpstarter/crd" "$tmp/jscrd" || rc=1
diff -u "$ROOT/api/virtualtarget/v1alpha1/zz_generated.deepcopy.go" "$tmp/vtobj/zz_generated.deepcopy.go" || rc=1
diff -ru "$ROOT/config/virtualtarget/crd" "$tmp/vtcrd" || rc=1
if [ $rc -ne 0 ]; then
  echo "verify-crds: generated files are out of date; run hack/gen-crds.sh and commit the result" >&2
  exit 1
fi
echo "verify-crds: deepcopy and CRDs are up to date"
