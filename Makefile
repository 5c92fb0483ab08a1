# qemu-kubelet — common tasks. The first two are the README's quick start.
#   make run    local control plane + a virtual node (NODES=3: three) + the controller + a sample pool
#   make test   everything CI runs (installs what a fresh machine lacks)
#   make bench  benchmarks (each takes its own medians/ratios inside one iteration); results in $(BENCH_OUT)
#   make soak   the chaos soak (not in CI; docs/operations.md "Chaos soak"); results in soak-results.txt

GO        ?= go
VERSION   ?= v0.1.0-dev+$(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
PKG       := github.com/qemu-kubelet/qemu-kubelet
LDFLAGS   := -X main.version=$(VERSION)
BIN       := bin
BENCH_OUT ?= bench-results.txt
BENCHTIME ?= 1x
# TEST_TIMEOUT: each package's go test timeout in make test. The e2e package
# takes 18-26 minutes on two cores; a run at three times that load (other
# builds and test runs on the machine) outlasted 45 minutes. CI's limit is 90.
TEST_TIMEOUT ?= 60m
NODES     ?= 1

GOFLAGS ?= -mod=mod
# -trimpath: build cache keys then do not depend on the checkout's directory,
# so a fresh clone in another folder (CI) reuses the packages an earlier run
# compiled instead of compiling every package of the module again for vet,
# test, -race and -fuzz.
export GOFLAGS := $(GOFLAGS) $(if $(filter -trimpath,$(GOFLAGS)),,-trimpath)
export GOTOOLCHAIN ?= local

.PHONY: all build image test check unit unit-race fuzz-short test-builds vet fmt-check verify run bench soak deps control-plane clean e2e-keepvms

all: build

deps:
	@hack/install-deps.sh

control-plane: deps
	@hack/build-control-plane.sh

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/...

# image: the Dockerfile's image built without a Docker engine or a container
# registry (buildah from a debootstrap base; hack/build-image.sh), as an OCI
# layout under ~/.cache/qemu-kubelet/image; prints oci:DIR:TAG.
image: deps build
	@hack/build-image.sh --tag $(subst +,-,$(VERSION)) $(BIN)

vet:
	$(GO) vet ./...

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi

# verify: formatting, vet, and generated files (CRDs, deepcopy, chart CRD copies, Jumpstarter protocol Go code) up to date.
verify: fmt-check vet
	hack/verify-crds.sh
	hack/gen-proto.sh --check
	hack/sync-chart-crds.sh --check

# test: everything CI runs (hack/test.sh says the order and why): the control
# plane first, then the e2e package beside verify, the other packages,
# fuzz-short and unit-race; each step prints its time. Every go test there
# runs with -vet=off: verify ran `go vet ./...`, whose analyzers include all
# of go test's own; go test would vet again once per build mode (normal,
# -race, fuzz), each pass about 60 CPU-s in an empty build cache.
TEST_GOFLAGS := -vet=off
test: deps
	@GO="$(GO)" PKG="$(PKG)" MAKE="$(MAKE)" TEST_GOFLAGS="$(TEST_GOFLAGS)" \
	  TEST_TIMEOUT="$(TEST_TIMEOUT)" TEST_FUZZTIME="$(TEST_FUZZTIME)" hack/test.sh

# test-builds: compiles (and links, running nothing) what unit-race and
# fuzz-short of make test run, so that they find it in the build cache. Its
# failures are theirs to report: it prints only its timing.
test-builds:
	@start=$$(date +%s); \
	$(GO) test -race $(TEST_GOFLAGS) -exec /bin/true ./... >/dev/null 2>&1; \
	seen=; for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; case " $$seen " in *" $$pkg "*) continue;; esac; seen="$$seen $$pkg"; \
	  $(GO) test $(TEST_GOFLAGS) -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime 1x ./$$pkg >/dev/null 2>&1; \
	done; \
	echo "test-builds: -race and fuzz builds in $$(( $$(date +%s) - start ))s"

# e2e-keepvms: the chart's node agent pod spec run as runc containers of two
# images `make image` builds, upgraded with VMs and a Jumpstarter lease held
# (e2e TestChartAgentUpgradeKeepsVMs; docs/install.md "VMs outlive the
# agent"). Not in make test: two image builds and two TCG VMs take minutes.
# Needs root, buildah, runc, umoci, debootstrap.
e2e-keepvms: deps
	QK_CONTROL_PLANE_BIN=$$(hack/build-control-plane.sh) QK_E2E_KEEPVMS=1 \
	  $(GO) test -count=1 -timeout 40m -run '^TestChartAgentUpgradeKeepsVMs$$' -v ./e2e/

# TEST_FUZZTIME: each fuzz target's run in make test (seed corpora always run
# as unit tests; this explores beyond them), about 2-8 s each on two cores.
TEST_FUZZTIME ?= 20000x

# check: make test (which runs the unit tests under -race too).
check: test

# unit: the fast inner loop. Tests that need QEMU (or qemu-img), a registry
# or a control plane skip under -short (internal/testutil.SkipIfShort). It
# proves that: the tools such tests start are shadowed on PATH by a shim
# that records the call and fails, and unit fails if any was called.
# UNIT_FLAGS: extra go test flags of unit and unit-race (make test: -p=1).
unit:
	@hack/unit-shim.sh $(GO) test -count=1 -short $(UNIT_FLAGS) ./...

unit-race:
	@hack/unit-shim.sh $(GO) test -race -count=1 -short $(UNIT_FLAGS) ./...

