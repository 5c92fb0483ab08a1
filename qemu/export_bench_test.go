package qemu

// Test helpers of this package exported to its external benchmarks
// (package qemu_test), which also import provider packages that import this
// one.
var (
	TestImage     = testImage
	NewStateDir   = newStateDir
	KillVM        = killVM
	ReadProcStats = readProcStats
)
