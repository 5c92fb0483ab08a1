package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/controller"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/jsfake"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// BenchmarkLeaseFromZero: a Jumpstarter lease on an ExporterSet at zero
// (replicas 0, minAvailable 0; the template's HTTP readiness probe, period
// 1 s), from the Lease's creation until its Ready condition (exporterRef
// set: the set made a pod, the node booted its VM, the probe passed, the
// exporter registered and the controller double assigned the lease), on
// the real control plane with the node agent, the exporterset-controller,
// the jstest controller and jsfake (as BenchmarkJumpstarterLease's "zero");
// the same on a snapshot-warm set (the same template with
// qemu-kubelet.io/start-from-snapshot "true": each lease's new pod is
// restored from the memory snapshot the set's first pod saved before the
// timer, untimed; the benchmark fails if one was booted instead; such pods
// get no generated guest login, api/v1alpha1.StartFromSnapshotAnnotation);
// vs the same guest booted by a bare qemu-system-x86_64 (same kernel,
// initrd and command line, 256 MiB, one vCPU, TCG, guest port 8080
// forwarded) from its exec until an HTTP GET of its readiness port
// answers (tried every 20 ms). Each round takes one of each, alternating
// the order (bare, zero, snap in even rounds, the reverse in odd ones),
// QK_BENCH_LEASE_ROUNDS (default 3) per iteration; medians. Reported:
// x-of-baseline (zero lease -> Ready / bare exec -> port; target 1.15),
// x-of-own-vm (the same against the bare QEMU booting what the lease's VM
// has besides: the exporter pod's defaults, the generated login's NoCloud
// seed disk and the display, built by podspec as the node builds them:
// exporterDefaultsArgs; it boots in each round too),
// snap-x-of-baseline (snapshot-warm lease -> Ready / bare; target 0.3),
// the three figures, and the medians of each set's pod stages after the
// lease's creation (pod created, bound, Ready); the log has each set's
// timeline of steps.
func BenchmarkLeaseFromZero(b *testing.B) {
	rounds := envPositive(b, "QK_BENCH_LEASE_ROUNDS", 3)
	isolateVMCgroup(b)
	e := startExsEnv(b)
	js := e.jumpstarter(b)
	zero, snap := e.jsSet("jslz", 0, 0, js), e.jsSnapSet("jslzs", 0, 0, js)
	e.createSet(b, zero)
	e.createSet(b, snap)
	// The snapshot: the snap set's first pod saves it at its first Ready
	// (untimed; it pulls the image too).
	b.Logf("snapshot: %s", e.makeSnapshot(b, js, snap.Name))
	base := time.Now()
	sides := []*zeroSide{
		{side: "zero", set: zero.Name, labels: zero.Spec.Jumpstarter.ExporterLabels, pods: "app=" + zero.Name,
			tl: map[string]*burstPod{}, base: base, log: e.ctrlLog},
		{side: "snap", set: snap.Name, labels: snap.Spec.Jumpstarter.ExporterLabels, pods: "app=" + snap.Name,
			tl: map[string]*burstPod{}, base: base, log: e.ctrlLog, restored: true},
	}
	bare := newBareGuest(b)
	// Warm-up (untimed): one of each.
	for _, s := range sides {
		e.leaseFromZero(b, js, s)
		clear(s.tl)
	}
	own := exporterDefaultsArgs(b)
	bare.toPort(b)
	bare.toPort(b, own...)

	var bares, owns []time.Duration
	b.Logf("load average at the start: %s", loadAvg())
	for b.Loop() {
		for r := range rounds {
			steps := []func(){
				func() { bares = append(bares, bare.toPort(b)) },
				func() { owns = append(owns, bare.toPort(b, own...)) },
			}
			for _, s := range sides {
				steps = append(steps, func() {
					d, st, _ := e.leaseFromZero(b, js, s)
					s.took, s.stages = append(s.took, d), append(s.stages, st)
				})
			}
			if r%2 == 1 {
				slices.Reverse(steps)
			}
			for _, step := range steps {
				step()
			}
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	mb := pbMedianDur(bares)
	b.ReportMetric(pbMs(mb), "bare-to-port-ms")
	b.Logf("rounds=%d bare exec -> port answers %s", len(bares), durList(bares))
	mo := pbMedianDur(owns)
	b.ReportMetric(pbMs(mo), "own-vm-to-port-ms")
	b.ReportMetric(float64(pbMedianDur(sides[0].took))/float64(mo), "x-of-own-vm")
	b.Logf("rounds=%d bare exec of the exporter pod's own VM (its login's seed disk and display) -> port answers %s", len(owns), durList(owns))
	for _, s := range sides {
		e.reportLeases(b, s, mb)
	}
	b.ReportMetric(float64(pbMedianDur(sides[1].took))/float64(pbMedianDur(sides[0].took)), "snap-x-of-zero")
}

// isolateVMCgroup gives the node of the benchmark's env a VM cgroup parent
// of its own (vmCgroup.parent qemu-kubelet-lz<pid>, appended to
// QK_BENCH_EXS_NODE_CONFIG), removed after the env. With the default parent
// every node and test on the host puts its VMs under one cgroup of one
// weight: while another run's VMs booted there, this node's guest got a
// share of that weight and booted up to 8 times slower than the bare QEMU
// beside it, which measured the host's other tenants, not the node.
func isolateVMCgroup(b *testing.B) {
	b.Helper()
	parent := fmt.Sprintf("qemu-kubelet-lz%d", os.Getpid())
	b.Setenv("QK_BENCH_EXS_NODE_CONFIG", os.Getenv("QK_BENCH_EXS_NODE_CONFIG")+"\nvmCgroup: {parent: "+parent+"}\n")
	b.Cleanup(func() { // after the env's cleanups: its VMs are gone
		hiers, _ := filepath.Glob(filepath.Join(config.DefaultVMCgroupRoot, "*"))
		for _, h := range append(hiers, config.DefaultVMCgroupRoot) {
			dir := filepath.Join(h, parent)
			subs, err := os.ReadDir(dir)
			if err != nil {
				continue // not made in this hierarchy
			}
			for _, s := range subs {
				if s.IsDir() {
					_ = os.Remove(filepath.Join(dir, s.Name())) // a VM's cgroup the node left
				}
			}
			if err := os.Remove(dir); err != nil {
				b.Logf("remove the benchmark's VM cgroup parent: %v", err)
			}
		}
	})
}

// reportLeases reports the leases of side s of BenchmarkLeaseFromZero
// against the bare boot's median mb: the zero side's metrics carry no
// prefix (as before the snap side), the others' their side's.
func (e *exsEnv) reportLeases(b *testing.B, s *zeroSide, mb time.Duration) {
	b.Helper()
	prefix := s.side + "-"
	if s.side == "zero" {
		prefix = ""
	}
	var created, bound, ready []time.Duration
	for _, st := range s.stages {
		created, bound, ready = append(created, st.created), append(bound, st.bound), append(ready, st.ready)
	}
	ml := pbMedianDur(s.took)
	b.ReportMetric(pbMs(ml), prefix+"lease-to-ready-ms")
	b.ReportMetric(float64(ml)/float64(mb), prefix+"x-of-baseline")
	b.ReportMetric(pbMs(pbMedianDur(created)), prefix+"pod-created-ms")
	b.ReportMetric(pbMs(pbMedianDur(bound)), prefix+"pod-bound-ms")
	b.ReportMetric(pbMs(pbMedianDur(ready)), prefix+"pod-ready-ms")
	hops := hopsOf(zeroSteps, s.tl, s.base)
	for _, h := range hops {
		b.ReportMetric(h.meanMs, "tl-"+prefix+h.step+"-hop-avg-ms")
	}
	b.Logf("%s: rounds=%d lease -> Ready %s; pod created %s, bound %s, Ready %s (after the lease's creation); timeline from the lease's creation (hop: from the step before, mean over the rounds; pushed: the probe's first success handed over):\n%s",
		s.side, len(s.took), durList(s.took), durList(created), durList(bound), durList(ready), formatHops(hops))
}

// leaseSteps are the timeline of a lease from zero: the bench's watches
// give podCreated (the set made the pod), bound, ready (the pod's Ready)
// and leaseReady; the node's steps come from the agent's start timeline,
// whose pushed is the probe's first success handed to the library.
var leaseSteps = []string{"podCreated", "bound", "createPod", "admitted", "recorded", "worker", "image", "overlay",
	"qemuExec", "qmpSocket", "qmp", "started", "pushed", "delivered", "ready", "leaseReady"}

// leaseTimeline is the timeline of the lease created at t0 that got the
// exporter of pod exp: the bench's watches give podCreated, bound, ready
// and leaseReady, the node's steps come from the agent's log (-v 2) after
// offset logFrom. The times are shifted from t0 to base, a common origin.
func (e *exsEnv) leaseTimeline(b *testing.B, exp string, logFrom int64, t0 time.Time, ref time.Duration, st podStages, base time.Time) *burstPod {
	b.Helper()
	key := e.ns + "/" + exp
	tl := map[string]*burstPod{key: {at: map[string]time.Time{
		"podCreated": t0.Add(st.created), "bound": t0.Add(st.bound), "ready": t0.Add(st.ready), "leaseReady": t0.Add(ref)}}}
	if log, err := os.ReadFile(e.agentLog); err == nil {
		if err := parseNodeTimeline(string(log[min(logFrom, int64(len(log))):]), t0.Year(), tl); err != nil {
			b.Fatalf("timeline of %s from the agent's log: %v", exp, err)
		}
	}
	shifted := &burstPod{at: map[string]time.Time{}}
	for s, t := range tl[key].at {
		shifted.at[s] = base.Add(t.Sub(t0))
	}
	return shifted
}

// leaseToReady creates lease name selecting labels and returns when it
// was created, the time from then until Ready (exporterRef set), the
// stages of the set's pod (the pods of label selector pods), and the
// exporter it got.
func (e *exsEnv) leaseToReady(b *testing.B, js *jsEnv, labels map[string]string, pods, name string) (time.Time, time.Duration, podStages, string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*vmBoot)
	defer cancel()
	w, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(e.ns).Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		b.Fatalf("watch lease %s: %v", name, err)
	}
	defer w.Stop()
	pw, err := e.c.Client().CoreV1().Pods(e.ns).Watch(ctx, metav1.ListOptions{LabelSelector: pods})
	if err != nil {
		b.Fatalf("watch pods %s: %v", pods, err)
	}
	t0 := js.createLease(b, e.ns, name, labels)
	stages := make(chan podStages, 1)
	go func() { stages <- watchPodStages(pw.ResultChan(), t0) }()
	var l *unstructured.Unstructured
	for ev := range w.ResultChan() {
		if u, ok := ev.Object.(*unstructured.Unstructured); ok && ev.Type != watch.Error && leaseReady(u) {
			l = u
			break
		}
	}
	if l == nil {
		b.Fatalf("lease %s: not Ready within %s", name, 2*vmBoot)
	}
	took := time.Since(t0)
	// The pod's Ready reaches the watch before the lease's: give it a
	// moment, then end the watch.
	time.Sleep(100 * time.Millisecond)
	pw.Stop()
	return t0, took, <-stages, leaseExporter(l)
}

