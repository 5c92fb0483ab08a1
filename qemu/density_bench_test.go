package qemu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// densityConfig is one memory tuning compared by BenchmarkIdleDensity.
type densityConfig struct {
	name   string
	memory MemoryTuning
	// ksm runs the host's KSM while the VMs idle (root only).
	ksm bool
	// env is added to QEMU's environment (this process's, while the
	// configuration's VMs start).
	env map[string]string
	// guest is a shell command each guest runs through its agent once at
	// its marker (before the idle window).
	guest string
	// prepare readies each VM's spec in its state dir before it starts,
	// as the node does for a pod (guest disks, display; nil: the base spec
	// as it is). Configurations built with the provider's helpers come
	// from the external benchmarks (AddDensityConfig).
	prepare func(ctx context.Context, s *Spec, dir string) error
	// versus names the configuration, run before this one, that its PSS
	// and anonymous memory are reported against (<cfg>-pss-x-of-<versus>,
	// <cfg>-anon-x-of-<versus>; "": none).
	versus string
}

// densityConfigs: QEMU's defaults (the baseline: mem-merge on is QEMU's
// default, but without KSM running nothing merges), then each knob added.
var densityConfigs = []densityConfig{
	{name: "qemu-defaults", memory: MemoryTuning{}},
	{name: "tb32", memory: MemoryTuning{TCGTranslationBufferMiB: 32}},
	{name: "tb32-fpr", memory: MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true}},
	{name: "tb32-fpr-ksm", memory: MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true, MemMerge: true}, ksm: true},
	// Cuts of issue #42 on the node's defaults (tb32-fpr), one at a time:
	// a 16 MiB translation buffer; one glibc malloc arena in QEMU (one
	// per thread otherwise); the guest's free page reporting order set
	// again at run time and a 4 MiB block freed once booted. Every
	// configuration with free page reporting has the node's order 0 on
	// its command line (densityCmdline), which the test image's init
	// writes back after virtio_balloon loads (Linux 6.1's driver
	// overrides it); tb32-fpr-order0 adds only the later free (a zone is
	// looked at again when a free block of at least that order is freed).
	{name: "tb16-fpr", memory: MemoryTuning{TCGTranslationBufferMiB: 16, FreePageReporting: true}},
	{name: "tb32-fpr-arena1", memory: MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true}, env: map[string]string{"MALLOC_ARENA_MAX": "1"}},
	{name: "tb32-fpr-order0", memory: MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true}, guest: "echo 0 > /sys/module/page_reporting/parameters/page_reporting_order && dd if=/dev/zero of=/dev/null bs=4M count=1 2>/dev/null"},
}