# fuzz-short: each fuzz target for FUZZTIME (seed corpora in testdata/fuzz);
# FUZZ_FLAGS: extra go test flags (make test: -vet=off).
# FUZZTIME is a count of inputs (Nx), not a duration: with a duration, Go
# before 1.27 can fail a target that found nothing with a bare "context
# deadline exceeded" as the time runs out (golang/go#75804). A count has no
# deadline, and a loaded machine only makes it slower.
FUZZTIME ?= 50000x
FUZZ_FLAGS ?=
# A target that is not in its package fails (go test -fuzz would only warn).
FUZZ_TARGETS := oci:FuzzPlanManifest oci:FuzzExtractContainerDisk oci:FuzzSafeTarPath \
	provider/config:FuzzDecode provider/podspec:FuzzTranslate
fuzz-short:
	@set -e; case "$(FUZZTIME)" in *x) ;; *) echo "fuzz-short: FUZZTIME=$(FUZZTIME) is not a count like 50000x (a duration can fail a clean target, golang/go#75804)"; exit 1;; esac; \
	for t in $(FUZZ_TARGETS); do \
	  pkg=$${t%%:*}; fn=$${t#*:}; \
	  grep -qs "^func $$fn(" ./$$pkg/*_test.go || { echo "fuzz-short: no $$fn in ./$$pkg (FUZZ_TARGETS is stale)"; exit 1; }; \
	  echo "fuzz $$pkg $$fn ($(FUZZTIME))"; \
	  $(GO) test $(FUZZ_FLAGS) -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) ./$$pkg; \
	done

run: deps build
	$(GO) build -o $(BIN)/local-up ./hack/local-up
	QK_CONTROL_PLANE_BIN=$$(hack/build-control-plane.sh) exec $(BIN)/local-up --bin-dir $(BIN) --nodes $(NODES)

# bench: every benchmark once (each takes its own baseline in the same run),
# then hack/benchplot appends a summary (every ratio beside its figures) to
# $(BENCH_OUT) and draws BenchmarkBurst's create->Ready vs N into $(BENCH_PNG).
# Packages run one at a time (-p 1): a benchmark that starts VMs must not share
# the host's two cores with another package's VMs.
# BENCH (a -bench pattern) and BENCH_PKGS pick a subset, e.g.
# make bench BENCH='ApplyToLogs|LeaseFromZero' BENCH_PKGS=./e2e/
# (a subset draws no plot unless BENCH_PNG is given).
BENCH ?= .
BENCH_PKGS ?= ./...
ifeq ($(BENCH),.)
BENCH_PNG ?= docs/performance-burst.png
endif
bench: deps
	@echo "# qemu-kubelet benchmarks $$(date -u +%FT%TZ) $$(git rev-parse --short HEAD 2>/dev/null) load $$(cut -d' ' -f1-3 /proc/loadavg)" > $(BENCH_OUT)
	@date +%s > $(BENCH_OUT).start
	bash -o pipefail -c 'QK_CONTROL_PLANE_BIN=$$(hack/build-control-plane.sh) \
	  $(GO) test -p 1 -run "^$$" -bench "$(BENCH)" -benchtime $(BENCHTIME) -benchmem -timeout 60m $(BENCH_PKGS) 2>&1 | tee -a $(BENCH_OUT)'
	@echo "# summary $$(date -u +%FT%TZ) load $$(cut -d' ' -f1-3 /proc/loadavg) elapsed $$(( $$(date +%s) - $$(cat $(BENCH_OUT).start) ))s" >> $(BENCH_OUT); rm -f $(BENCH_OUT).start
	cd hack/benchplot && $(GO) run . -in $(abspath $(BENCH_OUT)) -png "$(if $(BENCH_PNG),$(abspath $(BENCH_PNG)))" >> $(abspath $(BENCH_OUT))
	@echo "results: $(BENCH_OUT) $(if $(BENCH_PNG),plot: $(BENCH_PNG))"

# soak: e2e TestSoak for SOAK_DURATION (Go duration) with random faults;
# SOAK_SEED replays a run's choices. The test timeout is the duration plus
# 30 minutes (builds, images, start-up, settling and cleanup).
SOAK_DURATION ?= 30m
SOAK_SEED ?=
SOAK_LOG_DIR ?= /tmp/qemu-kubelet-soak-logs
soak: deps
	@secs=$$(echo "$(SOAK_DURATION)" | awk '{d=$$0; n=0; while (match(d, /^[0-9.]+(h|ms|m|s)/)) { u=substr(d,RSTART,RLENGTH); sub(/^[0-9.]+/, "", u); v=substr(d,1,RLENGTH-length(u))+0; n+=v*(u=="h"?3600:u=="m"?60:u=="s"?1:0.001); d=substr(d,RLENGTH+1) } if (d != "" || n <= 0) exit 1; print int(n)}') || \
	  { echo "SOAK_DURATION=$(SOAK_DURATION): want a Go duration such as 30m or 1h30m"; exit 2; }; \
	QK_CONTROL_PLANE_BIN=$$(hack/build-control-plane.sh) SOAK_DURATION=$(SOAK_DURATION) SOAK_SEED=$(SOAK_SEED) SOAK_LOG_DIR=$(SOAK_LOG_DIR) \
	  $(GO) test -count=1 -v -run '^TestSoak$$' -timeout $$((secs + 1800))s ./e2e/ 2>&1 | tee soak-results.txt; \
	grep -q '^ok ' soak-results.txt

clean:
	rm -rf $(BIN) $(BENCH_OUT) soak-results.txt
