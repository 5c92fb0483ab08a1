package e2e

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
)

// podBenchPairs is how many (bare QEMU, pod) pairs one benchmark iteration
// times; the figures are medians over all pairs.
const podBenchPairs = 3

// BenchmarkPodReady: a pod created through the API server of a real control
// plane (scheduler included) to Ready on a qemu-kubelet node, image cached,
// vs a bare qemu-system-x86_64 start of the same VM (same kernel, initrd,
// cmdline, 1 vCPU, 256 MiB, TCG) to the same boot marker, alternating, in
// the same run. The pod has an HTTP readiness probe on the guest (period
// 1 s), so Ready means booted. x-of-baseline = median create->Ready /
// median bare->marker; marker-x-of-baseline uses create->boot marker on the
// pod's console. The phase breakdown: schedule (Create call -> the binding
// seen by a watch: creationTimestamp and the PodScheduled condition only
// have second resolution), and pull / overlay / qemu_start / boot from the
// node's qemu_kubelet_vm_start_phase_duration_seconds histogram (deltas of
// _sum around each pod).
func BenchmarkPodReady(b *testing.B) {
	env := newPodBenchEnv(b)
	// Warm-up: the first pod pulls the image; every timed pod finds it cached.
	env.podRun(b, "bench-warmup")

	var bare, ready, marker []time.Duration
	phases := map[string][]float64{}
	i := 0
	for b.Loop() {
		for range podBenchPairs {
			bare = append(bare, env.bareBoot(b))
			r := env.podRun(b, fmt.Sprintf("bench-%d", i))
			i++
			ready = append(ready, r.ready)
			marker = append(marker, r.marker)
			phases["schedule"] = append(phases["schedule"], pbMs(r.scheduled))
			for ph, d := range r.phases {
				phases[ph] = append(phases[ph], d*1000)
			}
		}
	}
	mb, mr, mm := pbMedianDur(bare), pbMedianDur(ready), pbMedianDur(marker)
	b.ReportMetric(pbMs(mb), "bare-to-marker-ms")
	b.ReportMetric(pbMs(mr), "create-to-ready-ms")
	b.ReportMetric(pbMs(mm), "create-to-marker-ms")
	b.ReportMetric(float64(mr)/float64(mb), "x-of-baseline")
	b.ReportMetric(float64(mm)/float64(mb), "marker-x-of-baseline")
	for _, ph := range []string{"schedule", telemetry.PhasePull, telemetry.PhaseOverlay, telemetry.PhaseQEMUStart, telemetry.PhaseBoot} {
		v := phases[ph]
		if len(v) != len(ready) {
			b.Fatalf("phase %s measured for %d of %d pods: %v", ph, len(v), len(ready), v)
		}
		b.ReportMetric(pbMedianF(v), "phase-"+ph+"-ms")
	}
	b.Logf("pairs=%d bare=%v ready=%v marker=%v phases(ms)=%v", len(bare), bare, ready, marker, phases)
}

// BenchmarkTenPodsReady: 10 VM pods created at once through the API server
// on one node (image cached, HTTP readiness probe) until all are Ready;
// baseline in the same run: one pod alone, create -> Ready.
// x-of-baseline = all-Ready time / single pod's (10 guests booting on the
// host's CPUs at once: the ideal on 2 CPUs is about 5x).
func BenchmarkTenPodsReady(b *testing.B) {
	env := newPodBenchEnv(b)
	env.podRun(b, "ten-warmup")
	var single, all []time.Duration
	i := 0
	for b.Loop() {
		single = append(single, env.podRun(b, fmt.Sprintf("single-%d", i)).ready)
		all = append(all, env.tenPods(b, i))
		i++
	}
	ms, ma := pbMedianDur(single), pbMedianDur(all)
	b.ReportMetric(pbMs(ms), "single-ready-ms")
	b.ReportMetric(pbMs(ma), "all-10-ready-ms")
	b.ReportMetric(float64(ma)/float64(ms), "x-of-baseline")
}

