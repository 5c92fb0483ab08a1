package qemu_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// bootMarker is the line the test image prints on its serial console once
// booted (vmtest.BootMarker).
const bootMarker = "QK-BOOT-OK"

// boot is one boot to the marker: wall time from the start of QEMU (the
// exec, or qemu.Start) to the marker line, and QEMU's CPU time by then.
type boot struct{ wall, cpu time.Duration }

// plainArgs is the plainest command line a user would try the test image
// with: QEMU's defaults (its CPU model, its firmware, no sandbox, no QMP),
// the serial console on stdout, user networking on virtio-net, the image's
// own kernel command line.
func plainArgs(img, initrd string) []string {
	return []string{"-accel", "tcg", "-M", "q35", "-m", "256", "-smp", "1",
		"-nodefaults", "-nographic", "-serial", "stdio",
		"-kernel", filepath.Join(img, "vmlinuz"), "-initrd", initrd,
		"-append", imageCmdline(img), "-nic", "user,model=virtio-net-pci"}
}

func imageCmdline(img string) string {
	b, err := os.ReadFile(filepath.Join(img, "cmdline"))
	if err != nil {
		panic(err) // the image dir was just built with its cmdline
	}
	return strings.TrimSpace(string(b))
}

// plainBoot execs qemu-system-x86_64 with args and times the marker on its
// stdout.
func plainBoot(b *testing.B, args []string) boot {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, qemu.DefaultQEMUBinary, args...)
	// A session of its own, as QEMU started from a user's terminal.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatalf("start plain QEMU: %v", err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), bootMarker) {
			wall := time.Since(start)
			st, err := qemu.ReadProcStats(cmd.Process.Pid)
			if err != nil {
				b.Fatal(err)
			}
			return boot{wall: wall, cpu: st.CPUTime}
		}
	}
	b.Fatalf("plain QEMU exited without the boot marker %q: %v", bootMarker, sc.Err())
	return boot{}
}

// nodeSpec is the VM a node on its default configuration gives a pod of
// the test image with one vCPU and 256 MiB under TCG: the memory tuning,
// vmNice and kernel command line of provider/config's defaults, through
// the function the node calls (podspec.NodeKernelCmdline), with network (every pod has it). Not
// here: the node's vmUser (QEMU runs as the caller). Its CPU placement
// (a CPU cgroup of the default vmCgroup.cpuWeight, or vmNice) is decided
// as the agent decides it for this process (nodePlacement).
func nodeSpec(b *testing.B, img, initrd string) qemu.Spec {
	b.Helper()
	n, err := config.Resolve(&config.NodeConfiguration{}, config.Environment{Hostname: "bench", HostIP: "127.0.0.1", HostArch: "amd64"})
	if err != nil {
		b.Fatalf("resolve the default node configuration: %v", err)
	}
	cmdline := podspec.NodeKernelCmdline(qemu.ArchX86_64, qemu.AccelTCG,
		imageCmdline(img), "", n.EmulatedKernelArgs, n.VMMemory.FreePageReporting)
	p := nodePlacement(b, n)
	return qemu.Spec{
		Cgroup: p.Cgroup,
		Name:   "bench-node", Arch: qemu.ArchX86_64, Accelerator: qemu.AccelTCG,
		CPUs: 1, MemoryMiB: 256,
		Kernel: filepath.Join(img, "vmlinuz"), Initrd: initrd, Cmdline: cmdline,
		Network:     true,
		AllowedDirs: []string{img},
		Memory:      nodeMemory(n),
		Nice:        p.Nice,
		// QK_BENCH_BOOT_NODE_CPU: another -cpu for the node's side ("":
		// the default, qemu.DefaultCPUModel).
		CPUModel: os.Getenv("QK_BENCH_BOOT_NODE_CPU"),
	}
}

// nodeMemory is the memory tuning node n gives its VMs (as
// cmd/qemu-kubelet passes its vmMemory to the provider).
func nodeMemory(n *config.Node) qemu.MemoryTuning {
	return qemu.MemoryTuning{
		TCGTranslationBufferMiB: n.VMMemory.TCGTranslationBufferMiB,
		FreePageReporting:       n.VMMemory.FreePageReporting,
		MemMerge:                n.VMMemory.PageMerging,
	}
}

// envMiB is the whole number in environment variable name (0 if unset).
func envMiB(b *testing.B, name string) int {
	v := os.Getenv(name)
	if v == "" {
		return 0
	}
	var n int
	if _, err := fmt.Sscan(v, &n); err != nil || n < 0 {
		b.Fatalf("%s=%q: want a number of MiB", name, v)
	}
	return n
}

// nodePlacement is the CPU placement a default node's agent running as
// this process picks (PlaceCPU, as provider.VMPlacement): a CPU cgroup of
// weight vmCgroup.cpuWeight where it may make one, else vmNice.
func nodePlacement(b *testing.B, n *config.Node) qemu.CPUPlacement {
	b.Helper()
	c := n.VMCgroup
	return qemu.PlaceCPU(qemu.PlacementInput{Base: qemu.Cgroup{Root: c.Root, Parent: c.Parent}, Own: c.Own, Weight: c.CPUWeight, Nice: n.VMNice})
}

