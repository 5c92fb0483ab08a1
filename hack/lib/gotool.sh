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
# builds inside a copy of the module with the module's own go.mod/go.sum.

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

  export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
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
  local ld="-s -w"
  if [ -n "$ldflags_fn" ]; then ld=$("$ldflags_fn" "$work/src") || return 1; fi
  (cd "$work/src" && go build -trimpath -o "$work/$name" -ldflags "$ld" "$pkg") >&2
  "$work/$name" "$@" >/dev/null 2>&1 || { echo "build-$name: the built binary fails '$name $*'" >&2; return 1; }
  mv -f "$work/$name" "$bin"
  echo "$bin"
}
