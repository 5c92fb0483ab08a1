package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
)

// The first second of a pod as its user sees it: `kubectl apply` of a VM
// pod, then `kubectl logs -f` until the guest's boot marker shows.
//
// firstSteps are the pod's timeline (BenchmarkApplyToLogs): the bench's
// clock gives created (the create request returned), bound (a watch saw
// spec.nodeName), running (a watch saw the container Running), logOpen
// (the pods/log?follow=true request through the API server to the node
// answered: its response began), consoleMarker (the marker is in the
// node's console.log) and marker (the marker line arrived on the log
// stream); the node's steps and the status write come from the agent's log,
// as in BenchmarkBurst (burst_timeline_test.go).
var firstSteps = append(append([]string(nil), burstSteps[:len(burstSteps)-1]...),
	"running", "logOpen", "consoleMarker", "marker")

// BenchmarkApplyToLogs: from the create request of a VM pod (the POST
// `kubectl apply` sends for a new pod) through the API server of a real
// control plane (scheduler included) on a qemu-kubelet node (image cached,
// default vmNice) until the guest's boot marker line arrives on a
// `kubectl logs -f` stream: the client opens GET pods/<name>/log?follow=true
// (the request kubectl logs -f makes, through the API server to the node's
// kubelet API) as soon as a watch shows the container Running, as a user
// retrying `kubectl logs -f` at once would; vs a bare qemu-system-x86_64 of
// the same VM (same kernel, initrd and command line, 256 MiB, one vCPU, TCG,
// serial console on stdout) from its exec to the marker on its stdout, and
// vs the plainest qemu-system-x86_64 a user compares with (plainArgs: QEMU's
// defaults, the image's own kernel command line). Each round boots all
// three, in an order that turns with the round, QK_BENCH_FIRST_ROUNDS
// (default 5) rounds per iteration; medians
// (QK_BENCH_FIRST_CONFIG appends node configuration lines;
// QK_BENCH_FIRST_PROBE=1 gives the pod BenchmarkPodReady's HTTP readiness
// probe). Reported:
// x-of-baseline (create -> marker / bare exec -> marker; target 1.10),
// x-of-plain (create -> marker / plain exec -> marker; target 1.05), the
// figures, and the timeline per step (tl-<step>-hop-avg-ms: mean time
// from the step before, over the rounds); the table is in the log.
func BenchmarkApplyToLogs(b *testing.B) {
	rounds := envPositive(b, "QK_BENCH_FIRST_ROUNDS", 5)
	env := newPodBenchEnvWith(b, podBenchOptions{MaxVMs: 4, AgentArgs: []string{"-vmodule=round_trippers=6,timeline=2"},
		ExtraConfig: os.Getenv("QK_BENCH_FIRST_CONFIG")})
	// Warm-up: the first pod pulls the image; every timed pod finds it
	// cached, and the binaries are in the page cache for both sides.
	env.applyToLogs(b, "first-warmup")
	env.bareBootSteps(b)
	env.bootSteps(b, env.plainArgs())

	var bare, plain, pod []time.Duration
	var bareFirst, podFirst, bareCPU, podCPU, plainCPU []time.Duration
	pods := map[string]*burstPod{}
	base := time.Now()
	i := 0
	b.Logf("load average at the start: %s", loadAvg())
	for b.Loop() {
		for r := range rounds {
			var br, pl bareSteps
			var pr applyRun
			runs := []func(){
				func() { br = env.bareBootSteps(b) },
				func() { pr = env.applyToLogs(b, fmt.Sprintf("first-%d", i)) },
				func() { pl = env.bootSteps(b, env.plainArgs()) },
			}
			for k := range runs {
				runs[(k+r)%len(runs)]()
			}
			i++
			plain, plainCPU = append(plain, pl.marker), append(plainCPU, pl.cpu)
			bare = append(bare, br.marker)
			bareFirst = append(bareFirst, br.firstByte)
			bareCPU, podCPU = append(bareCPU, br.cpu), append(podCPU, pr.cpu)
			pod = append(pod, pr.marker)
			if !pr.consoleFirstByte.IsZero() && !pr.at["qemuExec"].IsZero() {
				podFirst = append(podFirst, pr.consoleFirstByte.Sub(pr.at["qemuExec"]))
			}
			// One common origin for the table: each round's steps shifted
			// so that its create request began at base.
			shifted := &burstPod{at: map[string]time.Time{}}
			for s, t := range pr.at {
				shifted.at[s] = base.Add(t.Sub(pr.start))
			}
			pods[pr.name] = shifted
		}
	}
	b.Logf("load average at the end: %s", loadAvg())
	hops := hopsOf(firstSteps, pods, base)
	for _, h := range hops {
		if h.pods < len(pod) {
			b.Errorf("timeline step %s seen for %d of %d pods (missing: %v)", h.step, h.pods, len(pod), h.missing)
		}
		b.ReportMetric(h.meanMs, "tl-"+h.step+"-hop-avg-ms")
	}
	mb, mp := pbMedianDur(bare), pbMedianDur(pod)
	b.ReportMetric(pbMs(mb), "bare-to-marker-ms")
	b.ReportMetric(pbMs(mp), "create-to-logs-marker-ms")
	b.ReportMetric(float64(mp)/float64(mb), "x-of-baseline")
	mpl := pbMedianDur(plain)
	b.ReportMetric(pbMs(mpl), "plain-to-marker-ms")
	b.ReportMetric(float64(mp)/float64(mpl), "x-of-plain")
	b.ReportMetric(pbMs(pbMedianDur(plainCPU)), "plain-qemu-cpu-to-marker-ms")
	b.ReportMetric(pbMs(pbMedianDur(bareFirst)), "bare-first-console-byte-ms")
	if len(podFirst) > 0 {
		b.ReportMetric(pbMs(pbMedianDur(podFirst)), "pod-first-console-byte-after-exec-ms")
	}
	// QEMU's CPU time to the marker: the guest's boot as work done, where
	// the wall clock of a shared host is noise.
	b.ReportMetric(pbMs(pbMedianDur(bareCPU)), "bare-qemu-cpu-to-marker-ms")
	b.ReportMetric(pbMs(pbMedianDur(podCPU)), "pod-qemu-cpu-to-marker-ms")
	b.Logf("rounds=%d bare exec->marker %s (first console byte %s, QEMU CPU %s); plain exec->marker %s (QEMU CPU %s); pod create->marker on kubectl logs -f %s (first console byte after QEMU exec %s, QEMU CPU %s)",
		len(pod), durList(bare), durList(bareFirst), durList(bareCPU), durList(plain), durList(plainCPU), durList(pod), durList(podFirst), durList(podCPU))
	b.Logf("timeline (hop: from the step before, mean over the rounds; last-at: the slowest round, from its create request):\n%s", formatHops(hops))
}

