package qemu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

func median(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

// bareBoot starts the same VM with a bare qemu-system-x86_64 command line
// (same machine, CPU, memory, kernel, initrd, cmdline, pvpanic; serial on
// stdout) and returns the time until the boot marker appears.
func bareBoot(b *testing.B, spec Spec) time.Duration {
	b.Helper()
	return testutil.BareBoot(b, DefaultQEMUBinary, bootMarker,
		"-machine", "q35", "-accel", "tcg", "-cpu", DefaultCPUModel(ArchX86_64, AccelTCG),
		"-smp", fmt.Sprint(spec.CPUs), "-m", fmt.Sprintf("%dM", spec.MemoryMiB),
		"-nodefaults", "-no-user-config", "-display", "none",
		"-serial", "stdio", "-device", "pvpanic",
		"-kernel", spec.Kernel, "-initrd", spec.Initrd, "-append", spec.Cmdline)
}

// packageBoot starts the VM through this package (state dir, QMP, console
// logfile, supervision) and returns the time until the marker is on the
// console.
func packageBoot(b *testing.B, spec Spec) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := newStateDir(b)
	start := time.Now()
	vm, err := Start(ctx, spec, dir)
	if err != nil {
		b.Fatal(err)
	}
	defer killVM(vm)
	if err := vm.WaitConsole(ctx, bootMarker); err != nil {
		b.Fatal(err)
	}
	return time.Since(start)
}

// BenchmarkBootToMarker: start-to-boot-marker through this package vs the
// same VM from a bare qemu-system-x86_64 command line, alternating, median
// of 3 pairs per iteration. x-of-baseline = package median / bare median.
func BenchmarkBootToMarker(b *testing.B) {
	spec := testSpec(b, "acpi")
	var pkg, bare []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 3; j++ {
			if j%2 == 0 {
				bare = append(bare, bareBoot(b, spec))
				pkg = append(pkg, packageBoot(b, spec))
			} else {
				pkg = append(pkg, packageBoot(b, spec))
				bare = append(bare, bareBoot(b, spec))
			}
		}
	}
	b.StopTimer()
	mp, mb := median(pkg), median(bare)
	b.ReportMetric(float64(mp.Milliseconds()), "pkg-ms")
	b.ReportMetric(float64(mb.Milliseconds()), "bare-ms")
	b.ReportMetric(float64(mp)/float64(mb), "x-of-baseline")
	b.ReportMetric(float64(len(pkg)), "samples")
}

// BenchmarkCreateOverlay: qcow2 overlay creation over a sparse 1 GiB and a
// sparse 8 GiB raw base, in the same run (21 alternating samples each per
// iteration). x-of-baseline = 8 GiB median /
// 1 GiB median (O(1) means ~1).
func BenchmarkCreateOverlay(b *testing.B) {
	ctx := context.Background()
	dir := b.TempDir()
	bases := map[string]int64{"1GiB": 1 << 30, "8GiB": 8 << 30}
	for name, size := range bases {
		f, err := os.Create(filepath.Join(dir, name+".raw"))
		if err != nil {
			b.Fatal(err)
		}
		if err := f.Truncate(size); err != nil {
			b.Fatal(err)
		}
		f.Close()
	}
	times := map[string][]time.Duration{}
	sizes := map[string]int64{}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 21; j++ {
			order := []string{"1GiB", "8GiB"}
			if j%2 == 1 {
				order[0], order[1] = order[1], order[0]
			}
			for _, name := range order {
				ov := filepath.Join(dir, fmt.Sprintf("%s-%d-%d.qcow2", name, i, j))
				start := time.Now()
				if err := CreateOverlay(ctx, filepath.Join(dir, name+".raw"), FormatRaw, ov, 0); err != nil {
					b.Fatal(err)
				}
				times[name] = append(times[name], time.Since(start))
				if fi, err := os.Stat(ov); err == nil {
					sizes[name] = fi.Size()
				}
				os.Remove(ov)
			}
		}
	}
	b.StopTimer()
	m1, m8 := median(times["1GiB"]), median(times["8GiB"])
	b.ReportMetric(float64(m1.Microseconds())/1000, "1GiB-ms")
	b.ReportMetric(float64(m8.Microseconds())/1000, "8GiB-ms")
	b.ReportMetric(float64(sizes["1GiB"]), "1GiB-overlay-bytes")
	b.ReportMetric(float64(sizes["8GiB"]), "8GiB-overlay-bytes")
	b.ReportMetric(float64(m8)/float64(m1), "x-of-baseline")
}

// BenchmarkBootToMarkerAArch64: what emulating another architecture costs.
// Start-to-marker through this package of the arm64 test image on -M virt
// under TCG, against the x86-64 test image (baseline, same package, same
// size of VM), alternating, median of 3 each per iteration;
// x-of-baseline = aarch64 / x86_64. bare-max-ms is the same aarch64 VM from
// a bare command line with plain -cpu max (QARMA pointer authentication),
// the choice -cpu max,pauth-impdef=on avoids.
func BenchmarkBootToMarkerAArch64(b *testing.B) {
	x86 := testSpecArch(b, ArchX86_64, "acpi")
	arm := testSpecArch(b, ArchAArch64, "acpi")
	var xs, as, bare []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 3; j++ {
			xs = append(xs, packageBoot(b, x86))
			as = append(as, packageBoot(b, arm))
			bare = append(bare, testutil.BareBoot(b, ArchAArch64.Binary(), bootMarker,
				"-machine", "virt,gic-version=max", "-accel", "tcg", "-cpu", "max",
				"-smp", fmt.Sprint(arm.CPUs), "-m", fmt.Sprintf("%dM", arm.MemoryMiB),
				"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
				"-kernel", arm.Kernel, "-initrd", arm.Initrd, "-append", arm.Cmdline))
		}
	}
	b.StopTimer()
	mx, ma, mb := median(xs), median(as), median(bare)
	b.ReportMetric(float64(ma.Milliseconds()), "aarch64-ms")
	b.ReportMetric(float64(mx.Milliseconds()), "x86_64-ms")
	b.ReportMetric(float64(mb.Milliseconds()), "bare-max-ms")
	b.ReportMetric(float64(ma)/float64(mx), "x-of-baseline")
	b.ReportMetric(float64(len(as)), "samples")
}
