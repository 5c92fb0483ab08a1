package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
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
// vs the same guest booted by a bare qemu-system-x86_64 (same kernel,
// initrd and command line, 256 MiB, one vCPU, TCG, guest port 8080
// forwarded) from its exec until an HTTP GET of its readiness port
// answers (tried every 20 ms). Rounds alternate (bare first in even
// rounds), QK_BENCH_LEASE_ROUNDS (default 3) per iteration; medians.
// Reported: x-of-baseline (lease -> Ready / bare exec -> port; target
// 1.15), both figures, and the medians of the pod's stages after the
// lease's creation (pod created, bound, Ready).
func BenchmarkLeaseFromZero(b *testing.B) {
	rounds := envPositive(b, "QK_BENCH_LEASE_ROUNDS", 3)
	e := startExsEnv(b)
	js := e.jumpstarter(b)
	set := e.jsSet("jslz", 0, 0, js)
	e.createSet(b, set)
	e.waitColdExporter(b, js, set)
	bare := newBareGuest(b)

	n := 0
	pods := map[string]*burstPod{} // the timelines, shifted to a common origin
	base := time.Now()
	lease := func() (time.Duration, podStages) {
		n++
		name := fmt.Sprintf("lz-%d", n)
		logFrom := fileSize(e.agentLog)
		t0, ref, st, exp := e.leaseToReady(b, js, set.Spec.Jumpstarter.ExporterLabels, set.Name, name)
		pod, err := e.c.Client().CoreV1().Pods(e.ns).Get(context.Background(), exp, metav1.GetOptions{})
		if err != nil {
			b.Fatalf("lease %s: exporter %s is no pod: %v", name, exp, err)
		}
		// The node's steps of the pod's start, from the agent's log (-v 2).
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
		pods[name] = shifted
		js.release(b, e.ns, name)
		js.waitLease(b, e.ns, name, 30*time.Second, "ended", leaseEnded)
		e.waitVMGone(b, *pod, 2*time.Minute)
		e.waitSet(b, set.Name, 2*time.Minute, "no VM", func(_ *v1alpha1.ExporterSet, pods []corev1.Pod) bool { return len(pods) == 0 })
		return ref, st
	}
	// Warm-up (untimed): the first VM pulls the image.
	lease()
	bare.toPort(b)
	clear(pods)

	var leases, bares, created, bound, ready []time.Duration
	b.Logf("load average at the start: %s", loadAvg())
	for b.Loop() {
		for r := range rounds {
			var l, p time.Duration
			var st podStages
			if r%2 == 0 {
				p = bare.toPort(b)
				l, st = lease()
			} else {
				l, st = lease()
				p = bare.toPort(b)
			}
			leases, bares = append(leases, l), append(bares, p)
			created, bound, ready = append(created, st.created), append(bound, st.bound), append(ready, st.ready)
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	ml, mb := pbMedianDur(leases), pbMedianDur(bares)
	b.ReportMetric(pbMs(ml), "lease-to-ready-ms")
	b.ReportMetric(pbMs(mb), "bare-to-port-ms")
	b.ReportMetric(float64(ml)/float64(mb), "x-of-baseline")
	b.ReportMetric(pbMs(pbMedianDur(created)), "pod-created-ms")
	b.ReportMetric(pbMs(pbMedianDur(bound)), "pod-bound-ms")
	b.ReportMetric(pbMs(pbMedianDur(ready)), "pod-ready-ms")
	hops := hopsOf(leaseSteps, pods, base)
	for _, h := range hops {
		b.ReportMetric(h.meanMs, "tl-"+h.step+"-hop-avg-ms")
	}
	b.Logf("timeline from the lease's creation (hop: from the step before, mean over the rounds; pushed: the probe's first success handed over):\n%s", formatHops(hops))
	b.Logf("rounds=%d lease -> Ready %s; bare exec -> port answers %s; pod created %s, bound %s, Ready %s (after the lease's creation)",
		len(leases), durList(leases), durList(bares), durList(created), durList(bound), durList(ready))
}

// leaseSteps are the timeline of a lease from zero: the bench's watches
// give podCreated (the set made the pod), bound, ready (the pod's Ready)
// and leaseReady; the node's steps come from the agent's start timeline,
// whose pushed is the probe's first success handed to the library.
var leaseSteps = []string{"podCreated", "bound", "createPod", "admitted", "recorded", "worker", "image", "overlay",
	"qemuExec", "qmpSocket", "qmp", "started", "pushed", "delivered", "ready", "leaseReady"}

// leaseToReady creates lease name selecting labels and returns when it
// was created, the time from then until Ready (exporterRef set), the
// stages of the set's pod, and the exporter it got.
func (e *exsEnv) leaseToReady(b *testing.B, js *jsEnv, labels map[string]string, set, name string) (time.Time, time.Duration, podStages, string) {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*vmBoot)
	defer cancel()
	w, err := js.dyn.Resource(jsfake.LeaseGVR).Namespace(e.ns).Watch(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		b.Fatalf("watch lease %s: %v", name, err)
	}
	defer w.Stop()
	pw, err := e.c.Client().CoreV1().Pods(e.ns).Watch(ctx, metav1.ListOptions{LabelSelector: "app=" + set})
	if err != nil {
		b.Fatalf("watch pods of %s: %v", set, err)
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
		cmdline: podspec.EmulatedKernelCmdline(qemu.ArchX86_64, qemu.AccelTCG,
			podspec.KernelCmdline(qemu.ArchX86_64, strings.TrimSpace(string(cmdline)), ""), config.DefaultEmulatedKernelArgs)}
}

// toPort boots the guest with guest port 8080 forwarded and returns the
// time from exec until an HTTP GET of it answers with a status < 400.
func (g *bareGuest) toPort(b *testing.B) time.Duration {
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