// bareSteps is one bare boot: from exec to the first byte on the serial
// console and to the marker line.
type bareSteps struct{ firstByte, marker, cpu time.Duration }

// bareBootSteps boots the VM of bareBoot and times its first console byte
// and its marker line on QEMU's stdout.
func (e *podBenchEnv) bareBootSteps(b *testing.B) bareSteps {
	b.Helper()
	return e.bootSteps(b, []string{"-machine", "q35,vmport=off", "-accel", "tcg", "-cpu", qemu.DefaultCPUModel(qemu.ArchX86_64, qemu.AccelTCG), "-smp", "1", "-m", "256M",
		"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-device", "pvpanic",
		"-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
		"-kernel", e.kernel, "-initrd", e.initrd, "-append", e.cmdline})
}

// plainArgs is the plainest command line a user boots the test image with
// to compare (issue 42): QEMU's defaults (its CPU model and firmware, no
// sandbox, no QMP), the serial console on stdout, user networking on
// virtio-net, and the image's own kernel command line (without the
// node's emulatedKernelArgs).
func (e *podBenchEnv) plainArgs() []string {
	return []string{"-accel", "tcg", "-M", "q35", "-m", "256", "-smp", "1",
		"-nodefaults", "-nographic", "-serial", "stdio",
		"-kernel", e.kernel, "-initrd", e.initrd, "-append", e.imageCmdline,
		"-nic", "user,model=virtio-net-pci"}
}

