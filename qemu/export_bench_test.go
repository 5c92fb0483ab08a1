package qemu

import "context"

// Test helpers of this package exported to its external benchmarks
// (package qemu_test), which also import provider packages that import this
// one.
var (
	TestImage     = testImage
	NewStateDir   = newStateDir
	KillVM        = killVM
	ReadProcStats = readProcStats
	// DensityCmdline is the command line BenchmarkIdleDensity gives a
	// configuration's VMs.
	DensityCmdline = densityCmdline
)

// AddDensityConfig adds a configuration to BenchmarkIdleDensity, after the
// package's own: its memory tuning, versus (the configuration its memory
// is reported against, added before it; "": none) and prepare (readies
// each VM's spec in its state dir before it starts, as the node does).
// For the external benchmarks, whose configurations are built with
// provider packages; call it from init.
func AddDensityConfig(name string, memory MemoryTuning, versus string, prepare func(ctx context.Context, s *Spec, dir string) error) {
	densityConfigs = append(densityConfigs, densityConfig{name: name, memory: memory, versus: versus, prepare: prepare})
}
