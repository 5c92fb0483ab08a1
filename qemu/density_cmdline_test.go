package qemu_test

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// TestDensityFreePageReportingArg: BenchmarkIdleDensity's command line
// (which restates podspec.FreePageReportingArg: package qemu may not
// import provider) is the one a TCG node gives a VM with and without free
// page reporting.
func TestDensityFreePageReportingArg(t *testing.T) {
	const image = "no_timer_check tsc=reliable console=ttyS0 panic=-1 quiet"
	for _, reporting := range []bool{true, false} {
		got := qemu.DensityCmdline(image, qemu.MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: reporting})
		want := podspec.FreePageReportingCmdline(qemu.AccelTCG, image, reporting)
		if got != want {
			t.Errorf("free page reporting %v: benchmark's command line %q, the node's %q", reporting, got, want)
		}
	}
}
