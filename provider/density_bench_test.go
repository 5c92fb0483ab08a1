package provider

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// densityNodes are the node configurations BenchmarkIdlePodDensity can
// compare, each a node configuration file's fields (YAML) over an empty
// file: "stock" is a node with an empty configuration file (its
// defaults: the figure of issue #42), the others change one default.
// Each node's QEMUs get transparent huge pages as the agent decides for a
// TCG node (DecideTHP, SetProcessTHP: this process sets the flag while
// its pods start).
var densityNodes = []struct {
	name, file string
}{
	{"stock", ""},
	// Without free page reporting: what that default returns of an idle
	// guest's RAM.
	{"fpr-off", "vmMemory:\n  freePageReporting: false\n"},
	// A 16 MiB translation buffer: what the buffer costs (and its boot's
	// CPU, marker-s).
	{"tb16", "vmMemory:\n  tcgTranslationBuffer: 16Mi\n"},
	// Transparent huge pages left to the kernel (the stock node disables
	// them under TCG): what they cost in host memory (QEMU asks for huge
	// pages for the guest's RAM and the translation buffer; khugepaged
	// collapses the 2 MiB ranges free page reporting split).
	{"thp-enabled", "vmMemory:\n  transparentHugePages: Enabled\n"},
	// Free page reporting orders (the node's default is 0,
	// podspec.FreePageReportingArg; 9, the guest's pageblock of 2 MiB, is
	// Linux's own): a finer order returns the guest's freed memory in
	// smaller free blocks too, at the cost of more reports. Through
	// emulatedKernelArgs, which the node adds before its own order, so
	// theirs wins.
	{"fpr-o0", fprOrderFile(0)},
	{"fpr-o3", fprOrderFile(3)},
	{"fpr-o5", fprOrderFile(5)},
	{"fpr-o9", fprOrderFile(9)},
	// The guest's kernel without zeroing every page it allocates
	// (init_on_alloc=0; Debian's kernels zero by default,
	// CONFIG_INIT_ON_ALLOC_DEFAULT_ON): what that hardening costs an idle
	// guest's RAM and its boot's CPU. Measured only: the node does not
	// turn a guest's hardening off.
	{"init-on-alloc-0", emulatedArgsFile(initOnAllocOffArg)},
}

// initOnAllocOffArg turns off the guest kernel's zeroing of allocated
// pages.
const initOnAllocOffArg = "init_on_alloc=0"

// fprOrderFile is a node configuration file whose emulatedKernelArgs are
// the defaults and page_reporting.page_reporting_order=order.
func fprOrderFile(order int) string {
	return emulatedArgsFile(fprOrderArg(order))
}

// emulatedArgsFile is a node configuration file whose emulatedKernelArgs
// are the defaults and arg.
func emulatedArgsFile(arg string) string {
	f := "emulatedKernelArgs:\n"
	for _, a := range append(append([]string(nil), config.DefaultEmulatedKernelArgs...), arg) {
		f += "  - " + a + "\n"
	}
	return f
}

// fprOrderArg is the kernel argument of free page reporting order order.
func fprOrderArg(order int) string {
	return "page_reporting.page_reporting_order=" + strconv.Itoa(order)
}