// exporterDefaultsArgs are the QEMU arguments an exporter pod's VM has
// by default besides the bare guest's: the NoCloud seed disk of a
// generated login (podspec.PrepareGuestDisks from the exporter Secret, as
// the node makes it; the test image applies the login at boot) and the
// display (podspec.Translate's decision; QEMU's VNC server on a unix
// socket and a VGA card, as qemu.Spec.Display renders it on x86_64).
func exporterDefaultsArgs(b *testing.B) []string {
	b.Helper()
	dir := b.TempDir()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "own", UID: "uid-own",
			Annotations: map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "bench.invalid/test-image:1"}}},
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "js"}, Data: map[string][]byte{
		v1alpha1.JumpstarterSecretUsername: []byte(v1alpha1.GeneratedGuestLoginUser),
		v1alpha1.JumpstarterSecretPassword: []byte("bench-" + strconv.FormatInt(time.Now().UnixNano(), 36)),
	}}
	plan, rej := podspec.Translate(pod, qemu.ArchX86_64)
	if rej != nil {
		b.Fatal(rej)
	}
	disks, err := podspec.PrepareGuestDisks(context.Background(), dir, pod, podspec.ConfigSources{
		Secret: func(context.Context, string, string) (*corev1.Secret, error) { return secret, nil },
	})
	if err != nil {
		b.Fatal(err)
	}
	if !plan.Display || len(disks) != 1 {
		b.Fatalf("the node gives this exporter pod display %v and %d guest disks; want the display and the login's seed disk", plan.Display, len(disks))
	}
	return []string{"-drive", fmt.Sprintf("file=%s,if=virtio,format=%s,readonly=on", disks[0].Path, disks[0].Format),
		"-vnc", "unix:" + filepath.Join(dir, "vnc.sock"), "-device", "VGA"}
}

