# gotool.sh: build a CLI from its Go module at a pinned version, cached by
# version outside the repository. Sourced by hack/build-{oras,helm,metrics-server}.sh.
#
# build_module_tool NAME MODULE VERSION PKG LDFLAGS_FN CHECK...
#   NAME        binary name; cached at $QK_CACHE_DIR/NAME/VERSION/NAME
#   MODULE      Go module path, VERSION an exact version (the module proxy here
#               refuses version listings)
#   PKG         package to build, relative to the module root (./cmd/x)
#   LDFLAGS_FN  a function printing -ldflags given the module source dir, or ""
#               for "-s -w"
#   CHECK...    arguments the built binary must accept with exit 0 (smoke test)
# Prints the binary's path. Idempotent (a finished build is reused) and safe
# to run concurrently (flock; the binary appears atomically by rename).
#
# Why not `go install MODULE/PKG@VERSION`: it asks the proxy for the module's
# version list (deprecation check), which the proxy here refuses; so this
# builds inside a copy of the module.
#
# The copy's go.mod also requires this repository's requirements
# (qk_requirements), as a `tool` line in our go.mod would: the modules the
# tool shares with this repository (k8s.io/*, grpc, x/net, ...) are then at
# the same versions, and the Go build cache compiles them once for the tool
# and for the repository's own builds and tests (helm in an empty cache: 29
# CPU-s after the module's build, against 169 alone). A tool that does not
# build at those versions is built with its own go.mod/go.sum instead, as is
# one whose script sets QK_TOOL_OWN_DEPS=1 (metrics-server: it would not
# compile, or not work).

QK_ROOT=${QK_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}

# qk_requirements [EXCLUDE]: this repository's go.mod requirements as
# " -require=PATH@VERSION" words for `go mod edit`, without module EXCLUDE
# (a module cannot require itself). `go mod graph`'s lines whose first column
# is the main module are its go.mod's requirements.
qk_requirements() {
  (cd "$QK_ROOT" && go mod graph | awk -v m="$(go list -m)" -v x="${1:-}" \
    '$1 == m && $2 !~ /^(go|toolchain)@/ { split($2, a, "@"); if (a[1] != x) printf " -require=%s", $2 }')
}

build_module_tool() {
  local name=$1 module=$2 version=$3 pkg=$4 ldflags_fn=$5
  shift 5
  local cache=${QK_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qemu-kubelet}
  local dest="$cache/$name/$version" bin="$cache/$name/$version/$name"
  if [ -x "$bin" ]; then echo "$bin"; return 0; fi

  mkdir -p "$dest"
  exec 9>"$dest/.lock"
  flock 9
  if [ -x "$bin" ]; then echo "$bin"; return 0; fi

  # CGO_ENABLED as for the repository's builds (the default), so that the
  # standard library and everything above it compile to the same cache entries.
  export GOTOOLCHAIN=local GOFLAGS=-mod=mod
  local work
  work=$(mktemp -d "$dest/.build.XXXXXX")
  # shellcheck disable=SC2064 # expand now: $work is local
  trap "rm -rf '$work'" EXIT

  echo "build-$name: building $module@$version" >&2
  local json src
  json=$(cd "$work" && go mod download -json "$module@$version") || {
    echo "build-$name: cannot download $module@$version: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",*$/\1/p' <<<"$json")" >&2
    return 1
  }
  src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
  [ -d "$src" ] || { echo "build-$name: go mod download gave no directory for $module@$version" >&2; return 1; }
  cp -r "$src" "$work/src"
  chmod -R u+w "$work/src"
  cp "$work/src/go.mod" "$work/go.mod.own"
  [ ! -f "$work/src/go.sum" ] || cp "$work/src/go.sum" "$work/go.sum.own"
  local ld ours built=0
  ours=
  [ "${QK_TOOL_OWN_DEPS:-}" = 1 ] || ours=$(qk_requirements "$module") || ours=
  # shellcheck disable=SC2086 # one -require=PATH@VERSION per word
  if [ -n "$ours" ] && (cd "$work/src" && go mod edit $ours); then
    ld=$(_tool_ldflags "$ldflags_fn" "$work/src") || return 1
    if (cd "$work/src" && go build -trimpath -o "$work/$name" -ldflags "$ld" "$pkg") >&2; then
      built=1
    else
      echo "build-$name: $module@$version does not build at this repository's dependency versions; building it at its own" >&2
    fi
  fi
  if [ "$built" = 0 ]; then
    cp "$work/go.mod.own" "$work/src/go.mod"
    rm -f "$work/src/go.sum"
    [ ! -f "$work/go.sum.own" ] || cp "$work/go.sum.own" "$work/src/go.sum"
    ld=$(_tool_ldflags "$ldflags_fn" "$work/src") || return 1
    (cd "$work/src" && go build -trimpath -o "$work/$name" -ldflags "$ld" "$pkg") >&2 || return 1
  fi
  "$work/$name" "$@" >/dev/null 2>&1 || { echo "build-$name: the built binary fails '$name $*'" >&2; return 1; }
  mv -f "$work/$name" "$bin"
  echo "$bin"
}

# _tool_ldflags FN DIR: FN's -ldflags for the module source in DIR, or "-s -w".
_tool_ldflags() {
  if [ -n "$1" ]; then "$1" "$2"; else echo "-s -w"; fi
}