// BenchmarkIdlePodDensity: what an idle VM pod costs the host on a stock
// node (issue #42), and where each VM's memory goes. For each node
// configuration of QK_BENCH_DENSITY_NODES (comma-separated names of
// densityNodes; default stock), in that order in the same run, N
// test-image pods (QK_BENCH_DENSITY_N, default 4; acpi variant, 1 vCPU,
// the pod's memory limit QK_BENCH_DENSITY_MEM MiB, default 256 as
// config/samples' pods) are created through a provider configured as
// cmd/qemu-kubelet configures one from that file (config.Resolve's
// defaults: vmMemory, vmCgroup's CPU placement, vmNice, vmUser, the
// emulated kernel arguments, the CPU models), TCG, KSM left as the host
// has it (off unless someone started it). Each boots to its marker; then
// all idle QK_BENCH_DENSITY_IDLE seconds (default 30) and each QEMU is
// measured. At most QK_BENCH_DENSITY_PARALLEL pods (default 8) start at
// once, and none while the host's MemAvailable is under
// QK_BENCH_DENSITY_FLOOR_MIB (default 2048; waiting QK_BENCH_DENSITY_PACE_S
// seconds in all at most, default 600: then vms < N). Each configuration
// runs for each kernel of the test image in QK_BENCH_DENSITY_KERNELS
// (comma-separated, vmtest.KernelDebian and KernelMinimal; default
// debian), its metrics' prefix the configuration's name with "-minimal"
// for the minimal kernel. Metrics, prefixed with that name, per VM (mean):
//   - host-MiB/vm: drop of the host's MemAvailable from before the first
//     pod to the end of the idle window (noisy on a shared machine);
//   - rss-, pss-, anon-MiB/vm: QEMU's resident, proportional and anonymous
//     memory (/proc/PID/smaps summed);
//   - <part>-rss-MiB/vm and <part>-pss-MiB/vm for each part of
//     testutil.MemParts (guest-ram: the guest pages touched; tcg-buffer:
//     the translation buffer; kernel-initrd: QEMU's copy of the image's
//     kernel and its mapping of the initrd; heap: QEMU's heap, malloc
//     arenas and other anonymous memory; files: the QEMU binary and
//     shared libraries), and pagetables-MiB/vm (VmPTE);
//   - guest-reserved-MiB/vm: the guest's RAM outside its MemTotal,
//     guest-used-MiB/vm: MemTotal - MemFree (the guest's /proc/meminfo,
//     read through an exec after QEMU's memory): guest-ram beyond their
//     sum is memory the guest touched and freed; guest-fpr-order: the
//     guests' free page reporting order in force (mean; each in the log);
//   - qemu-cpu-%/vm: each idle QEMU's CPU over the window (a share of one
//     CPU); host-cpu-busy-%: the host's CPU busy over the window (all
//     CPUs; meaningless on a machine shared with other work);
//   - marker-s: first create to the last boot marker; boot-cpu-s/vm: each
//     QEMU's CPU time when its marker was seen (a boot's cost, less
//     sensitive to other load than marker-s); vms and paced-s.
func BenchmarkIdlePodDensity(b *testing.B) {
	n := testutil.EnvInt("QK_BENCH_DENSITY_N", 4)
	idle := time.Duration(testutil.EnvInt("QK_BENCH_DENSITY_IDLE", 30)) * time.Second
	names := strings.Split(os.Getenv("QK_BENCH_DENSITY_NODES"), ",")
	if os.Getenv("QK_BENCH_DENSITY_NODES") == "" {
		names = []string{"stock"}
	}
	kernels := strings.Split(os.Getenv("QK_BENCH_DENSITY_KERNELS"), ",")
	if os.Getenv("QK_BENCH_DENSITY_KERNELS") == "" {
		kernels = []string{vmtest.KernelDebian}
	}
	env := newVMEnv(b)
	var nodes []*densityEnv
	for _, kernel := range kernels {
		img := newDensityImage(b, env, strings.TrimSpace(kernel))
		for _, name := range names {
			nodes = append(nodes, img.node(b, strings.TrimSpace(name), n, testutil.EnvInt("QK_BENCH_DENSITY_MEM", 256)))
		}
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, e := range nodes {
			r, err := e.run(b, fmt.Sprintf("%s-%d", e.name, i), n, idle)
			if err != nil {
				b.Fatalf("%s: %v", e.name, err)
			}
			r.report(b, e.name)
		}
	}
	b.ReportMetric(float64(n), "N")
}

// densityImage is the test image with one kernel in a registry and cached
// in a store.
type densityImage struct {
	env *vmEnv
	// kernel is the image's kernel (vmtest.KernelDebian, KernelMinimal);
	// suffix is appended to the names of its nodes' metrics ("" for
	// Debian's, as before there was a choice).
	kernel, suffix string
	ref            string
	blobs          []testutil.Blob
}