// bareGuest boots the test image's ACPI guest by a bare qemu-system-x86_64.
type bareGuest struct{ kernel, initrd, cmdline string }

func newBareGuest(b *testing.B) *bareGuest {
	b.Helper()
	dir := vmtest.BuildTestImages(b)
	cmdline, err := os.ReadFile(filepath.Join(dir, "cmdline"))
	if err != nil {
		b.Fatal(err)
	}
	return &bareGuest{kernel: filepath.Join(dir, "vmlinuz"), initrd: filepath.Join(dir, "initramfs-"+vmtest.VariantACPI+".cpio.gz"),
		// The command line the node gives this image on a TCG node.
		cmdline: podspec.NodeKernelCmdline(qemu.ArchX86_64, qemu.AccelTCG,
			strings.TrimSpace(string(cmdline)), "", config.DefaultEmulatedKernelArgs, config.DefaultFreePageReporting)}
}

// toPort boots the guest with guest port 8080 forwarded (and extra
// arguments) and returns the time from exec until an HTTP GET of it
// answers with a status < 400.
func (g *bareGuest) toPort(b *testing.B, extra ...string) time.Duration {
	b.Helper()
	testutil.SkipIfShort(b, "QEMU")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	port := testutil.FreePort(b)
	start := time.Now()
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", "-machine", "q35,vmport=off", "-accel", "tcg", "-cpu", qemu.DefaultCPUModel(qemu.ArchX86_64, qemu.AccelTCG), "-smp", "1", "-m", "256M",
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "null", "-device", "pvpanic",
		"-netdev", fmt.Sprintf("user,id=net0,hostfwd=tcp:127.0.0.1:%d-:8080", port), "-device", "virtio-net-pci,netdev=net0",
		"-kernel", g.kernel, "-initrd", g.initrd, "-append", g.cmdline)
	cmd.Args = append(cmd.Args, extra...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	if err := cmd.Start(); err != nil {
		b.Fatalf("start bare QEMU: %v", err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	url := fmt.Sprintf("http://127.0.0.1:%d/", port)
	cl := &http.Client{Timeout: 200 * time.Millisecond, Transport: &http.Transport{DisableKeepAlives: true,
		DialContext: (&net.Dialer{Timeout: 200 * time.Millisecond}).DialContext}}
	for ctx.Err() == nil {
		if resp, err := cl.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode < 400 {
				return time.Since(start)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	b.Fatalf("bare guest: port 8080 never answered: %v", ctx.Err())
	return 0
}

// BenchmarkLeaseFromZeroUpstream: a Jumpstarter lease from zero through
// upstream's ExporterSet API (a virtualtarget.jumpstarter.dev set whose
// class names provisioner qemu-kubelet.io, served by the
// exporterset-controller run as Jumpstarter's operator runs a provisioner)
// against the same through our own API (a qemu-kubelet.io ExporterSet of
// our controller on the pod template the upstream set maps to:
// controller.MapUpstream's), in one run on one node, on the stack of
// BenchmarkLeaseFromZero. Both sets wait at zero (minReplicas / replicas
// 0, minAvailable 0, ExitAndReplace / Replace, a 3 s cooldown); the
// upstream set names the test image through its qemuKubelet.image
// parameter, so both pods boot the same image with the same size, ports
// and readiness: none, as upstream's pods carry no probe, so a pod is
// Ready and its exporter registers once its VM runs. The untimed warm-up
// leases once on each side and fails if the two pods differ in any of
// that. Each lease is timed from its creation to its Ready condition
// (exporterRef set), then released once its guest booted; the next waits
// until that VM is gone. Rounds alternate which side goes first (upstream
// in even rounds), QK_BENCH_LEASE_ROUNDS (default 3) per iteration;
// medians. Reported: upstream-x-of-ours (target 1.05), both figures, and
// each side's medians of its pod's stages after the lease's creation
// (created, bound: the set's scheduling gate lifted, Ready).
func BenchmarkLeaseFromZeroUpstream(b *testing.B) {
	rounds := envPositive(b, "QK_BENCH_LEASE_ROUNDS", 3)
	e := startExsEnv(b)
	js := e.jumpstarter(b)
	up, ours := e.zeroPair(b, js)

	// Warm-up (untimed): the first VM pulls the image; both sides' pods
	// must be the same VM.
	_, _, upPod := e.leaseFromZero(b, js, up)
	_, _, ourPod := e.leaseFromZero(b, js, ours)
	if err := samePodShape(upPod, ourPod); err != nil {
		b.Fatalf("the upstream set's pod %s and ours %s: %v", upPod.Name, ourPod.Name, err)
	}
	clear(up.tl)
	clear(ours.tl)

	b.Logf("load average at the start: %s", loadAvg())
	for b.Loop() {
		for r := range rounds {
			order := []*zeroSide{up, ours}
			if r%2 == 1 {
				order = []*zeroSide{ours, up}
			}
			for _, s := range order {
				d, st, _ := e.leaseFromZero(b, js, s)
				s.took, s.stages = append(s.took, d), append(s.stages, st)
			}
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	mu, mo := pbMedianDur(up.took), pbMedianDur(ours.took)
	b.ReportMetric(float64(mu)/float64(mo), "upstream-x-of-ours")
	for _, s := range []*zeroSide{up, ours} {
		var created, bound, ready []time.Duration
		for _, st := range s.stages {
			created, bound, ready = append(created, st.created), append(bound, st.bound), append(ready, st.ready)
		}
		b.ReportMetric(pbMs(pbMedianDur(s.took)), s.side+"-lease-to-ready-ms")
		b.ReportMetric(pbMs(pbMedianDur(created)), s.side+"-pod-created-ms")
		b.ReportMetric(pbMs(pbMedianDur(bound)), s.side+"-pod-bound-ms")
		b.ReportMetric(pbMs(pbMedianDur(ready)), s.side+"-pod-ready-ms")
		b.Logf("%s: rounds=%d lease -> Ready %s; pod created %s, bound %s, Ready %s (after the lease's creation); timeline (hop: from the step before, mean over the rounds):\n%s",
			s.side, len(s.took), durList(s.took), durList(created), durList(bound), durList(ready), formatHops(hopsOf(zeroSteps, s.tl, s.base)))
	}
}

// zeroSide is one side of BenchmarkLeaseFromZeroUpstream: a set at zero
// and the leases made on it. The benchmark's goroutine owns it.
type zeroSide struct {
	side   string               // "upstream" or "ours": the metrics' prefix
	set    string               // the set's name; its cold Exporter is <set>-cold
	labels map[string]string    // what a lease selects (the set's Exporter labels)
	pods   string               // the label selector of the set's pods
	n      int                  // leases made so far (their names: <set>-<n>)
	took   []time.Duration      // the timed leases: creation -> Ready
	stages []podStages          // their pods' stages
	tl     map[string]*burstPod // their timelines by lease, shifted to base
	base   time.Time
	log    string // the log of the set's controller (-v 2)
	// restored: the set's pods start from a memory snapshot; a lease
	// whose pod booted instead fails the benchmark.
	restored bool
}

// zeroPair creates, on the env's node, the upstream set upz of class qkz
// (the test image through qemuKubelet.image, 1 vCPU and 256Mi by the
// template's Qemu driver, guest port 8080 by its hostfwd) served by the
// provisioner, and our set ozz on the pod template upz maps to; both at
// zero, each with its cold Exporter.
func (e *exsEnv) zeroPair(b *testing.B, js *jsEnv) (*zeroSide, *zeroSide) {
	b.Helper()
	ctx := context.Background()
	e.installUpstreamAPI(b, js)
	class := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "qkz"}, Spec: vtv1.VirtualTargetClassSpec{
		Provisioner: vtv1.DefaultProvisioner,
		Scheduling: &vtv1.SchedulingSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": e.node},
			Tolerations:  []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
			Resources: &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"),
				corev1.ResourceMemory: resource.MustParse("64Mi")}},
		},
		Parameters: &apiextv1.JSON{Raw: []byte(`{"resources":{"cpu":"1","memory":"256Mi"}}`)}}}
	labels := map[string]string{"board": "qemu-upz"}
	set := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Namespace: e.ns, Name: "upz"}, Spec: vtv1.ExporterSetSpec{
		MinReplicas: 0, MaxReplicas: ptr.To[int32](2), RecycleStrategy: vtv1.RecycleStrategyExitAndReplace,
		ScaleDownCooldown: &metav1.Duration{Duration: 3 * time.Second}, VirtualTargetClassName: class.Name,
		Parameters: &apiextv1.JSON{Raw: fmt.Appendf(nil, `{"qemuKubelet":{"image":%q}}`, e.image)},
		Selector:   metav1.LabelSelector{MatchLabels: labels},
		Template: vtv1.ExporterSetTemplate{Metadata: vtv1.TemplateMetadata{Labels: labels}, Spec: vtv1.ExporterTemplateSpec{Drivers: []vtv1.DriverConfig{
			{Name: "qemu", Type: controller.DriverTypeQemu, Config: &apiextv1.JSON{Raw: []byte(`{"smp":1,"mem":"256M","hostfwd":{"http":{"guestport":8080}}}`)}},
			{Name: "power", Type: controller.DriverTypeQemuPower},
			{Name: "console", Type: controller.DriverTypeQemuSerial},
			{Name: "flasher", Type: controller.DriverTypeQemuFlasher},
		}}}}}
	mapped, cerr := controller.MapUpstream(set, class, controller.DefaultDrainDelay)
	if cerr != nil {
		b.Fatalf("map the upstream set %s: %s: %s", set.Name, cerr.Reason, cerr.Message)
	}
	for _, o := range []client.Object{class, set} {
		if err := e.cl.Create(ctx, o); err != nil {
			b.Fatalf("create %s: %v", o.GetName(), err)
		}
	}
	provLog := e.runProvisioner(b, set.Name)

	own := e.jsSet("ozz", 0, 0, js)
	t := *mapped.Template.DeepCopy()
	t.Labels = own.Spec.Template.Labels // app=ozz, its selector's
	own.Spec.Template = t
	e.createSet(b, own)
	base := time.Now()
	up := &zeroSide{side: "upstream", set: set.Name, labels: labels, pods: controller.UpstreamLabel + "=" + set.Name,
		tl: map[string]*burstPod{}, base: base, log: provLog}
	ours := &zeroSide{side: "ours", set: own.Name, labels: own.Spec.Jumpstarter.ExporterLabels, pods: "app=" + own.Name,
		tl: map[string]*burstPod{}, base: base, log: e.ctrlLog}
	return up, ours
}