// BenchmarkIdleDensity: what an idle VM costs the host, per memory tuning,
// all in the same run. For each configuration N test-image VMs (acpi
// variant, 1 vCPU, QK_BENCH_DENSITY_MEM MiB, default 96) are started at
// once through this package, booted to their marker, left idle for
// QK_BENCH_DENSITY_IDLE seconds (default 30) and measured. At most
// QK_BENCH_DENSITY_PARALLEL (default 8) boot at once, and none starts while
// the host's MemAvailable is under QK_BENCH_DENSITY_FLOOR_MIB (default
// 2048): starts wait for it to come back (boots settling, KSM merging; as
// the scheduler waits out a node's MemoryPressure), QK_BENCH_DENSITY_PACE_S
// seconds in all at most (default 600, reported as <cfg>-paced-s); then
// <cfg>-vms < N says the limit was reached and why is logged.
// Per configuration:
//   - <cfg>-host-MiB/vm: drop of the host's MemAvailable from before the
//     start to the end of the idle window, / N (noisy on a shared machine);
//   - <cfg>-rss-MiB/vm, <cfg>-pss-MiB/vm, <cfg>-anon-MiB/vm: QEMU's RSS,
//     PSS and anonymous memory (smaps_rollup), mean per VM;
//   - <cfg>-host-cpu-busy-%: host CPU busy during the idle window (all
//     CPUs, /proc/stat; meaningless on a machine shared with other work),
//     <cfg>-qemu-cpu-%/vm: CPU time of each idle QEMU over the window (a
//     share of one CPU, mean per VM), <cfg>-ksmd-cpu-%: ksmd's share of
//     one CPU;
//   - <cfg>-marker-s: start of the first VM to the last boot marker;
//   - <cfg>-pss-x-of-baseline: PSS per VM / qemu-defaults' PSS per VM;
//   - <cfg>-pss-x-of-<other>, <cfg>-anon-x-of-<other>: the same against
//     the configuration it is compared with (densityConfig.versus).
//
// Besides the memory tunings, the external benchmarks add configurations
// of the node's defaults built as the node builds a pod's VM
// (density_exporter_bench_test.go): exporter-before and exporter-defaults.
//
// N is QK_BENCH_DENSITY_N (default 4). The KSM configuration starts KSM
// (root only; skipped otherwise), waits for two full scans after boot (at
// most 5 minutes) before its idle window, and puts /sys/kernel/mm/ksm/run
// back as it was, scanning QK_BENCH_DENSITY_KSM_PAGES pages per 20 ms
// (default 1000, ~200 MiB/s; the kernel's default is 100) meanwhile and
// reporting the wait as <cfg>-ksm-wait-s. QK_BENCH_DENSITY_CONFIGS (comma-separated names) runs a
// subset.
func BenchmarkIdleDensity(b *testing.B) {
	n := testutil.EnvInt("QK_BENCH_DENSITY_N", 4)
	idle := time.Duration(testutil.EnvInt("QK_BENCH_DENSITY_IDLE", 30)) * time.Second
	mem := testutil.EnvInt("QK_BENCH_DENSITY_MEM", 96)
	only := map[string]bool{}
	for _, c := range strings.Split(os.Getenv("QK_BENCH_DENSITY_CONFIGS"), ",") {
		if c = strings.TrimSpace(c); c != "" {
			only[c] = true
		}
	}
	base := testSpec(b, "acpi")
	base.MemoryMiB = mem
	// The command line a TCG node gives this image (provider's
	// EmulatedKernelCmdline with the default emulatedKernelArgs); the free
	// page reporting order is added per configuration (densityCmdline).
	base.Cmdline = "no_timer_check tsc=reliable sysctl.vm.compaction_proactiveness=0 " + base.Cmdline
	base.Network = true
	b.Logf("N=%d guest=%dMiB idle=%s", n, mem, idle)
	var basePSS float64
	// pss and anon per VM of each configuration run so far (versus).
	pss, anon := map[string]float64{}, map[string]float64{}
	for i := 0; i < b.N; i++ {
		for _, cfg := range densityConfigs {
			if len(only) > 0 && !only[cfg.name] {
				continue
			}
			r, err := idleDensity(b, base, cfg, n, idle)
			if err != nil {
				b.Fatalf("%s: %v", cfg.name, err)
			}
			if r == nil {
				continue
			}
			b.Logf("%s (%d VMs): host %.1f MiB/vm, RSS %.1f, PSS %.1f, anon %.1f MiB/vm; host CPU busy %.1f%%, QEMU %.2f%% of a CPU per VM, ksmd %.1f%%; all at marker %.1f s; KSM saved %.1f MiB/vm",
				cfg.name, r.vms, r.hostMiB, r.rssMiB, r.pssMiB, r.anonMiB, r.hostBusyPct, r.qemuCPUPct, r.ksmdPct, r.markerS, r.ksmSavedMiB)
			b.ReportMetric(r.hostMiB, cfg.name+"-host-MiB/vm")
			b.ReportMetric(r.rssMiB, cfg.name+"-rss-MiB/vm")
			b.ReportMetric(r.pssMiB, cfg.name+"-pss-MiB/vm")
			b.ReportMetric(r.anonMiB, cfg.name+"-anon-MiB/vm")
			b.ReportMetric(r.hostBusyPct, cfg.name+"-host-cpu-busy-%")
			b.ReportMetric(r.ksmdPct, cfg.name+"-ksmd-cpu-%")
			b.ReportMetric(r.qemuCPUPct, cfg.name+"-qemu-cpu-%/vm")
			b.ReportMetric(r.markerS, cfg.name+"-marker-s")
			b.ReportMetric(float64(r.vms), cfg.name+"-vms")
			b.ReportMetric(r.pacedS, cfg.name+"-paced-s")
			if cfg.ksm {
				b.ReportMetric(r.ksmWaitS, cfg.name+"-ksm-wait-s")
			}
			if cfg.name == "qemu-defaults" {
				basePSS = r.pssMiB
			} else if basePSS > 0 {
				b.ReportMetric(r.pssMiB/basePSS, cfg.name+"-pss-x-of-baseline")
			}
			pss[cfg.name], anon[cfg.name] = r.pssMiB, r.anonMiB
			if v := cfg.versus; v != "" && pss[v] > 0 && anon[v] > 0 {
				b.Logf("%s against %s: PSS %.3fx, anon %.3fx", cfg.name, v, r.pssMiB/pss[v], r.anonMiB/anon[v])
				b.ReportMetric(r.pssMiB/pss[v], cfg.name+"-pss-x-of-"+v)
				b.ReportMetric(r.anonMiB/anon[v], cfg.name+"-anon-x-of-"+v)
			}
		}
	}
	b.ReportMetric(float64(n), "N")
}