func newDensityImage(b *testing.B, env *vmEnv, kernel string) *densityImage {
	// Each kernel's image is pushed under its own tag: env.refs are the
	// environment's (QK_TESTIMAGE_KERNEL), which need not be Debian's.
	suffix := ""
	switch kernel {
	case vmtest.KernelDebian:
	case vmtest.KernelMinimal:
		suffix = "-" + kernel
	default:
		b.Fatalf("QK_BENCH_DENSITY_KERNELS: %q is not %s or %s", kernel, vmtest.KernelDebian, vmtest.KernelMinimal)
	}
	ref := vmtest.PushKernelVariant(b, env.reg.Addr, kernel, vmtest.VariantACPI)
	img, err := env.store.Pull(context.Background(), ref, oci.PullOptions{})
	if err != nil {
		b.Fatal(err)
	}
	blobs, err := testutil.BlobsOf(img.Kernel, img.Initrd)
	if err != nil {
		b.Fatal(err)
	}
	b.Logf("image %s: kernel %s (%d bytes), initrd %d bytes", ref, kernel, blobs[0].Bytes, blobs[1].Bytes)
	return &densityImage{env: env, kernel: kernel, suffix: suffix, ref: ref, blobs: blobs}
}

// stockNode resolves the node configuration file of densityNodes' entry
// name as cmd/qemu-kubelet does (its defaults for what the file leaves
// out), with stateDir as its state dir.
func stockNode(name, stateDir string) (*config.Node, error) {
	for _, d := range densityNodes {
		if d.name != name {
			continue
		}
		file, err := config.Decode([]byte("apiVersion: " + config.APIVersion + "\nkind: " + config.Kind + "\n" + d.file))
		if err != nil {
			return nil, fmt.Errorf("node configuration %s: %w", name, err)
		}
		file.NodeName, file.StateDir = "n1", stateDir
		return config.Resolve(file, config.Environment{Hostname: "n1", HostIP: "10.1.2.3", AgentUID: uint32(os.Geteuid()), AgentGID: uint32(os.Getegid())})
	}
	return nil, fmt.Errorf("no node configuration %q in densityNodes", name)
}

// densityEnv is a provider configured as a node from one of densityNodes.
type densityEnv struct {
	name      string
	h         *harness
	stateDir  string
	ref       string
	memoryMiB int
	blobs     []testutil.Blob
	// thp is the agent's decision for the node's transparent huge pages
	// under TCG.
	thp THPDecision
}

// node is a provider configured as cmd/qemu-kubelet's newVMs configures
// one from densityNodes' entry name, with a state dir of its own.
func (img *densityImage) node(b *testing.B, name string, n, memoryMiB int) *densityEnv {
	stateDir := filepath.Join(img.env.root, "state-"+name+img.suffix)
	node, err := stockNode(name, stateDir)
	if err != nil {
		b.Fatal(err)
	}
	thp := DecideTHP(node.VMMemory.TransparentHugePages, []qemu.Accelerator{qemu.AccelTCG})
	vm := VMSettingsOf(node)
	if vm.VMUser != nil {
		// What the agent does at start for its vmUser (cmd/qemu-kubelet
		// vmUserSearch).
		testutil.Searchable(b, img.env.root)
		vmUserDirs(b, stateDir)
	}
	b.Logf("node %s, image's kernel %s: N=%d, guest %d MiB, %+v, vmUser %+v, emulated kernel args %q, CPU placement: %s; transparent huge pages disabled %v: %s",
		name, img.kernel, n, memoryMiB, node.VMMemory, node.VMUser, node.EmulatedKernelArgs, vm.Placement.Why, thp.Disable, thp.Why)
	h := newHarnessWith(b, stateDir, img.env.store, img.env.imageDir, func(c *VMsConfig) {
		vm.Apply(c)
		// Room for N pods: density is measured, not admission.
		c.Allocatable = func() corev1.ResourceList {
			return podtest.RL("cpu", strconv.Itoa(n), "memory", strconv.Itoa(n*(memoryMiB+512))+"Mi", "pods", strconv.Itoa(n))
		}
	})
	return &densityEnv{name: name + img.suffix, h: h, stateDir: stateDir, ref: img.ref, memoryMiB: memoryMiB, blobs: img.blobs, thp: thp}
}