// leaseFromZero leases from s's set at zero (once its cold Exporter is
// there: a lease on a set without one ends Unsatisfiable), then releases
// the lease once the guest booted and waits until the VM is gone and the
// set has no pod. It returns the time from the lease's creation to its
// Ready condition, the stages of the pod and the pod as the lease found it.
func (e *exsEnv) leaseFromZero(b *testing.B, js *jsEnv, s *zeroSide) (time.Duration, podStages, corev1.Pod) {
	b.Helper()
	ctx := context.Background()
	s.n++
	name := fmt.Sprintf("%s-%d", s.set, s.n)
	e.waitCold(b, js, s)
	logFrom, ctrlFrom := fileSize(e.agentLog), fileSize(s.log)
	t0, took, st, exp := e.leaseToReady(b, js, s.labels, s.pods, name)
	pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(ctx, exp, metav1.GetOptions{})
	if err != nil {
		b.Fatalf("lease %s: exporter %s is no pod: %v", name, exp, err)
	}
	s.tl[name] = e.leaseTimeline(b, exp, logFrom, t0, took, st, s.base)
	if log, err := os.ReadFile(s.log); err == nil {
		at, err := gateLiftedAt(string(log[min(ctrlFrom, int64(len(log))):]), t0.Year(), exp)
		if err != nil {
			b.Fatalf("lease %s: the controller's log %s: %v", name, s.log, err)
		}
		if !at.IsZero() {
			s.tl[name].at["gateLifted"] = s.base.Add(at.Sub(t0))
		}
	}
	if s.restored {
		// A restored guest prints no boot (its console log starts empty).
		e.waitPodEvent(b, exp, "Started", "restored from a memory snapshot", 30*time.Second)
	} else if err := wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, vmBoot, true, func(context.Context) (bool, error) {
		// Without a readiness probe the guest may still boot. Let it,
		// so the release's ACPI power-off ends it at once.
		return e.booted(*pod), nil
	}); err != nil {
		b.Fatalf("lease %s: the guest of pod %s printed no boot marker within %s", name, pod.Name, vmBoot)
	}
	js.release(b, e.ns, name)
	js.waitLease(b, e.ns, name, 30*time.Second, "ended", leaseEnded)
	e.waitVMGone(b, *pod, 2*time.Minute)
	err = wait.PollUntilContextTimeout(ctx, 250*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := e.c.Client().CoreV1().Pods(e.ns).List(ctx, metav1.ListOptions{LabelSelector: s.pods})
		return err == nil && len(l.Items) == 0, nil
	})
	if err != nil {
		b.Fatalf("set %s: pods still there 2m after lease %s ended", s.set, name)
	}
	return took, st, *pod
}