// tenPods creates 10 probed VM pods at once and returns the time from the
// first Create call to all of them Ready; then deletes them (not timed).
func (e *podBenchEnv) tenPods(b *testing.B, round int) time.Duration {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	pods := e.c.Client().CoreV1().Pods("default")
	sel := fmt.Sprintf("bench-ten=r%d", round)
	w, err := pods.Watch(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	start := time.Now()
	errs := make(chan error, 10)
	for j := range 10 {
		p := e.probedPod(fmt.Sprintf("ten-%d-%d", round, j))
		p.Labels = map[string]string{"bench-ten": fmt.Sprintf("r%d", round)}
		go func() {
			_, err := pods.Create(ctx, p, metav1.CreateOptions{})
			errs <- err
		}()
	}
	for range 10 {
		if err := <-errs; err != nil {
			b.Fatal(err)
		}
	}
	ready := map[string]bool{}
	var took time.Duration
	for len(ready) < 10 {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("watch closed with %d of 10 Ready", len(ready))
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod {
				continue
			}
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				b.Fatalf("pod %s ended %s: %+v", p.Name, p.Status.Phase, p.Status)
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && !ready[p.Name] {
					ready[p.Name] = true
					took = time.Since(start)
				}
			}
		case <-ctx.Done():
			b.Fatalf("%d of 10 pods Ready: %v", len(ready), ctx.Err())
		}
	}
	if n := len(vmtest.QEMUPids(e.dir)); n != 10 {
		b.Fatalf("%d QEMU processes for 10 Ready pods", n)
	}
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: sel}); err != nil {
		b.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 3*time.Minute, true, func(ctx context.Context) (bool, error) {
		l, err := pods.List(ctx, metav1.ListOptions{LabelSelector: sel})
		return err == nil && len(l.Items) == 0 && len(vmtest.QEMUPids(e.dir)) == 0, nil
	})
	if err != nil {
		b.Fatalf("10 pods not gone after delete: %v", err)
	}
	return took
}

// probedPod is the benchmarks' VM pod: the ACPI test image with an HTTP
// readiness probe on the guest (period 1 s), so Ready means booted.
func (e *podBenchEnv) probedPod(name string) *corev1.Pod {
	pod := vmPodSpec(name, e.node, e.ref, corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Ports = []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}
	pod.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromString("http")}},
		PeriodSeconds: 1, TimeoutSeconds: 1, FailureThreshold: 3,
	}
	return pod
}