// densityPod is one pod of a density run and its QEMU.
type densityPod struct {
	pod *corev1.Pod
	dir string
	pid int
	// bootCPU is QEMU's CPU time once the marker was seen (polled every
	// 200 ms); cpu0 at the start of the idle window.
	bootCPU, cpu0 time.Duration
}

// run starts n pods (bounded, paced on MemAvailable), waits for their
// markers, idles and measures; the pods are deleted before it returns.
func (e *densityEnv) run(b *testing.B, prefix string, n int, idle time.Duration) (*densityResult, error) {
	availBefore, err := testutil.MemAvailable()
	if err != nil {
		return nil, err
	}
	// As the agent at its start; cleared after, for the next node.
	if err := SetProcessTHP(e.thp.Disable); err != nil {
		return nil, err
	}
	start := time.Now()
	pods, paced, err := e.startPods(b, prefix, n)
	if err := SetProcessTHP(false); err != nil {
		return nil, err
	}
	defer e.deletePods(b, pods)
	if err != nil {
		return nil, err
	}
	r := &densityResult{vms: len(pods), pacedS: paced.Seconds(), markerS: time.Since(start).Seconds(), parts: map[string]testutil.MemUse{}}
	for _, p := range pods {
		if p.cpu0, err = procCPUTime(p.pid); err != nil {
			return nil, err
		}
		r.bootCPUS += p.bootCPU.Seconds()
	}
	cpu0, err := testutil.HostCPUTimes()
	if err != nil {
		return nil, err
	}
	t0 := time.Now()
	time.Sleep(idle)
	cpu1, err := testutil.HostCPUTimes()
	if err != nil {
		return nil, err
	}
	wall := time.Since(t0)
	r.hostBusyPct = cpu1.BusyPercentSince(cpu0)
	hints := testutil.MemHints{GuestRAMBytes: int64(e.memoryMiB) << 20, Blobs: e.blobs}
	for _, p := range pods {
		cpu, err := procCPUTime(p.pid)
		if err != nil {
			return nil, err
		}
		r.qemuCPUPct += (cpu - p.cpu0).Seconds() / wall.Seconds() * 100
		m, err := testutil.ReadQEMUMemory(p.pid, hints)
		if err != nil {
			return nil, fmt.Errorf("pod %s: %w", p.pod.Name, err)
		}
		for part, u := range m.Parts {
			s := r.parts[part]
			s.RSS, s.PSS, s.Anon = s.RSS+u.RSS, s.PSS+u.PSS, s.Anon+u.Anon
			r.parts[part] = s
		}
		r.pageTables += m.PageTableBytes
	}
	// The guest's side of its RAM, read after QEMU's (an exec touches
	// guest memory).
	for _, p := range pods {
		g, err := e.guestMemory(p)
		if err != nil {
			return nil, err
		}
		r.guestReserved += int64(e.memoryMiB)<<20 - g.total
		r.guestUsed += g.total - g.free
		r.guestFPROrders = append(r.guestFPROrders, g.fprOrder)
	}
	availAfter, err := testutil.MemAvailable()
	if err != nil {
		return nil, err
	}
	r.hostBytes = availBefore - availAfter
	return r, nil
}