// waitCold waits until s's set has its cold Exporter carrying the labels
// its leases select.
func (e *exsEnv) waitCold(b *testing.B, js *jsEnv, s *zeroSide) {
	b.Helper()
	require.Eventually(b, func() bool {
		x, err := js.dyn.Resource(jsfake.ExporterGVR).Namespace(e.ns).Get(context.Background(), s.set+"-cold", metav1.GetOptions{})
		if err != nil {
			return false
		}
		for k, v := range s.labels {
			if x.GetLabels()[k] != v {
				return false
			}
		}
		return true
	}, time.Minute, 200*time.Millisecond, "set %s: its cold Exporter %s-cold carrying %v", s.set, s.set, s.labels)
}

// zeroSteps are leaseSteps with gateLifted, from the set's controller's
// log: its exporter Secret written and the pod's scheduling gate removed.
var zeroSteps = slices.Insert(slices.Clone(leaseSteps), 1, "gateLifted")

// gateLiftedRe is the controller's line (V(1)) of a pod's gate removed.
var gateLiftedRe = regexp.MustCompile(`^[IWE](\d{4} \d{2}:\d{2}:\d{2}\.\d{6}) .*"exporter secret written; scheduling gate removed" .*\bpod="([^"]+)"`)

// gateLiftedAt finds in a controller's log when it removed pod's
// scheduling gate (zero: no such line). year is the lease's (klog's
// header has none); klog writes local time.
func gateLiftedAt(log string, year int, pod string) (time.Time, error) {
	for _, line := range strings.Split(log, "\n") {
		m := gateLiftedRe.FindStringSubmatch(line)
		if m == nil || m[2] != pod {
			continue
		}
		t, err := time.ParseInLocation("0102 15:04:05.000000", m[1], time.Local)
		if err != nil {
			return time.Time{}, fmt.Errorf("klog time %q: %w", m[1], err)
		}
		return t.AddDate(year, 0, 0), nil
	}
	return time.Time{}, nil
}