// nodeBoot starts spec through package qemu (state dir, QMP, -S and the
// renice with vmNice, console socket and log) and times the marker in
// console.log (followed as `kubectl logs -f` follows it) from the call to
// qemu.Start.
func nodeBoot(b *testing.B, spec qemu.Spec) boot {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	dir := qemu.NewStateDir(b)
	start := time.Now()
	vm, err := qemu.Start(ctx, spec, dir)
	if err != nil {
		b.Fatal(err)
	}
	defer qemu.KillVM(vm)
	// Follow console.log as `kubectl logs -f` does (woken by inotify).
	fctx, found := context.WithCancel(ctx)
	mw := &markerWriter{found: found}
	err = vm.FollowConsole(fctx, 0, mw)
	if mw.at.IsZero() {
		b.Fatalf("no boot marker %q on the console of the node's VM: %v", bootMarker, err)
	}
	wall := mw.at.Sub(start)
	st, err := vm.Stats()
	if err != nil {
		b.Fatal(err)
	}
	return boot{wall: wall, cpu: st.CPUTime}
}

// markerWriter notes when the boot marker first passes through it and
// then calls found.
type markerWriter struct {
	buf   []byte
	at    time.Time
	found context.CancelFunc
}

func (w *markerWriter) Write(p []byte) (int, error) {
	if w.at.IsZero() {
		w.buf = append(w.buf, p...)
		if bytes.Contains(w.buf, []byte(bootMarker)) {
			w.at = time.Now()
			w.found()
		}
	}
	return len(p), nil
}

func medianOf(d []time.Duration) time.Duration {
	s := slices.Clone(d)
	slices.Sort(s)
	return s[len(s)/2]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func loadAvg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	return strings.TrimSpace(string(b))
}