// bootSteps execs qemu-system-x86_64 with args (the serial console on
// stdout) and times its first console byte and its marker line.
func (e *podBenchEnv) bootSteps(b *testing.B, args []string) bareSteps {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, "qemu-system-x86_64", args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatalf("start bare QEMU: %v", err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	var s bareSteps
	r := bufio.NewReader(out)
	var line []byte
	for {
		c, err := r.ReadByte()
		if err != nil {
			b.Fatalf("bare QEMU: no boot marker %q on its console: %v", vmtest.BootMarker, err)
		}
		if s.firstByte == 0 {
			s.firstByte = time.Since(start)
		}
		if c != '\n' {
			line = append(line, c)
			continue
		}
		if bytes.Contains(line, []byte(vmtest.BootMarker)) {
			s.marker = time.Since(start)
			s.cpu = procCPU(map[string]int{"qemu": cmd.Process.Pid})["qemu"]
			return s
		}
		line = line[:0]
	}
}

// applyRun is one pod: its timeline (absolute times by step) and the
// create request -> marker on the log stream.
type applyRun struct {
	name             string
	start            time.Time
	at               map[string]time.Time
	consoleFirstByte time.Time
	marker           time.Duration
	// cpu is QEMU's CPU time when the marker was in console.log.
	cpu time.Duration
}

// applyToLogs creates a VM pod, opens its log stream (follow) as soon as a
// watch shows it Running and times the marker line on that stream; then
// deletes the pod and waits until its VM and state are gone (not timed).
func (e *podBenchEnv) applyToLogs(b *testing.B, name string) applyRun {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pods := e.c.Client().CoreV1().Pods("default")
	pod := vmPodSpec(name, e.node, e.ref, corev1.RestartPolicyAlways, nil)
	if os.Getenv("QK_BENCH_FIRST_PROBE") != "" {
		pod = e.probedPod(name) // with the HTTP readiness probe
	}
	w, err := pods.Watch(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("metadata.name", name).String()})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	logFrom := fileSize(e.logPath)

	run := applyRun{name: "default/" + name, at: map[string]time.Time{}}
	var mu sync.Mutex // run.at: the watch (this goroutine), the stream and the console goroutines
	mark := func(step string, t time.Time) {
		mu.Lock()
		if run.at[step].IsZero() {
			run.at[step] = t
		}
		mu.Unlock()
	}
	run.start = time.Now()
	created, err := pods.Create(ctx, pod, metav1.CreateOptions{FieldManager: "kubectl-client-side-apply"})
	if err != nil {
		b.Fatal(err)
	}
	mark("created", time.Now())

	// The node's console.log: when its first byte and the marker land
	// there (the stream's latency is the hop consoleMarker -> marker).
	consoleDone := make(chan struct{})
	go func() {
		defer close(consoleDone)
		path := filepath.Join(e.dir, "state", "vms", string(created.UID), qemu.ConsoleLogName)
		for ctx.Err() == nil {
			if fi, err := os.Stat(path); err == nil && fi.Size() > 0 {
				mu.Lock()
				if run.consoleFirstByte.IsZero() {
					run.consoleFirstByte = time.Now()
				}
				mu.Unlock()
				if bs, _ := os.ReadFile(path); bytes.Contains(bs, []byte(vmtest.BootMarker)) {
					mark("consoleMarker", time.Now())
					if pids := vmtest.QEMUPids(e.dir); len(pids) == 1 {
						cpu := procCPU(map[string]int{"qemu": pids[0]})["qemu"]
						mu.Lock()
						run.cpu = cpu
						mu.Unlock()
					}
					return
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
	}()

	streamErr := make(chan error, 1)
	startStream := func() {
		go func() {
			for {
				rc, err := pods.GetLogs(name, &corev1.PodLogOptions{Container: "vm", Follow: true}).Stream(ctx)
				if err != nil {
					if ctx.Err() == nil && (apierrors.IsBadRequest(err) || apierrors.IsNotFound(err)) {
						// Not running on the node yet: as a user retrying.
						time.Sleep(10 * time.Millisecond)
						continue
					}
					streamErr <- fmt.Errorf("open log stream: %w", err)
					return
				}
				mark("logOpen", time.Now())
				defer rc.Close()
				br := bufio.NewReader(rc)
				for {
					line, err := br.ReadString('\n')
					if strings.Contains(line, vmtest.BootMarker) {
						mark("marker", time.Now())
						streamErr <- nil
						return
					}
					if err != nil {
						streamErr <- fmt.Errorf("log stream ended before the marker: %w", err)
						return
					}
				}
			}
		}()
	}
	streaming := false
	for !streaming {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("pod %s: watch closed before Running", name)
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod {
				continue
			}
			now := time.Now()
			if p.Spec.NodeName != "" {
				mark("bound", now)
			}
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				b.Fatalf("pod %s ended %s: %+v", name, p.Status.Phase, p.Status)
			}
			if len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Running != nil {
				mark("running", now)
				startStream()
				streaming = true
			}
		case <-ctx.Done():
			b.Fatalf("pod %s not Running: %v", name, ctx.Err())
		}
	}
	select {
	case err := <-streamErr:
		if err != nil {
			b.Fatalf("pod %s: %v", name, err)
		}
	case <-ctx.Done():
		b.Fatalf("pod %s: no boot marker on kubectl logs -f: %v", name, ctx.Err())
	}
	<-consoleDone
	mu.Lock()
	run.marker = run.at["marker"].Sub(run.start)
	mu.Unlock()

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
	// The node's steps, from its log (the timeline is logged at the first
	// Ready, long before the delete).
	log, err := os.ReadFile(e.logPath)
	if err != nil {
		b.Fatal(err)
	}
	node := map[string]*burstPod{run.name: {at: run.at}}
	if err := parseNodeTimeline(string(log[min(logFrom, int64(len(log))):]), run.start.Year(), node); err != nil {
		b.Fatalf("timeline of pod %s from the agent's log: %v", name, err)
	}
	return run
}