// samePodShape reports where the VM pods a and b differ in what their
// boot and readiness depend on: the VM container's image, resources,
// ports and probes, the scheduling, the grace period and the pod
// annotations a template gives the node.
func samePodShape(a, b corev1.Pod) error {
	if len(a.Spec.Containers) != 1 || len(b.Spec.Containers) != 1 {
		return fmt.Errorf("not one container each: %d and %d", len(a.Spec.Containers), len(b.Spec.Containers))
	}
	ca, cb := a.Spec.Containers[0], b.Spec.Containers[0]
	for _, f := range []struct {
		what string
		x, y any
	}{
		{"image", ca.Image, cb.Image},
		{"resources", ca.Resources, cb.Resources},
		{"ports", ca.Ports, cb.Ports},
		{"readiness probe", ca.ReadinessProbe, cb.ReadinessProbe},
		{"startup probe", ca.StartupProbe, cb.StartupProbe},
		{"liveness probe", ca.LivenessProbe, cb.LivenessProbe},
		{"node selector", a.Spec.NodeSelector, b.Spec.NodeSelector},
		{"tolerations", a.Spec.Tolerations, b.Spec.Tolerations},
		{"restart policy", a.Spec.RestartPolicy, b.Spec.RestartPolicy},
		{"grace period", a.Spec.TerminationGracePeriodSeconds, b.Spec.TerminationGracePeriodSeconds},
		{"annotation " + v1alpha1.LeaseStatePolicyAnnotation, a.Annotations[v1alpha1.LeaseStatePolicyAnnotation], b.Annotations[v1alpha1.LeaseStatePolicyAnnotation]},
		{"annotation " + podspec.AnnotationStartFromSnapshot, a.Annotations[podspec.AnnotationStartFromSnapshot], b.Annotations[podspec.AnnotationStartFromSnapshot]},
	} {
		if !equality.Semantic.DeepEqual(f.x, f.y) {
			return fmt.Errorf("they differ in %s: %+v against %+v", f.what, f.x, f.y)
		}
	}
	return nil
}

