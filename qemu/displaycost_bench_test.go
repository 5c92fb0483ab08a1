package qemu_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// displaySample is one VM of BenchmarkDisplayCost: QEMU's CPU time to the
// boot marker, its CPU time over the idle window after it, and its
// memory at the window's end.
type displaySample struct {
	bootCPU, idleCPU     time.Duration
	rss, pss, anon       int64
	bootWall, idleWindow time.Duration
}

// BenchmarkDisplayCost: what a display (Spec.Display, the pod annotation
// qemu-kubelet.io/display: vnc: a graphics card and a VNC server no client
// is connected to) costs a VM of the node's default configuration
// (nodeSpec: the test image, 1 vCPU, 256 MiB, TCG). In each of
// QK_BENCH_DISPLAY_ROUNDS rounds (default 5) the node's spec without and
// with the display boot side by side (so both meet the same host load and
// share QEMU's libraries alike), to the boot marker, then idle for
// QK_BENCH_DISPLAY_IDLE seconds (default 20). Reported, medians per VM:
// none-/display- boot-cpu-ms (QEMU's CPU time to the marker), idle-cpu-%
// (of one CPU over the idle window), pss-MiB, anon-MiB, rss-MiB (at the
// window's end), and display/none ratios (boot-cpu-x, pss-x, anon-x).
func BenchmarkDisplayCost(b *testing.B) {
	img := qemu.TestImage(b)
	initrd := filepath.Join(img, "initramfs-acpi.cpio.gz")
	rounds, idle := 5, 20*time.Second
	if v := os.Getenv("QK_BENCH_DISPLAY_ROUNDS"); v != "" {
		if _, err := fmt.Sscan(v, &rounds); err != nil || rounds < 1 {
			b.Fatalf("QK_BENCH_DISPLAY_ROUNDS=%q: want a positive number", v)
		}
	}
	if v := os.Getenv("QK_BENCH_DISPLAY_IDLE"); v != "" {
		var s int
		if _, err := fmt.Sscan(v, &s); err != nil || s < 1 {
			b.Fatalf("QK_BENCH_DISPLAY_IDLE=%q: want a positive number of seconds", v)
		}
		idle = time.Duration(s) * time.Second
	}
	none := nodeSpec(b, img, initrd)
	display := none
	display.Name, display.Display = "bench-display", true
	b.Logf("load average at the start: %s", loadAvg())
	var samples [2][]displaySample
	for b.Loop() {
		for r := range rounds {
			dirs := [2]string{qemu.NewStateDir(b), qemu.NewStateDir(b)}
			var got [2]displaySample
			var errs [2]error
			var wg sync.WaitGroup
			for i, s := range []qemu.Spec{none, display} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					got[i], errs[i] = displayRun(s, dirs[i], idle)
				}()
			}
			wg.Wait()
			for i, err := range errs {
				if err != nil {
					b.Fatalf("round %d, display %v: %v", r, i == 1, err)
				}
				samples[i] = append(samples[i], got[i])
			}
			b.Logf("round %d: none %+v; display %+v", r, got[0], got[1])
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	med := func(s []displaySample, f func(displaySample) float64) float64 {
		d := make([]time.Duration, len(s))
		for i, x := range s {
			d[i] = time.Duration(f(x) * 1e6) // medianOf sorts durations; µ-units keep the precision
		}
		return float64(medianOf(d)) / 1e6
	}
	metrics := []struct {
		name string
		f    func(displaySample) float64
	}{
		{"boot-cpu-ms", func(s displaySample) float64 { return ms(s.bootCPU) }},
		{"idle-cpu-%", func(s displaySample) float64 { return 100 * s.idleCPU.Seconds() / s.idleWindow.Seconds() }},
		{"pss-MiB", func(s displaySample) float64 { return float64(s.pss) / (1 << 20) }},
		{"anon-MiB", func(s displaySample) float64 { return float64(s.anon) / (1 << 20) }},
		{"rss-MiB", func(s displaySample) float64 { return float64(s.rss) / (1 << 20) }},
		{"boot-wall-ms", func(s displaySample) float64 { return ms(s.bootWall) }},
	}
	vals := map[string][2]float64{}
	for _, m := range metrics {
		v := [2]float64{med(samples[0], m.f), med(samples[1], m.f)}
		vals[m.name] = v
		b.ReportMetric(v[0], "none-"+m.name)
		b.ReportMetric(v[1], "display-"+m.name)
	}
	for m, unit := range map[string]string{"boot-cpu-ms": "boot-cpu-x", "pss-MiB": "pss-x", "anon-MiB": "anon-x"} {
		b.ReportMetric(vals[m][1]/vals[m][0], unit)
	}
	b.ReportMetric(float64(len(samples[0])), "rounds")
}

// displayRun starts spec in dir, waits for the boot marker on its
// console, then idles for idle and reads QEMU's CPU and memory.
func displayRun(spec qemu.Spec, dir string, idle time.Duration) (displaySample, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+idle)
	defer cancel()
	start := time.Now()
	vm, err := qemu.Start(ctx, spec, dir)
	if err != nil {
		return displaySample{}, err
	}
	defer qemu.KillVM(vm)
	fctx, found := context.WithCancel(ctx)
	mw := &markerWriter{found: found}
	err = vm.FollowConsole(fctx, 0, mw)
	if mw.at.IsZero() {
		return displaySample{}, fmt.Errorf("no boot marker %q on the console: %v", bootMarker, err)
	}
	booted, err := vm.Stats()
	if err != nil {
		return displaySample{}, err
	}
	select {
	case <-time.After(idle):
	case <-ctx.Done():
		return displaySample{}, ctx.Err()
	}
	end, err := vm.Stats()
	if err != nil {
		return displaySample{}, err
	}
	return displaySample{bootCPU: booted.CPUTime, idleCPU: end.CPUTime - booted.CPUTime, idleWindow: end.At.Sub(booted.At),
		rss: end.RSSBytes, pss: end.PSSBytes, anon: end.AnonBytes, bootWall: mw.at.Sub(start)}, nil
}