// BenchmarkBootPlainVsNode: the test image booted by the plainest QEMU
// command line (plainArgs: what a user compares the node with) against
// the same kernel and initrd booted with the node's own command line on
// its default configuration (nodeSpec, started by qemu.Start), both
// started here, rounds alternating (plain first in even rounds), to the
// boot marker. QK_BENCH_BOOT_ROUNDS (default 5) rounds per iteration;
// QK_BENCH_BOOT_NODE_CPU gives the node's VM another -cpu (e.g. max),
// QK_BENCH_BOOT_NODE_TB=N adds the node's VM with tb-size N MiB to each
// round (tbN-ms, ...). The plain QEMU runs in a session of its own (a user's terminal), the
// node's VM in this process's session with the node's CPU placement
// (nodePlacement: a CPU cgroup of weight vmCgroup.cpuWeight for a root
// process in the root CPU cgroup, else vmNice). QK_BENCH_BOOT_NICE=1 adds
// the node's VM at vmNice in this process's cgroup and session (the
// placement before CPU cgroups) to each round (nice-ms, nice-cpu-ms,
// nice-x-of-baseline, nice-cpu-x-of-baseline); QK_BENCH_BOOT_WEIGHTS
// (comma-separated) adds the node's VM in a CPU cgroup whose parent
// (<parent>-w<weight>) has that weight (w<weight>-ms, ...);
// QK_BENCH_BOOT_HOG=N keeps
// N goroutines of this process busy during the rounds (a busy agent or
// control plane in the agent's session).
// Reported: both medians (plain-ms, node-ms), x-of-baseline = node median /
// plain median (target 1.05), and QEMU's CPU time to the marker on both
// sides (plain-cpu-ms, node-cpu-ms, cpu-x-of-baseline: the boot as work
// done, which a shared host's load moves less than the wall clock). The
// node's wall time includes its start path (state dir, cgroup, QMP
// handshake; with vmNice the renice and cont) and console.log's follow.
func BenchmarkBootPlainVsNode(b *testing.B) {
	img := qemu.TestImage(b)
	initrd := filepath.Join(img, "initramfs-acpi.cpio.gz")
	rounds := 5
	if v := os.Getenv("QK_BENCH_BOOT_ROUNDS"); v != "" {
		if _, err := fmt.Sscan(v, &rounds); err != nil || rounds < 1 {
			b.Fatalf("QK_BENCH_BOOT_ROUNDS=%q: want a positive number", v)
		}
	}
	plain, spec := plainArgs(img, initrd), nodeSpec(b, img, initrd)
	b.Logf("plain: %s %s", qemu.DefaultQEMUBinary, strings.Join(plain, " "))
	b.Logf("node's CPU placement: cgroup %v, nice %d", spec.Cgroup != nil, spec.Nice)
	// The node's VMs, each in turn after the plain QEMU: "node" (its
	// placement), then with QK_BENCH_BOOT_NICE=1 "nice" (vmNice in the
	// agent's cgroup and session: the placement before CPU cgroups).
	sides := []struct {
		name string
		spec qemu.Spec
	}{{"node", spec}}
	if os.Getenv("QK_BENCH_BOOT_NICE") == "1" {
		nice := spec
		nice.Cgroup, nice.Nice = nil, config.DefaultVMNice
		sides = append(sides, struct {
			name string
			spec qemu.Spec
		}{"nice", nice})
	}
	// QK_BENCH_BOOT_WEIGHTS: more sides, one per CPU weight of the VMs'
	// parent cgroup ("w<weight>"), where the node's side has a cgroup.
	for _, f := range strings.FieldsFunc(os.Getenv("QK_BENCH_BOOT_WEIGHTS"), func(r rune) bool { return r == ',' }) {
		var w int
		if _, err := fmt.Sscan(f, &w); err != nil || w < 1 || w > qemu.MaxCPUWeight || spec.Cgroup == nil {
			b.Fatalf("QK_BENCH_BOOT_WEIGHTS %q: want weights of 1 to %d, and a node placed in a CPU cgroup", f, qemu.MaxCPUWeight)
		}
		ws := spec
		cg := *spec.Cgroup
		cg.Parent, cg.ParentCPUWeight = fmt.Sprintf("%s-w%d", cg.Parent, w), w
		if err := qemu.PrepareCgroupParent(cg); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { // the parent, empty once its VMs stopped
			dirs, _ := filepath.Glob(filepath.Join(cg.Root, "*", cg.Parent))
			for _, d := range append(dirs, filepath.Join(cg.Root, cg.Parent)) {
				_ = os.Remove(d)
			}
		})
		ws.Cgroup = &cg
		sides = append(sides, struct {
			name string
			spec qemu.Spec
		}{fmt.Sprintf("w%d", w), ws})
	}
	if tb := envMiB(b, "QK_BENCH_BOOT_NODE_TB"); tb > 0 {
		ts := spec
		ts.Memory.TCGTranslationBufferMiB = tb
		sides = append(sides, struct {
			name string
			spec qemu.Spec
		}{fmt.Sprintf("tb%d", tb), ts})
	}
	for _, sd := range sides {
		sd.spec.StateDir = "/STATE" // Start sets the real one
		if err := sd.spec.Validate(); err != nil {
			b.Fatalf("%s spec: %v", sd.name, err)
		}
		b.Logf("%s: %s %s", sd.name, qemu.DefaultQEMUBinary, strings.Join(qemu.Args(sd.spec), " "))
	}
	// Warm-up: binaries, kernel and initrd in the page cache for both.
	plainBoot(b, plain)
	nodeBoot(b, spec)
	stopHog := busyAgent(b)
	defer stopHog()
	b.Logf("load average at the start: %s", loadAvg())
	ps, ns := []boot{}, make([][]boot, len(sides))
	for b.Loop() {
		for r := range rounds {
			if r%2 == 0 {
				ps = append(ps, plainBoot(b, plain))
			}
			for i, sd := range sides {
				ns[i] = append(ns[i], nodeBoot(b, sd.spec))
			}
			if r%2 == 1 {
				ps = append(ps, plainBoot(b, plain))
			}
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	wall := func(bs []boot) (w, c []time.Duration) {
		for _, x := range bs {
			w, c = append(w, x.wall), append(c, x.cpu)
		}
		return w, c
	}
	pw, pc := wall(ps)
	b.Logf("plain wall %v cpu %v", pw, pc)
	b.ReportMetric(ms(medianOf(pw)), "plain-ms")
	b.ReportMetric(ms(medianOf(pc)), "plain-cpu-ms")
	for i, sd := range sides {
		nw, nc := wall(ns[i])
		b.Logf("%s wall %v cpu %v", sd.name, nw, nc)
		x := ""
		if sd.name != "node" {
			x = sd.name + "-"
		}
		b.ReportMetric(ms(medianOf(nw)), sd.name+"-ms")
		b.ReportMetric(float64(medianOf(nw))/float64(medianOf(pw)), x+"x-of-baseline")
		b.ReportMetric(ms(medianOf(nc)), sd.name+"-cpu-ms")
		b.ReportMetric(float64(medianOf(nc))/float64(medianOf(pc)), x+"cpu-x-of-baseline")
	}
	b.ReportMetric(float64(len(ps)), "rounds")
}

// busyAgent keeps QK_BENCH_BOOT_HOG goroutines (default 0) spinning in
// this process, as a busy agent or control plane in the agent's session
// would, until the returned func is called.
func busyAgent(b *testing.B) func() {
	n := 0
	if v := os.Getenv("QK_BENCH_BOOT_HOG"); v != "" {
		if _, err := fmt.Sscan(v, &n); err != nil || n < 0 {
			b.Fatalf("QK_BENCH_BOOT_HOG=%q: want a number of busy goroutines", v)
		}
	}
	if n == 0 {
		return func() {}
	}
	b.Logf("%d busy goroutines in the agent's session", n)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			runtime.LockOSThread()
			for x := 0; ; x++ {
				if x%(1<<20) == 0 {
					select {
					case <-stop:
						return
					default:
					}
				}
			}
		}()
	}
	return func() { close(stop); wg.Wait() }
}