type densityResult struct {
	hostMiB, rssMiB, pssMiB, anonMiB float64
	hostBusyPct, ksmdPct, markerS    float64
	qemuCPUPct                       float64
	// vms is how many VMs ran (fewer than N when the limit was reached).
	vms         int
	ksmSavedMiB float64
	// ksmWaitS: the wait for two full KSM scans after the boots.
	ksmWaitS float64
	// pacedS: how long starts waited for MemAvailable to come back over
	// the floor (testutil.AwaitMemory).
	pacedS float64
}

const ksmDir = "/sys/kernel/mm/ksm"

// startKSM starts the host's KSM for configuration cfg and scans
// QK_BENCH_DENSITY_KSM_PAGES pages per wake-up; restore puts both back.
// ok false: KSM cannot run here (logged), the configuration is skipped.
func startKSM(b *testing.B, cfg densityConfig) (restore func(), ok bool, err error) {
	prev, err := os.ReadFile(filepath.Join(ksmDir, "run"))
	if err != nil {
		b.Logf("%s skipped: %v", cfg.name, err)
		return nil, false, nil
	}
	if err := os.WriteFile(filepath.Join(ksmDir, "run"), []byte("1\n"), 0); err != nil {
		b.Logf("%s skipped: cannot start KSM: %v", cfg.name, err)
		return nil, false, nil
	}
	undos := []func(){func() { os.WriteFile(filepath.Join(ksmDir, "run"), prev, 0) }}
	// The kernel's default rate (100 pages every 20 ms, ~20 MiB/s)
	// needs 15 minutes a scan over 200 96-MiB guests: the bench scans
	// QK_BENCH_DENSITY_KSM_PAGES (default 1000) per wake-up and puts
	// pages_to_scan back.
	pages := testutil.EnvInt("QK_BENCH_DENSITY_KSM_PAGES", 1000)
	if prevPages, err := os.ReadFile(filepath.Join(ksmDir, "pages_to_scan")); err == nil {
		if err := os.WriteFile(filepath.Join(ksmDir, "pages_to_scan"), []byte(strconv.Itoa(pages)+"\n"), 0); err != nil {
			undo(undos)
			return nil, false, fmt.Errorf("set KSM pages_to_scan to %d: %w", pages, err)
		}
		undos = append(undos, func() { os.WriteFile(filepath.Join(ksmDir, "pages_to_scan"), prevPages, 0) })
		b.Logf("%s: KSM pages_to_scan %d (was %s)", cfg.name, pages, strings.TrimSpace(string(prevPages)))
	}
	return func() { undo(undos) }, true, nil
}

// awaitKSMScans waits for two full KSM scans (merging needs two: the
// unstable tree, then the stable), at most 5 minutes, and says how long
// it waited in seconds.
func awaitKSMScans() (float64, error) {
	first, err := ksmCounter("full_scans")
	if err != nil {
		return 0, err
	}
	start := time.Now()
	for deadline := time.Now().Add(5 * time.Minute); time.Now().Before(deadline); time.Sleep(2 * time.Second) {
		if v, _ := ksmCounter("full_scans"); v >= first+2 {
			break
		}
	}
	return time.Since(start).Seconds(), nil
}

