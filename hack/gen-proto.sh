#!/usr/bin/env bash
# gen-proto.sh generates the Go code of Jumpstarter's gRPC protocol
# (jumpstarter/proto/jumpstarter/v1/*.proto, copies of upstream's
# protocol/proto/jumpstarter/v1 at b1f2bb41) into jumpstarter/pb.
#
# Usage: hack/gen-proto.sh           # regenerate jumpstarter/pb in place
#        hack/gen-proto.sh --check   # regenerate into a temp dir, fail on any diff
#
# Tools: Debian's protoc (protobuf-compiler) with the well-known types from
# libprotobuf-dev (/usr/include), and protoc-gen-go / protoc-gen-go-grpc built
# from the Go module proxy at pinned versions (protoc-gen-go at the version of
# google.golang.org/protobuf in go.mod), cached like hack/lib/gotool.sh does.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/hack/lib/gotool.sh"

PROTOC_GEN_GO_VERSION=$(cd "$ROOT" && go list -m -f '{{.Version}}' google.golang.org/protobuf)
PROTOC_GEN_GO_GRPC_VERSION=${PROTOC_GEN_GO_GRPC_VERSION:-v1.6.0}
GO_PKG=github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb
PROTO_DIR=$ROOT/jumpstarter/proto
PROTOS=(jumpstarter/v1/common.proto jumpstarter/v1/kubernetes.proto jumpstarter/v1/router.proto jumpstarter/v1/jumpstarter.proto)

check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

command -v protoc >/dev/null || { echo "gen-proto: protoc missing: run hack/install-deps.sh (protobuf-compiler)" >&2; exit 1; }
[ -f /usr/include/google/protobuf/struct.proto ] || { echo "gen-proto: /usr/include/google/protobuf/struct.proto missing: run hack/install-deps.sh (libprotobuf-dev)" >&2; exit 1; }

gen_go=$(build_module_tool protoc-gen-go google.golang.org/protobuf "$PROTOC_GEN_GO_VERSION" ./cmd/protoc-gen-go "" --version)
gen_grpc=$(build_module_tool protoc-gen-go-grpc google.golang.org/grpc/cmd/protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION" . "" --version)

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
# M options map each file to the Go package, so the .proto copies stay
# byte-identical to upstream's (they carry no go_package option).
mopts=()
for p in "${PROTOS[@]}"; do mopts+=("M$p=$GO_PKG;pb"); done
goopts=$(IFS=,; echo "paths=import,${mopts[*]}")
(cd "$PROTO_DIR" && protoc -I . -I /usr/include \
  --plugin=protoc-gen-go="$gen_go" --plugin=protoc-gen-go-grpc="$gen_grpc" \
  --go_out="$out" --go_opt="$goopts" \
  --go-grpc_out="$out" --go-grpc_opt="$goopts" \
  "${PROTOS[@]}")
gen="$out/$GO_PKG"

if [ $check -eq 1 ]; then
  if ! diff -ru "$ROOT/jumpstarter/pb" "$gen"; then
    echo "gen-proto: jumpstarter/pb is out of date; run hack/gen-proto.sh and commit the result" >&2
    exit 1
  fi
  echo "gen-proto: jumpstarter/pb is up to date"
  exit 0
fi
rm -rf "$ROOT/jumpstarter/pb"
mkdir -p "$ROOT/jumpstarter/pb"
cp "$gen"/*.go "$ROOT/jumpstarter/pb/"
echo "gen-proto: wrote jumpstarter/pb"