// startPods creates n pods, at most QK_BENCH_DENSITY_PARALLEL booting at
// once and none while MemAvailable is under the floor, and waits for each
// to run and print its boot marker. It returns the pods that started
// (fewer than n when the floor held, logged) and how long starts waited
// for memory.
func (e *densityEnv) startPods(b *testing.B, prefix string, n int) ([]*densityPod, time.Duration, error) {
	parallel := testutil.EnvInt("QK_BENCH_DENSITY_PARALLEL", 8)
	floor := int64(testutil.EnvInt("QK_BENCH_DENSITY_FLOOR_MIB", 2048)) << 20
	maxPace := time.Duration(testutil.EnvInt("QK_BENCH_DENSITY_PACE_S", 600)) * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+time.Duration(n)*30*time.Second)
	defer cancel()
	sem := make(chan struct{}, parallel)
	pods := make([]*densityPod, 0, n)
	errs := make([]error, n)
	var paced time.Duration
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		sem <- struct{}{}
		avail, err := testutil.AwaitMemory(ctx, floor, maxPace-paced)
		paced += avail.Waited
		if err != nil {
			<-sem
			errs[i] = err
			break
		}
		if avail.Bytes < floor {
			<-sem
			b.Logf("limit reached after %d pods: host MemAvailable %d MiB under the floor of %d MiB after waiting %.0f s for it to come back", i, avail.Bytes>>20, floor>>20, paced.Seconds())
			break
		}
		uid := fmt.Sprintf("%s-%d", prefix, i)
		p := &densityPod{pod: densityPodFor(uid, e.ref, e.memoryMiB), dir: filepath.Join(e.stateDir, VMsDirName, uid)}
		pods = append(pods, p)
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			defer func() { <-sem }()
			errs[i] = e.bootPod(ctx, p)
		}(i)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			return pods, paced, fmt.Errorf("pod %d: %w", i, err)
		}
	}
	if len(pods) == 0 {
		return nil, paced, fmt.Errorf("no pod started: host MemAvailable under the floor of %d MiB", floor>>20)
	}
	return pods, paced, nil
}

// densityPodFor is podFor with the guest's memory as the pod's limit.
func densityPodFor(uid, ref string, memoryMiB int) *corev1.Pod {
	pod := podFor(uid, ref, corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory] = *resource.NewQuantity(int64(memoryMiB)<<20, resource.BinarySI)
	return pod
}

// bootPod creates p through the provider and waits until its status says
// Running, its console shows the boot marker and its one QEMU is found.
func (e *densityEnv) bootPod(ctx context.Context, p *densityPod) error {
	if err := e.h.vms.CreatePod(ctx, p.pod); err != nil {
		return err
	}
	for {
		e.h.mu.Lock()
		last := e.h.last[p.pod.UID]
		e.h.mu.Unlock()
		console, _ := os.ReadFile(filepath.Join(p.dir, qemu.ConsoleLogName))
		if last != nil && running(last) && strings.Contains(string(console), vmtest.BootMarker) {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("waiting for Running and the boot marker: %w; statuses seen %v; console:\n%s", ctx.Err(), e.h.seenTags(p.pod.UID), console)
		}
		time.Sleep(200 * time.Millisecond)
	}
	// dir/ : QEMUPids matches a substring, and pod n-1's dir is a prefix
	// of pod n-10's.
	pids := vmtest.QEMUPids(p.dir + "/")
	if len(pids) != 1 {
		return fmt.Errorf("QEMUs of %s: %v, want one", p.dir, pids)
	}
	p.pid = pids[0]
	var err error
	if p.bootCPU, err = procCPUTime(p.pid); err != nil {
		return err
	}
	if err := e.checkTHP(p.pid); err != nil {
		return err
	}
	return e.checkSpec(p)
}

// checkTHP holds QEMU's transparent huge pages (THP_enabled of
// /proc/PID/status) to the node's decision.
func (e *densityEnv) checkTHP(pid int) error {
	status, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return err
	}
	on, err := processTHPEnabled(string(status))
	if err != nil {
		return fmt.Errorf("QEMU %d: %w", pid, err)
	}
	if on == e.thp.Disable {
		return fmt.Errorf("QEMU %d: THP_enabled %v, the node (%s) decided disabled %v", pid, on, e.name, e.thp.Disable)
	}
	return nil
}