func pbMs(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func pbMedianDur(d []time.Duration) time.Duration {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}

func pbMedianF(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// podBenchEnv is a control plane, a registry with the test images and one
// qemu-kubelet node serving /metrics.
type podBenchEnv struct {
	c          *cluster.Cluster
	node       string
	dir        string
	ref        string
	metricsURL string
	logPath    string // the agent's log
	agentPid   int
	kernel     string
	initrd     string
	cmdline    string
	// imageCmdline is the image's own kernel command line (its cmdline
	// file), without what the node adds.
	imageCmdline string
}

func newPodBenchEnv(b *testing.B) *podBenchEnv {
	b.Helper()
	return newPodBenchEnvWith(b, podBenchOptions{MaxVMs: 12})
}

// podBenchOptions vary the benchmarks' node.
type podBenchOptions struct {
	MaxVMs int
	// ExtraConfig is appended to the node configuration (YAML lines).
	ExtraConfig string
	// AgentArgs are extra qemu-kubelet flags.
	AgentArgs []string
}

func newPodBenchEnvWith(b *testing.B, o podBenchOptions) *podBenchEnv {
	b.Helper()
	root, err := cluster.RepoRoot()
	if err != nil {
		b.Fatal(err)
	}
	bin := filepath.Join(b.TempDir(), "qemu-kubelet")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/qemu-kubelet")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("build qemu-kubelet: %v\n%s", err, out)
	}
	c := cluster.StartT(b, cluster.Options{})
	reg := ocitest.StartRegistry(b, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(b, reg.Addr)
	imgDir := vmtest.BuildTestImages(b)
	cmdline, err := os.ReadFile(filepath.Join(imgDir, "cmdline"))
	if err != nil {
		b.Fatal(err)
	}
	e := &podBenchEnv{c: c, node: "qk-bench", dir: testutil.Searchable(b, b.TempDir()), ref: refs[vmtest.VariantACPI],
		kernel: filepath.Join(imgDir, "vmlinuz"), initrd: filepath.Join(imgDir, "initramfs-"+vmtest.VariantACPI+".cpio.gz"),
		imageCmdline: strings.TrimSpace(string(cmdline)),
		// The command line the node gives this image on a TCG node.
		cmdline: podspec.NodeKernelCmdline(qemu.ArchX86_64, qemu.AccelTCG,
			strings.TrimSpace(string(cmdline)), "", config.DefaultEmulatedKernelArgs, config.DefaultFreePageReporting)}
	vmtest.ReapQEMU(b, e.dir)
	ip := benchHostIP(b)
	kc, err := c.NodeKubeconfig(e.node)
	if err != nil {
		b.Fatal(err)
	}
	port, mport := benchFreePort(b), benchFreePort(b)
	cfg := fmt.Sprintf(`apiVersion: qemu-kubelet.io/v1alpha1
kind: NodeConfiguration
nodeName: %s
nodeIP: %s
stateDir: %s
maxVMs: %d
reserved: {cpu: 100m, memory: 256Mi, ephemeral-storage: 1Gi}
accelerator: {policy: tcg, probeTimeout: 20s}
server: {address: %s, port: %d, clientCAFile: %s}
nodeStatusUpdateFrequency: 2s
nodeLeaseDurationSeconds: 12
`, e.node, ip, filepath.Join(e.dir, "state"), o.MaxVMs, ip, port, c.CAFile()) + o.ExtraConfig
	cfgPath := filepath.Join(e.dir, "node.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		b.Fatal(err)
	}
	logf, err := os.Create(filepath.Join(e.dir, "qemu-kubelet.log"))
	if err != nil {
		b.Fatal(err)
	}
	e.metricsURL = fmt.Sprintf("http://127.0.0.1:%d/metrics", mport)
	e.logPath = logf.Name()
	agent := exec.Command(bin, append([]string{"--config", cfgPath, "--kubeconfig", kc, "-v", "1", fmt.Sprintf("--metrics-bind-address=127.0.0.1:%d", mport)}, o.AgentArgs...)...)
	agent.Stdout, agent.Stderr = logf, logf
	agent.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := agent.Start(); err != nil {
		b.Fatalf("start qemu-kubelet: %v", err)
	}
	e.agentPid = agent.Process.Pid
	// Cleanups run LIFO: pods are deleted (VMs stopped) before the agent
	// is killed.
	b.Cleanup(func() {
		_ = syscall.Kill(-agent.Process.Pid, syscall.SIGKILL)
		_ = agent.Wait()
		logf.Close()
		if b.Failed() {
			out, _ := os.ReadFile(logf.Name())
			b.Logf("qemu-kubelet log (tail):\n%s", tail(string(out), 40))
		}
	})
	b.Cleanup(func() {
		ctx := context.Background()
		_ = c.Client().CoreV1().Pods("default").DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{})
		_ = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
			l, err := c.Client().CoreV1().Pods("default").List(ctx, metav1.ListOptions{})
			return err == nil && len(l.Items) == 0 && len(vmtest.QEMUPids(e.dir)) == 0, nil
		})
	})
	err = wait.PollUntilContextTimeout(context.Background(), 250*time.Millisecond, 90*time.Second, true, func(ctx context.Context) (bool, error) {
		n, err := c.Client().CoreV1().Nodes().Get(ctx, e.node, metav1.GetOptions{})
		return err == nil && readyAndSettled(n), nil
	})
	if err != nil {
		b.Fatalf("node %s not Ready: %v", e.node, err)
	}
	return e
}

// bareBoot starts the same VM from a bare qemu-system command line with the
// serial console on stdout and returns the time to the boot marker.
func (e *podBenchEnv) bareBoot(b *testing.B) time.Duration {
	b.Helper()
	return testutil.BareBoot(b, "qemu-system-x86_64", vmtest.BootMarker,
		"-machine", "q35,vmport=off", "-accel", "tcg", "-cpu", qemu.DefaultCPUModel(qemu.ArchX86_64, qemu.AccelTCG), "-smp", "1", "-m", "256M",
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-device", "pvpanic",
		"-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
		"-kernel", e.kernel, "-initrd", e.initrd, "-append", e.cmdline)
}

