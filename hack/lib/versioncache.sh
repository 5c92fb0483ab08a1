# versioncache.sh: a build kept in a directory per version under a cache
# directory, reused once finished. Sourced by hack/build-test-image.sh and
# hack/build-guest-kernel.sh.
#
# cache_open DIR VERSION
#   When DIR/VERSION holds a finished build (its VERSION file), prints
#   DIR/VERSION and exits the script with 0. Otherwise takes the version's
#   lock (flock on DIR/.lock-VERSION, held until the script exits: one build
#   of a version at a time; a second run waits and then finds it finished),
#   and sets CACHE_OUT (DIR/VERSION) and CACHE_TMP (a new directory under DIR,
#   removed when the script exits) for the build. Build directories a killed
#   run of the same version left behind are removed first (only the lock's
#   holder makes them). It holds the lock on file descriptor 9 and sets the
#   script's EXIT trap: a script using either for something else cannot use
#   it.
# cache_publish SRC
#   Moves the finished build SRC (a directory with a VERSION file, under
#   CACHE_TMP) to CACHE_OUT in one rename, replacing an older one, and
#   prints CACHE_OUT.

cache_open() {
  local dir="$1" version="$2"
  CACHE_OUT="$dir/$version"
  if [ -f "$CACHE_OUT/VERSION" ]; then echo "$CACHE_OUT"; exit 0; fi
  mkdir -p "$dir"
  exec 9>"$dir/.lock-$version"
  flock 9
  if [ -f "$CACHE_OUT/VERSION" ]; then echo "$CACHE_OUT"; exit 0; fi
  rm -rf "$dir/.build-$version."*
  CACHE_TMP="$(mktemp -d "$dir/.build-$version.XXXXXX")"
  trap 'rm -rf "$CACHE_TMP"' EXIT
}

cache_publish() {
  rm -rf "$CACHE_OUT.old"
  [ -d "$CACHE_OUT" ] && mv "$CACHE_OUT" "$CACHE_OUT.old"
  mv "$1" "$CACHE_OUT"
  rm -rf "$CACHE_OUT.old"
  echo "$CACHE_OUT"
}