// checkSpec holds the VM's recorded spec to the run's assumptions: the
// guest's RAM is the pod's limit and the image's kernel and initrd are
// what QEMU loads (the breakdown's hints).
func (e *densityEnv) checkSpec(p *densityPod) error {
	raw, err := os.ReadFile(filepath.Join(p.dir, qemu.SpecFileName))
	if err != nil {
		return err
	}
	var s qemu.Spec
	if err := json.Unmarshal(raw, &s); err != nil {
		return fmt.Errorf("%s: %w", qemu.SpecFileName, err)
	}
	if s.MemoryMiB != e.memoryMiB || s.Kernel != e.blobs[0].Path || s.Initrd != e.blobs[1].Path {
		return fmt.Errorf("VM spec of %s: memory %d MiB, kernel %s, initrd %s; the benchmark expects %d MiB, %s, %s", p.pod.Name, s.MemoryMiB, s.Kernel, s.Initrd, e.memoryMiB, e.blobs[0].Path, e.blobs[1].Path)
	}
	return nil
}

// deletePods deletes the pods and waits until their state dirs are gone.
func (e *densityEnv) deletePods(b *testing.B, pods []*densityPod) {
	for _, p := range pods {
		if err := e.h.vms.DeletePod(context.Background(), deleting(p.pod)); err != nil {
			b.Errorf("delete %s: %v", p.pod.Name, err)
		}
	}
	for _, p := range pods {
		waitGoneDir(b, p.dir, 3*time.Minute)
	}
}

// guestMeminfo is the guest's own view of its RAM (/proc/meminfo) and
// the free page reporting order in force in it.
type guestMeminfo struct{ total, free, fprOrder int64 }

// guestFPROrderFile is where Linux shows its free page reporting order.
const guestFPROrderFile = "/sys/module/page_reporting/parameters/page_reporting_order"

// guestMemory reads MemTotal and MemFree of the pod's guest and its free
// page reporting order through an exec (the guest agent).
func (e *densityEnv) guestMemory(p *densityPod) (guestMeminfo, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out execIO
	var err error
	if err = e.h.vms.RunInContainer(ctx, p.pod.Namespace, p.pod.Name, "vm", []string{"cat", "/proc/meminfo", guestFPROrderFile}, &out); err != nil {
		return guestMeminfo{}, fmt.Errorf("pod %s: guest /proc/meminfo: %w (stderr %q)", p.pod.Name, err, out.stderr.String())
	}
	g := guestMeminfo{fprOrder: -1}
	for _, l := range strings.Split(out.stdout.String(), "\n") {
		f := strings.Fields(l)
		if len(f) == 1 {
			// The order file's one line: the only line of one field.
			if g.fprOrder, err = strconv.ParseInt(f[0], 10, 64); err != nil {
				return guestMeminfo{}, fmt.Errorf("pod %s: guest %s: %q: %w", p.pod.Name, guestFPROrderFile, l, err)
			}
			continue
		}
		if len(f) < 2 || (f[0] != "MemTotal:" && f[0] != "MemFree:") {
			continue
		}
		v, err := strconv.ParseInt(f[1], 10, 64)
		if err != nil {
			return guestMeminfo{}, fmt.Errorf("pod %s: guest /proc/meminfo: %q: %w", p.pod.Name, l, err)
		}
		if f[0] == "MemTotal:" {
			g.total = v << 10
		} else {
			g.free = v << 10
		}
	}
	if g.total == 0 || g.free == 0 || g.fprOrder < 0 {
		return guestMeminfo{}, fmt.Errorf("pod %s: guest /proc/meminfo without MemTotal or MemFree, or no %s:\n%s", p.pod.Name, guestFPROrderFile, out.stdout.String())
	}
	return g, nil
}

// procCPUTime is the CPU time (user + system) of process pid.
func procCPUTime(pid int) (time.Duration, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("CPU time of QEMU %d: %w", pid, err)
	}
	s := string(stat)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0, fmt.Errorf("CPU time of QEMU %d: /proc/%d/stat has %d fields after the name", pid, pid, len(f))
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("CPU time of QEMU %d: utime %q, stime %q", pid, f[11], f[12])
	}
	// USER_HZ is 100 on Linux.
	return time.Duration(ut+st) * 10 * time.Millisecond, nil
}