// undo runs fs in reverse order.
func undo(fs []func()) {
	for i := len(fs) - 1; i >= 0; i-- {
		fs[i]()
	}
}

func idleDensity(b *testing.B, base Spec, cfg densityConfig, n int, idle time.Duration) (*densityResult, error) {
	if cfg.ksm {
		restore, ok, err := startKSM(b, cfg)
		if !ok || err != nil {
			return nil, err
		}
		defer restore()
	}
	for k, v := range cfg.env {
		prev, had := os.LookupEnv(k)
		os.Setenv(k, v)
		if had {
			defer os.Setenv(k, prev)
		} else {
			defer os.Unsetenv(k)
		}
	}
	availBefore, err := testutil.MemAvailable()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+time.Duration(n)*15*time.Second)
	defer cancel()
	vms := make([]*VM, n)
	errs := make([]error, n)
	start := time.Now()
	var wg sync.WaitGroup
	// At most `parallel` VMs boot at once; no VM starts once the host's
	// MemAvailable is under the floor: the limit is reached, reported
	// instead of driving the host out of memory.
	parallel := testutil.EnvInt("QK_BENCH_DENSITY_PARALLEL", 8)
	floor := int64(testutil.EnvInt("QK_BENCH_DENSITY_FLOOR_MIB", 2048)) << 20
	maxPace := time.Duration(testutil.EnvInt("QK_BENCH_DENSITY_PACE_S", 600)) * time.Second
	sem := make(chan struct{}, parallel)
	started := n
	var paced time.Duration
	for i := range vms {
		sem <- struct{}{}
		avail, err := testutil.AwaitMemory(ctx, floor, maxPace-paced)
		paced += avail.Waited
		if err == nil && avail.Bytes < floor {
			<-sem
			started = i
			b.Logf("%s: limit reached after %d VMs: host MemAvailable %d MiB under the floor of %d MiB after waiting %.0f s for it to come back", cfg.name, i, avail.Bytes>>20, floor>>20, paced.Seconds())
			break
		}
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			vms[i], errs[i] = startDensityVM(ctx, b, base, cfg, i)
		}(i)
	}
	wg.Wait()
	defer func() {
		for _, vm := range vms {
			if vm != nil {
				killVM(vm)
			}
		}
	}()
	for i, err := range errs[:started] {
		if err != nil {
			return nil, fmt.Errorf("VM %d: %w", i, err)
		}
	}
	if started == 0 {
		return nil, fmt.Errorf("no VM started: host MemAvailable under the floor of %d MiB", floor>>20)
	}
	vms, n = vms[:started], started
	r := &densityResult{markerS: time.Since(start).Seconds(), vms: started, pacedS: paced.Seconds()}
	if paced > 0 {
		b.Logf("%s: starts paused %.0f s in all for MemAvailable to come back over the floor", cfg.name, paced.Seconds())
	}
	if cfg.ksm {
		if r.ksmWaitS, err = awaitKSMScans(); err != nil {
			return nil, err
		}
		b.Logf("%s: waited %.0f s for two full KSM scans", cfg.name, r.ksmWaitS)
	}
	cpu0, err := testutil.HostCPUTimes()
	if err != nil {
		return nil, err
	}
	ksmd0 := ksmdCPU()
	qemuCPU0 := make([]time.Duration, n)
	for i, vm := range vms {
		if st, err := vm.Stats(); err == nil {
			qemuCPU0[i] = st.CPUTime
		}
	}
	t0 := time.Now()
	time.Sleep(idle)
	cpu1, err := testutil.HostCPUTimes()
	if err != nil {
		return nil, err
	}
	wall := time.Since(t0)
	r.ksmdPct = (ksmdCPU() - ksmd0).Seconds() / wall.Seconds() * 100
	r.hostBusyPct = cpu1.BusyPercentSince(cpu0)
	if err := r.addVMStats(vms, qemuCPU0, wall); err != nil {
		return nil, err
	}
	if cfg.ksm {
		if sharing, err := ksmCounter("pages_sharing"); err == nil {
			r.ksmSavedMiB = float64(sharing) * float64(os.Getpagesize()) / (1 << 20) / float64(n)
		}
	}
	availAfter, err := testutil.MemAvailable()
	if err != nil {
		return nil, err
	}
	r.hostMiB = float64(availBefore-availAfter) / (1 << 20) / float64(n)
	return r, nil
}

