package qemu_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
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
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
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
// the same functions the node calls (podspec.KernelCmdline,
// podspec.EmulatedKernelCmdline), with network (every pod has it). Not
// here: the node's vmUser (QEMU runs as the caller) and a per-VM cgroup
// (vmCgroup's default is the agent's own).
func nodeSpec(b *testing.B, img, initrd string) qemu.Spec {
	b.Helper()
	n, err := config.Resolve(&config.NodeConfiguration{}, config.Environment{Hostname: "bench", HostIP: "127.0.0.1", HostArch: "amd64"})
	if err != nil {
		b.Fatalf("resolve the default node configuration: %v", err)
	}
	cmdline := podspec.EmulatedKernelCmdline(qemu.ArchX86_64, qemu.AccelTCG,
		podspec.KernelCmdline(qemu.ArchX86_64, imageCmdline(img), ""), n.EmulatedKernelArgs)
	return qemu.Spec{
		Name: "bench-node", Arch: qemu.ArchX86_64, Accelerator: qemu.AccelTCG,
		CPUs: 1, MemoryMiB: 256,
		Kernel: filepath.Join(img, "vmlinuz"), Initrd: initrd, Cmdline: cmdline,
		Network:     true,
		AllowedDirs: []string{img},
		Memory: qemu.MemoryTuning{
			TCGTranslationBufferMiB: n.VMMemory.TCGTranslationBufferMiB,
			FreePageReporting:       n.VMMemory.FreePageReporting,
			MemMerge:                n.VMMemory.PageMerging,
		},
		Nice: n.VMNice,
		// QK_BENCH_BOOT_NODE_CPU: another -cpu for the node's side ("":
		// the default, qemu.DefaultCPUModel).
		CPUModel: os.Getenv("QK_BENCH_BOOT_NODE_CPU"),
	}
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
// QK_BENCH_BOOT_NODE_CPU gives the node's VM another -cpu (e.g. max).
// Reported: both medians (plain-ms, node-ms), x-of-baseline = node median /
// plain median (target 1.05), and QEMU's CPU time to the marker on both
// sides (plain-cpu-ms, node-cpu-ms, cpu-x-of-baseline: the boot as work
// done, which a shared host's load moves less than the wall clock). The
// node's wall time includes its start path (state dir, QMP handshake,
// renice, cont) and console.log's follow.
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
	spec.StateDir = "/STATE" // Start sets the real one
	if err := spec.Validate(); err != nil {
		b.Fatalf("node spec: %v", err)
	}
	b.Logf("node: %s %s", qemu.DefaultQEMUBinary, strings.Join(qemu.Args(spec), " "))
	spec.StateDir = ""
	// Warm-up: binaries, kernel and initrd in the page cache for both.
	plainBoot(b, plain)
	nodeBoot(b, spec)
	b.Logf("load average at the start: %s", loadAvg())
	var ps, ns []boot
	for b.Loop() {
		for r := range rounds {
			if r%2 == 0 {
				ps = append(ps, plainBoot(b, plain))
				ns = append(ns, nodeBoot(b, spec))
			} else {
				ns = append(ns, nodeBoot(b, spec))
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
	nw, nc := wall(ns)
	b.Logf("plain wall %v cpu %v; node wall %v cpu %v", pw, pc, nw, nc)
	b.ReportMetric(ms(medianOf(pw)), "plain-ms")
	b.ReportMetric(ms(medianOf(nw)), "node-ms")
	b.ReportMetric(float64(medianOf(nw))/float64(medianOf(pw)), "x-of-baseline")
	b.ReportMetric(ms(medianOf(pc)), "plain-cpu-ms")
	b.ReportMetric(ms(medianOf(nc)), "node-cpu-ms")
	b.ReportMetric(float64(medianOf(nc))/float64(medianOf(pc)), "cpu-x-of-baseline")
	b.ReportMetric(float64(len(ps)), "rounds")
}