// densityResult sums a density run over its VMs.
type densityResult struct {
	vms                   int
	hostBytes, pageTables int64
	// guestReserved: the guest's RAM outside its MemTotal (its kernel's
	// code and data, memory map, firmware tables); guestUsed: MemTotal -
	// MemFree as the guest sees it.
	guestReserved, guestUsed int64
	// guestFPROrders: each guest's free page reporting order in force.
	guestFPROrders                           []int64
	parts                                    map[string]testutil.MemUse
	hostBusyPct, qemuCPUPct, markerS, pacedS float64
	// bootCPUS sums each QEMU's CPU seconds to its boot marker.
	bootCPUS float64
}

func (r *densityResult) report(b *testing.B, name string) {
	perVM := func(v int64) float64 { return float64(v) / (1 << 20) / float64(r.vms) }
	var total testutil.MemUse
	var parts []string
	for _, p := range testutil.MemParts {
		u := r.parts[p]
		total.RSS, total.PSS, total.Anon = total.RSS+u.RSS, total.PSS+u.PSS, total.Anon+u.Anon
		b.ReportMetric(perVM(u.RSS), name+"-"+p+"-rss-MiB/vm")
		b.ReportMetric(perVM(u.PSS), name+"-"+p+"-pss-MiB/vm")
		parts = append(parts, fmt.Sprintf("%s %.1f / %.1f", p, perVM(u.RSS), perVM(u.PSS)))
	}
	b.ReportMetric(perVM(r.pageTables), name+"-pagetables-MiB/vm")
	b.ReportMetric(perVM(r.guestReserved), name+"-guest-reserved-MiB/vm")
	b.ReportMetric(perVM(r.guestUsed), name+"-guest-used-MiB/vm")
	var orders int64
	for _, o := range r.guestFPROrders {
		orders += o
	}
	b.ReportMetric(float64(orders)/float64(len(r.guestFPROrders)), name+"-guest-fpr-order")
	b.ReportMetric(perVM(r.hostBytes), name+"-host-MiB/vm")
	b.ReportMetric(perVM(total.RSS), name+"-rss-MiB/vm")
	b.ReportMetric(perVM(total.PSS), name+"-pss-MiB/vm")
	b.ReportMetric(perVM(total.Anon), name+"-anon-MiB/vm")
	b.ReportMetric(r.hostBusyPct, name+"-host-cpu-busy-%")
	b.ReportMetric(r.qemuCPUPct/float64(r.vms), name+"-qemu-cpu-%/vm")
	b.ReportMetric(r.markerS, name+"-marker-s")
	b.ReportMetric(r.bootCPUS/float64(r.vms), name+"-boot-cpu-s/vm")
	b.ReportMetric(r.pacedS, name+"-paced-s")
	b.ReportMetric(float64(r.vms), name+"-vms")
	b.Logf("%s, %d VMs: host %.1f MiB/vm; QEMU RSS %.1f, PSS %.1f, anon %.1f MiB/vm; RSS / PSS by part (MiB/vm): %s; page tables %.2f; the guest's view of its RAM: %.1f MiB outside MemTotal, %.1f used (MemTotal - MemFree), free page reporting orders %v; host CPU busy %.1f%%, QEMU %.2f%% of a CPU per VM; all at marker %.1f s, QEMU CPU to its marker %.2f s per VM",
		name, r.vms, perVM(r.hostBytes), perVM(total.RSS), perVM(total.PSS), perVM(total.Anon), strings.Join(parts, ", "),
		perVM(r.pageTables), perVM(r.guestReserved), perVM(r.guestUsed), r.guestFPROrders, r.hostBusyPct, r.qemuCPUPct/float64(r.vms), r.markerS, r.bootCPUS/float64(r.vms))
}

