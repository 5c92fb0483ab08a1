#!/usr/bin/env bash
# test.sh: make test's steps (the Makefile passes GO, PKG, MAKE, TEST_GOFLAGS,
# TEST_TIMEOUT and TEST_FUZZTIME). Each step prints one line when it ends:
#
#   make test: STEP ok|FAILED in Ns (at +Ms)
#
# so a run's log says where its time went. The order, and why:
#
#   disk                the free disk the test nodes need (below);
#   control plane       first, alone: it compiles most of the dependencies the
#                       module shares with it (client-go, apimachinery, grpc),
#                       which every later step then finds in the build cache.
#   e2e build           then the e2e test binary, alone too (go vet beside it
#                       would compile the same packages a second time);
#   e2e                 then at once (the longest step by far: real control
#                       planes, nodes and TCG VMs, one test at a time);
#   beside it, one after another:
#     verify            gofmt, go vet, generated files current;
#     packages          every other package, one at a time;
#     fuzz-short        each fuzz target for TEST_FUZZTIME;
#     unit-race         the -short tests under -race.
#   test-builds         compiles unit-race's and fuzz-short's builds at nice 19
#                       after verify, while the package tests mostly wait on
#                       their VMs.
#
# Every go test runs with TEST_GOFLAGS (-vet=off: verify's go vet covers go
# test's own vet, which would run once per build mode). A failed step fails
# make test; the other chain still runs to its end so one run reports every
# failure.
set -uo pipefail

start=$(date +%s)

# step NAME CMD...: runs CMD and prints its line; returns CMD's status.
step() {
	local name=$1 s rc
	shift
	s=$(date +%s)
	"$@"
	rc=$?
	local now
	now=$(date +%s)
	if [ $rc -eq 0 ]; then
		echo "make test: $name ok in $((now - s))s (at +$((now - start))s)"
	else
		echo "make test: $name FAILED in $((now - s))s (at +$((now - start))s)"
	fi
	return $rc
}

gotest() { "$GO" test $TEST_GOFLAGS -p 1 -count=1 -timeout "$TEST_TIMEOUT" "$@"; }

# disk: the test nodes keep their state under TMPDIR and, like kubelet,
# report DiskPressure and take no pods when its filesystem has less than 10%
# available (their default pressure.diskAvailable); every test that schedules
# a pod would then fail on a timeout that does not say why. So a run that
# starts below it stops here and says so. A cold run (empty caches) writes
# about 10 GiB: below that much headroom it warns.
disk_check() {
	local dir=${TMPDIR:-/tmp} avail blocks bsize pct head
	read -r avail blocks bsize < <(stat -f -c '%a %b %S' "$dir") || return 0
	[ "$blocks" -gt 0 ] || return 0
	pct=$((avail * 100 / blocks))
	head=$(((avail - blocks / 10) * bsize / 1024 / 1024 / 1024))
	if [ "$avail" -lt $((blocks / 10)) ]; then
		echo "make test: only ${pct}% of the filesystem holding $dir is available ($((avail * bsize / 1024 / 1024 / 1024)) GiB): under 10% the test nodes report DiskPressure and take no pods. Free space (old Go build caches, old clones), then run again." >&2
		return 1
	fi
	if [ "$head" -lt 10 ]; then
		echo "make test: warning: ${head} GiB above the test nodes' DiskPressure threshold (10% available) on the filesystem holding $dir; a run with empty caches writes about 10 GiB" >&2
	fi
}
step disk disk_check || exit 1

bin_file=$(mktemp)
trap 'rm -f "$bin_file"' EXIT
step "control plane" sh -c 'hack/build-control-plane.sh > "$1"' _ "$bin_file" || exit 1
bin=$(cat "$bin_file")

# The e2e test binary is built before verify starts: two go commands
# compiling the same packages at once would both compile them.
e2e_build() { gotest -run '^$' ./e2e/ >/dev/null; }
step "e2e build" e2e_build || exit 1
QK_CONTROL_PLANE_BIN=$bin step e2e gotest ./e2e/ &
e2e=$!

rc=0
if step verify "$MAKE" --no-print-directory verify; then
	nice -n 19 "$MAKE" --no-print-directory test-builds &
	builds=$!
	pkgs=$("$GO" list -f '{{if ne .ImportPath "'"$PKG"'/e2e"}}{{.ImportPath}}{{end}}' ./...) || pkgs=
	if [ -z "$pkgs" ]; then
		echo "make test: go list found no packages" >&2
		rc=1
	fi
	QK_CONTROL_PLANE_BIN=$bin step packages gotest $pkgs || rc=1
	step benchplot sh -c 'cd hack/benchplot && "$0" test $1 -count=1 ./...' "$GO" "$TEST_GOFLAGS" || rc=1
	wait "$builds"
	step fuzz-short "$MAKE" --no-print-directory fuzz-short FUZZTIME="$TEST_FUZZTIME" FUZZ_FLAGS="$TEST_GOFLAGS" || rc=1
	step unit-race "$MAKE" --no-print-directory unit-race UNIT_FLAGS="-p=1 $TEST_GOFLAGS" || rc=1
else
	rc=1
fi
wait "$e2e" || rc=1
echo "make test: $([ $rc -eq 0 ] && echo ok || echo FAILED) in $(($(date +%s) - start))s"
exit $rc