// addVMStats adds the means per VM of vms' memory, and of their CPU
// time since cpu0 over wall, to r.
func (r *densityResult) addVMStats(vms []*VM, cpu0 []time.Duration, wall time.Duration) error {
	n := float64(len(vms))
	for i, vm := range vms {
		st, err := vm.Stats()
		if err != nil {
			return fmt.Errorf("VM %d stats: %w", i, err)
		}
		r.rssMiB += float64(st.RSSBytes) / (1 << 20) / n
		r.pssMiB += float64(st.PSSBytes) / (1 << 20) / n
		r.anonMiB += float64(st.AnonBytes) / (1 << 20) / n
		r.qemuCPUPct += (st.CPUTime - cpu0[i]).Seconds() / wall.Seconds() * 100 / n
	}
	return nil
}

// nodeFreePageReportingArg is provider/podspec.FreePageReportingArg,
// the free page reporting order a TCG node gives a directly booted kernel
// whose VM has free page reporting, restated: this package may not import
// provider (build/deps_test.go). TestDensityFreePageReportingArg (package
// qemu_test) holds the two equal.
const nodeFreePageReportingArg = "page_reporting.page_reporting_order=0"

// densityCmdline is the kernel command line cmdline as a TCG node gives it
// to a VM of memory tuning m: with nodeFreePageReportingArg first when m
// has free page reporting (podspec.FreePageReportingCmdline). Pure.
func densityCmdline(cmdline string, m MemoryTuning) string {
	if !m.FreePageReporting {
		return cmdline
	}
	return nodeFreePageReportingArg + " " + cmdline
}

// startDensityVM starts VM i of configuration cfg from base (prepared as
// cfg says) and waits for its boot marker, then runs cfg's guest command.
// The VM is returned whenever it started, also with an error (to be
// killed).
func startDensityVM(ctx context.Context, b *testing.B, base Spec, cfg densityConfig, i int) (*VM, error) {
	s := base
	s.Name = fmt.Sprintf("density-%d", i)
	s.Memory = cfg.memory
	s.Cmdline = densityCmdline(s.Cmdline, cfg.memory)
	dir := newStateDir(b)
	if cfg.prepare != nil {
		if err := cfg.prepare(ctx, &s, dir); err != nil {
			return nil, fmt.Errorf("prepare the spec: %w", err)
		}
	}
	vm, err := Start(ctx, s, dir)
	if err != nil {
		return nil, err
	}
	if err := vm.WaitConsole(ctx, bootMarker); err != nil {
		return vm, err
	}
	if cfg.guest != "" {
		return vm, guestRun(ctx, vm, cfg.guest)
	}
	return vm, nil
}

// guestRun runs shell command c in vm's guest through its agent.
func guestRun(ctx context.Context, vm *VM, c string) error {
	r, err := vm.GuestExec(ctx, ExecRequest{Path: "/bin/sh", Args: []string{"-c", c}})
	if err == nil && r.ExitCode != 0 {
		err = fmt.Errorf("exit %d: %s", r.ExitCode, r.Stderr)
	}
	if err != nil {
		return fmt.Errorf("in the guest, %q: %w", c, err)
	}
	return nil
}

func ksmCounter(name string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(ksmDir, name))
	if err != nil {
		return 0, err
	}
	return strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
}

// ksmdCPU is the CPU time of the ksmd kernel thread (0 when not found).
func ksmdCPU() time.Duration {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err != nil || strings.TrimSpace(string(comm)) != "ksmd" {
			continue
		}
		if pid, _ := strconv.Atoi(e.Name()); pid > 0 {
			if st, err := readProcStats(pid); err == nil {
				return st.CPUTime
			}
		}
	}
	return 0
}