// TestDensityNodes: each node configuration BenchmarkIdlePodDensity
// compares resolves, "stock" is the defaults of an empty file and every
// other changes only what its name says; a name not listed is an error.
func TestDensityNodes(t *testing.T) {
	stock, err := stockNode("stock", "/var/lib/qk-bench")
	if err != nil {
		t.Fatal(err)
	}
	empty, err := config.Resolve(&config.NodeConfiguration{APIVersion: config.APIVersion, Kind: config.Kind, NodeName: "n1", StateDir: "/var/lib/qk-bench"},
		config.Environment{Hostname: "n1", HostIP: "10.1.2.3", AgentUID: uint32(os.Geteuid()), AgentGID: uint32(os.Getegid())})
	if err != nil {
		t.Fatal(err)
	}
	if stock.VMMemory != empty.VMMemory || stock.VMCgroup != empty.VMCgroup || stock.VMNice != empty.VMNice || stock.VMUser != empty.VMUser {
		t.Errorf("stock node %+v %+v nice %d user %+v, want an empty file's %+v %+v nice %d user %+v",
			stock.VMMemory, stock.VMCgroup, stock.VMNice, stock.VMUser, empty.VMMemory, empty.VMCgroup, empty.VMNice, empty.VMUser)
	}
	want := map[string]func(m *config.VMMemoryConfig){
		"thp-enabled":     func(m *config.VMMemoryConfig) { m.TransparentHugePages = config.THPEnabled },
		"fpr-off":         func(m *config.VMMemoryConfig) { m.FreePageReporting = false },
		"tb16":            func(m *config.VMMemoryConfig) { m.TCGTranslationBufferMiB = 16 },
		"fpr-o0":          nil,
		"fpr-o3":          nil,
		"fpr-o5":          nil,
		"fpr-o9":          nil,
		"init-on-alloc-0": nil,
	}
	// The variants of one kernel argument (the free page reporting
	// orders, init_on_alloc): the stock node's emulated kernel arguments
	// and that one.
	wantArgs := map[string]string{"fpr-o0": "page_reporting.page_reporting_order=0", "fpr-o3": "page_reporting.page_reporting_order=3",
		"fpr-o5": "page_reporting.page_reporting_order=5", "fpr-o9": "page_reporting.page_reporting_order=9",
		"init-on-alloc-0": "init_on_alloc=0"}
	for _, d := range densityNodes[1:] {
		n, err := stockNode(d.name, "/var/lib/qk-bench")
		if err != nil {
			t.Fatalf("%s: %v", d.name, err)
		}
		args := stock.EmulatedKernelArgs
		if a, ok := wantArgs[d.name]; ok {
			args = append(append([]string(nil), stock.EmulatedKernelArgs...), a)
		}
		if !reflect.DeepEqual(n.EmulatedKernelArgs, args) {
			t.Errorf("%s: emulatedKernelArgs %q, want %q", d.name, n.EmulatedKernelArgs, args)
		}
		m := stock.VMMemory
		change, ok := want[d.name]
		if !ok {
			t.Fatalf("%s: no expectation in this test", d.name)
		}
		if change == nil {
			if n.VMMemory != m {
				t.Errorf("%s: vmMemory %+v, want the stock node's %+v", d.name, n.VMMemory, m)
			}
			continue
		}
		change(&m)
		if n.VMMemory != m || m == stock.VMMemory {
			t.Errorf("%s: vmMemory %+v, want %+v (the stock node's %+v, one field changed)", d.name, n.VMMemory, m, stock.VMMemory)
		}
	}
	// Under TCG the stock node's QEMUs run without transparent huge
	// pages, thp-enabled's with the kernel's.
	thpOn, err := stockNode("thp-enabled", "/var/lib/qk-bench")
	if err != nil {
		t.Fatal(err)
	}
	tcg := []qemu.Accelerator{qemu.AccelTCG}
	if !DecideTHP(stock.VMMemory.TransparentHugePages, tcg).Disable || DecideTHP(thpOn.VMMemory.TransparentHugePages, tcg).Disable {
		t.Errorf("transparent huge pages under TCG: stock %s, thp-enabled %s; want disabled on stock only",
			stock.VMMemory.TransparentHugePages, thpOn.VMMemory.TransparentHugePages)
	}
	if _, err := stockNode("nope", "/var/lib/qk-bench"); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("unknown node configuration: error %v, want one naming it", err)
	}
}