// podTiming is one pod's start, measured from the Create call.
type podTiming struct {
	scheduled, ready, marker time.Duration
	phases                   map[string]float64 // seconds, from the node's histogram
}

// podRun creates a VM pod with an HTTP readiness probe, times it to Ready
// and to the boot marker, then deletes it and waits until its VM and state
// are gone (not timed).
func (e *podBenchEnv) podRun(b *testing.B, name string) podTiming {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pods := e.c.Client().CoreV1().Pods("default")
	pod := e.probedPod(name)
	before := benchPhaseSums(b, e.metricsURL)
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()

	start := time.Now()
	created, err := pods.Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		b.Fatal(err)
	}
	markerAt := make(chan time.Duration, 1)
	go func() {
		console := filepath.Join(e.dir, "state", "vms", string(created.UID), qemu.ConsoleLogName)
		for ctx.Err() == nil {
			if bs, _ := os.ReadFile(console); strings.Contains(string(bs), vmtest.BootMarker) {
				markerAt <- time.Since(start)
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	var r podTiming
	for r.ready == 0 {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("pod %s: watch closed before Ready", name)
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod {
				continue
			}
			if r.scheduled == 0 && p.Spec.NodeName != "" {
				r.scheduled = time.Since(start)
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
					r.ready = time.Since(start)
				}
			}
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				b.Fatalf("pod %s ended %s: %+v", name, p.Status.Phase, p.Status)
			}
		case <-ctx.Done():
			b.Fatalf("pod %s not Ready: %v", name, ctx.Err())
		}
	}
	select {
	case r.marker = <-markerAt:
	case <-ctx.Done():
		b.Fatalf("pod %s: no boot marker on its console", name)
	}
	after := benchPhaseSums(b, e.metricsURL)
	r.phases = map[string]float64{}
	for ph, s := range after {
		if d := s - before[ph]; d > 0 {
			r.phases[ph] = d
		}
	}

	if err := pods.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
		b.Fatal(err)
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := pods.Get(ctx, name, metav1.GetOptions{})
		_, serr := os.Stat(filepath.Join(e.dir, "state", "vms", string(created.UID)))
		return apierrors.IsNotFound(err) && os.IsNotExist(serr), nil
	})
	if err != nil {
		b.Fatalf("pod %s: not gone after delete: %v", name, err)
	}
	return r
}

// benchPhaseSums scrapes the node's /metrics and returns the _sum of
// qemu_kubelet_vm_start_phase_duration_seconds by phase.
func benchPhaseSums(b *testing.B, url string) map[string]float64 {
	b.Helper()
	fams := benchScrape(b, url)
	out := map[string]float64{}
	for _, m := range fams[telemetry.MetricVMStartPhaseSeconds].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "phase" {
				out[l.GetValue()] += m.GetHistogram().GetSampleSum()
			}
		}
	}
	return out
}

// benchGauge is the value of an unlabelled gauge on the node's /metrics.
func benchGauge(b *testing.B, url, name string) float64 {
	b.Helper()
	ms := benchScrape(b, url)[name].GetMetric()
	if len(ms) != 1 {
		b.Fatalf("metric %s: %d samples, want 1", name, len(ms))
	}
	return ms[0].GetGauge().GetValue()
}

// benchScrape reads the node's /metrics (retrying for up to 10 s).
func benchScrape(b *testing.B, url string) map[string]*dto.MetricFamily {
	b.Helper()
	var fams map[string]*dto.MetricFamily
	err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
		resp, err := http.Get(url)
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return false, nil
		}
		parser := expfmt.NewTextParser(model.UTF8Validation)
		fams, err = parser.TextToMetricFamilies(resp.Body)
		return true, err
	})
	if err != nil {
		b.Fatalf("scrape %s: %v", url, err)
	}
	return fams
}

func benchHostIP(b *testing.B) string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		b.Fatal(err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
			return ipn.IP.String()
		}
	}
	b.Fatal("no non-loopback IPv4 address: the API server does not proxy to loopback kubelets")
	return ""
}

func benchFreePort(b *testing.B) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