// TestSamePodShape: BenchmarkLeaseFromZeroUpstream's fairness check finds
// each difference that changes a VM's boot or readiness and names it;
// quantities compare by value, and what a set writes per pod (its name,
// labels, the exporter Secret) does not count.
func TestSamePodShape(t *testing.T) {
	q := resource.MustParse
	base := corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "upz-abc", Labels: map[string]string{controller.UpstreamLabel: "upz"},
			Annotations: map[string]string{v1alpha1.LeaseStatePolicyAnnotation: string(v1alpha1.LeaseStatePolicyKeep),
				v1alpha1.JumpstarterSecretAnnotation: "exporter-config-upz-abc"}},
		Spec: corev1.PodSpec{
			NodeSelector: map[string]string{"kubernetes.io/hostname": "qk-exs"},
			Tolerations:  []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu"}},
			Containers: []corev1.Container{{Name: "vm", Image: "reg/test:acpi",
				Ports:     []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}},
				Resources: corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceCPU: q("1"), corev1.ResourceMemory: q("256Mi")}}}},
		},
	}
	same := base.DeepCopy()
	same.Name, same.Labels = "ozz-xyz", map[string]string{"app": "ozz"}
	same.Annotations[v1alpha1.JumpstarterSecretAnnotation] = "ozz-xyz-exporter"
	same.Spec.Containers[0].Resources.Limits[corev1.ResourceCPU] = q("1000m")
	require.NoError(t, samePodShape(base, *same))

	for what, change := range map[string]func(*corev1.Pod){
		"image":           func(p *corev1.Pod) { p.Spec.Containers[0].Image = "emptydisk" },
		"resources":       func(p *corev1.Pod) { p.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory] = q("512Mi") },
		"ports":           func(p *corev1.Pod) { p.Spec.Containers[0].Ports = nil },
		"readiness probe": func(p *corev1.Pod) { p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{PeriodSeconds: 1} },
		"node selector":   func(p *corev1.Pod) { p.Spec.NodeSelector = map[string]string{"type": "virtual-kubelet"} },
		"tolerations":     func(p *corev1.Pod) { p.Spec.Tolerations = nil },
		"grace period":    func(p *corev1.Pod) { p.Spec.TerminationGracePeriodSeconds = ptr.To[int64](10) },
		"annotation " + v1alpha1.LeaseStatePolicyAnnotation: func(p *corev1.Pod) { delete(p.Annotations, v1alpha1.LeaseStatePolicyAnnotation) },
		"not one container each":                            func(p *corev1.Pod) { p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "side"}) },
	} {
		p := base.DeepCopy()
		change(p)
		err := samePodShape(base, *p)
		require.Error(t, err, what)
		require.Contains(t, err.Error(), what)
	}
}

// TestGateLiftedAt: the gate's line of the pod asked for, in local time of
// the given year; another pod's line and other lines are skipped; no line
// is the zero time.
func TestGateLiftedAt(t *testing.T) {
	log := `I1128 20:17:12.100000   10657 jumpstarter.go:322] "exporter secret written; scheduling gate removed" logger="upstream" pod="upz-b"
I1128 20:17:12.200000   10657 upstream.go:99] "Reconciling" pod="upz-a"
I1128 20:17:12.345678   10657 jumpstarter.go:322] "exporter secret written; scheduling gate removed" logger="upstream" controller="exporterset" pod="upz-a"
`
	at, err := gateLiftedAt(log, 2026, "upz-a")
	require.NoError(t, err)
	require.Equal(t, time.Date(2026, 11, 28, 20, 17, 12, 345678000, time.Local), at)
	at, err = gateLiftedAt(log, 2026, "upz-c")
	require.NoError(t, err)
	require.True(t, at.IsZero(), "no line of upz-c: %s", at)
}
