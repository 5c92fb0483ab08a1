package e2e

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	watchtools "k8s.io/client-go/tools/watch"
)

// burstSizes are the burst sizes of BenchmarkBurst: 30 and 60 (issue #20)
// and 10 for the density and create->Ready curve (issue #16).
var burstSizes = []int{10, 30, 60}

// BenchmarkBurst: N VM pods (no readiness probe: Ready = VM running) created
// at once through the API server of a real control plane on one node
// (maxVMs 64, image cached), then deleted at once; against N bare
// qemu-system started in parallel with the same VM in the same run.
// Reported per N:
//   - bare-qmp-ms / bare-marker-ms: all bare QEMUs answered a QMP command
//     (init done: see bareQMPUp) / all printed the boot marker;
//     bare-qmp-greeting-ms: all sent their QMP greeting (before their init
//     is done; the baseline of the runs before 2026-11-25) and
//     ready-x-of-greeting-plus-bind, all-ready against it;
//   - bind-ms: first Create call -> all pods bound (seen by a watch);
//   - all-ready-ms, all-marker-ms: first Create call -> all Ready / all at
//     the boot marker on their consoles;
//   - ready-x-of-bare-plus-bind = all-ready / (bare-qmp + bind) (target
//     1.5), marker-x-of-baseline = all-marker / bare-marker (target 1.05);
//   - all-gone-ms: DeleteCollection -> all pods gone from the API server
//     (target: grace-s + 2 s), vms-gone-ms: -> no QEMU left;
//   - qemu-rss-MiB/vm, qemu-pss-MiB/vm: the node's
//     qemu_kubelet_vms_memory_{rss,pss}_bytes / N once all are at the marker;
//   - agent-rss-KiB/vm: growth of the agent's RSS (process_resident_memory_bytes
//     on its /metrics) from before the first burst to all N at the marker, / N;
//   - agent-idle-cpu-%, host-busy-cpu-%: the agent's CPU (process_cpu_seconds_total)
//     and the host's (/proc/stat, all CPUs = 100%) over QK_BENCH_IDLE_WINDOW
//     (default 60s) while the N guests idle after their marker;
//   - throttle-waits-over-100ms, throttle-max-ms: the agent's client-side
//     rate limiter waits during the burst (its log, client-go's
//     "Waited before sending request" at -vmodule=request=3; target 0).
//
// Run one size with -bench 'Burst/N=30$' -benchtime 1x, other sizes with
// QK_BENCH_BURST_SIZES=10,200 (maxVMs of the node: QK_BENCH_BURST_MAXVMS);
// QK_BENCH_BURST_LOG_DIR keeps the agent's log of each burst.
func BenchmarkBurst(b *testing.B) {
	env := newPodBenchEnvWith(b, podBenchOptions{
		MaxVMs: envPositive(b, "QK_BENCH_BURST_MAXVMS", 64),
		// 60 pods x 100m CPU requested on 2 CPUs.
		// QK_BENCH_BURST_CONFIG adds node configuration lines (e.g.
		// "podSyncWorkers: 2" to compare).
		ExtraConfig: burstConfig(os.Getenv("QK_BENCH_BURST_CONFIG")),
		// client-go logs every rate limiter wait over 50 ms at V(3) and
		// every response at V(6) (the status writes of the timeline); the
		// provider its start timelines at V(2) (provider/telemetry/timeline.go).
		AgentArgs: []string{"-vmodule=request=3,round_trippers=6,timeline=2"},
	})
	// Warm-up: the first pod pulls the image; the bursts find it cached.
	env.podRun(b, "burst-warmup")
	agentRSS0 := benchGauge(b, env.metricsURL, "process_resident_memory_bytes")
	idleWindow := 60 * time.Second
	if v := os.Getenv("QK_BENCH_IDLE_WINDOW"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < time.Second {
			b.Fatalf("QK_BENCH_IDLE_WINDOW=%q: want a duration of at least 1s", v)
		}
		idleWindow = d
	}
	sizes := burstSizes
	if v := os.Getenv("QK_BENCH_BURST_SIZES"); v != "" { // e.g. "200" or "10,50"
		sizes = nil
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 {
				b.Fatalf("QK_BENCH_BURST_SIZES=%q: want comma-separated positive integers", v)
			}
			sizes = append(sizes, n)
		}
	}
	for _, n := range sizes {
		b.Run(fmt.Sprintf("N=%d", n), func(b *testing.B) {
			round := 0
			for b.Loop() {
				greeting, qmp, bareMarker := env.bareBurst(b, n)
				r := env.podBurst(b, n, fmt.Sprintf("n%d-r%d", n, round), idleWindow)
				round++
				b.ReportMetric(pbMs(greeting), "bare-qmp-greeting-ms")
				b.ReportMetric(pbMs(qmp), "bare-qmp-ms")
				b.ReportMetric(pbMs(bareMarker), "bare-marker-ms")
				b.ReportMetric(pbMs(r.bound), "bind-ms")
				b.ReportMetric(pbMs(r.ready), "all-ready-ms")
				b.ReportMetric(pbMs(r.marker), "all-marker-ms")
				b.ReportMetric(float64(r.ready)/float64(qmp+r.bound), "ready-x-of-bare-plus-bind")
				b.ReportMetric(float64(r.ready)/float64(greeting+r.bound), "ready-x-of-greeting-plus-bind")
				b.ReportMetric(float64(r.marker)/float64(bareMarker), "marker-x-of-baseline")
				b.ReportMetric(pbMs(r.gone), "all-gone-ms")
				b.ReportMetric(pbMs(r.vmsGone), "vms-gone-ms")
				b.ReportMetric(r.grace.Seconds(), "grace-s")
				b.ReportMetric(float64(r.throttled), "throttle-waits-over-100ms")
				b.ReportMetric(pbMs(r.maxThrottle), "throttle-max-ms")
				b.ReportMetric(r.rssPerVM/(1<<20), "qemu-rss-MiB/vm")
				b.ReportMetric(r.pssPerVM/(1<<20), "qemu-pss-MiB/vm")
				b.ReportMetric((r.agentRSS-agentRSS0)/float64(n)/(1<<10), "agent-rss-KiB/vm")
				b.ReportMetric(r.agentIdleCPU*100, "agent-idle-cpu-%")
				b.ReportMetric(r.hostIdleBusy*100, "host-busy-cpu-%")
				for _, ph := range []string{telemetry.PhasePull, telemetry.PhaseOverlay, telemetry.PhaseQEMUStart} {
					b.ReportMetric(r.phaseAvg[ph]*1000, "phase-"+ph+"-avg-ms")
				}
				b.ReportMetric(float64(r.conflicts), "status-conflicts")
				for _, h := range r.hops {
					if h.pods < n {
						b.Errorf("timeline step %s seen for %d of %d pods (missing: %v)", h.step, h.pods, n, h.missing)
					}
					b.ReportMetric(h.meanMs, "tl-"+h.step+"-hop-avg-ms")
					b.ReportMetric(h.lastMs, "tl-"+h.step+"-last-ms")
				}
				b.ReportMetric(r.hostBusyToReady*100, "host-busy-to-ready-%")
				var named time.Duration
				for _, name := range []string{"agent", "kube-apiserver", "etcd", "qemu"} {
					b.ReportMetric(pbMs(r.cpu[name])/float64(n), "cpu-"+name+"-ms/pod")
					named += r.cpu[name]
				}
				b.ReportMetric(pbMs(r.cpu["host"]-named)/float64(n), "cpu-rest-ms/pod")
				b.Logf("N=%d CPU from the first Create to all Ready (%.0f%% of all CPUs busy), per pod: %s", n, r.hostBusyToReady*100, formatCPU(r.cpu, n))
				b.ReportMetric(r.loadStart, "load-at-start")
				b.ReportMetric(r.loadReady, "load-at-ready")
				b.Logf("N=%d timeline (hop: from the step before, per pod; last-at: from the first Create call), %d status write conflicts:\n%s", n, r.conflicts, formatHops(r.hops))
				b.Logf("N=%d bare: QMP greeting %v, answered %v, marker %v; pods: bound %v ready %v marker %v gone %v (VMs %v); throttling waits >100ms: %d (max %v, all %d); start phases avg (s) %v; idle %v: agent RSS %.1f MiB (%.1f at 0 VMs), agent CPU %.2f%%, host busy %.1f%%",
					n, greeting, qmp, bareMarker, r.bound, r.ready, r.marker, r.gone, r.vmsGone, r.throttled, r.maxThrottle, r.allWaits, r.phaseAvg,
					idleWindow, r.agentRSS/(1<<20), agentRSS0/(1<<20), r.agentIdleCPU*100, r.hostIdleBusy*100)
			}
		})
	}
}

// bareBurst starts n bare VMs at once (bareBoot's command line plus a QMP
// socket each) and returns the time until all sent their QMP greeting,
// until all answered a QMP command (QEMU's init is done: see bareQMPUp)
// and until all printed the boot marker; then kills them.
func (e *podBenchEnv) bareBurst(b *testing.B, n int) (greeting, qmpUp, marker time.Duration) {
	b.Helper()
	// Short: unix socket paths are limited to 108 bytes.
	sockDir, err := os.MkdirTemp("", "qkbb")
	if err != nil {
		b.Fatal(err)
	}
	defer os.RemoveAll(sockDir)
	// N guests share the host's CPUs under TCG: 30 take about 3 min to the
	// marker on 2 busy CPUs.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute+time.Duration(n)*12*time.Second)
	defer cancel()
	type res struct{ greeting, qmp, marker time.Duration }
	results := make(chan res, n)
	errs := make(chan error, n)
	var cmds []*exec.Cmd
	var mu sync.Mutex
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range cmds {
			_ = syscall.Kill(-c.Process.Pid, syscall.SIGKILL)
			_ = c.Wait()
		}
	}()
	start := time.Now()
	for i := range n {
		go func() {
			sock := filepath.Join(sockDir, fmt.Sprintf("%d.sock", i))
			cmd := exec.CommandContext(ctx, "qemu-system-x86_64",
				"-machine", "q35,vmport=off", "-accel", "tcg", "-cpu", qemu.DefaultCPUModel(qemu.ArchX86_64, qemu.AccelTCG), "-smp", "1", "-m", "256M",
				"-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio", "-device", "pvpanic",
				"-netdev", "user,id=net0", "-device", "virtio-net-pci,netdev=net0",
				"-qmp", "unix:"+sock+",server=on,wait=off",
				"-kernel", e.kernel, "-initrd", e.initrd, "-append", e.cmdline)
			cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
			out, err := cmd.StdoutPipe()
			if err != nil {
				errs <- err
				return
			}
			if err := cmd.Start(); err != nil {
				errs <- fmt.Errorf("start bare qemu %d: %w", i, err)
				return
			}
			mu.Lock()
			cmds = append(cmds, cmd)
			mu.Unlock()
			qmpAt := make(chan bareQMP, 1)
			go func() {
				q, err := bareQMPUp(ctx, sock, start)
				if err != nil {
					errs <- fmt.Errorf("bare qemu %d: %w", i, err)
					return
				}
				qmpAt <- q
			}()
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				if strings.Contains(sc.Text(), vmtest.BootMarker) {
					m := time.Since(start)
					go func() { _, _ = io.Copy(io.Discard, out) }()
					select {
					case q := <-qmpAt:
						results <- res{greeting: q.greeting, qmp: q.answered, marker: m}
					case <-ctx.Done():
						errs <- fmt.Errorf("bare qemu %d: QMP never answered", i)
					}
					return
				}
			}
			errs <- fmt.Errorf("bare qemu %d exited without the boot marker: %v", i, sc.Err())
		}()
	}
	for range n {
		select {
		case r := <-results:
			greeting, qmpUp, marker = max(greeting, r.greeting), max(qmpUp, r.qmp), max(marker, r.marker)
		case err := <-errs:
			b.Fatal(err)
		case <-ctx.Done():
			b.Fatalf("bare burst of %d: %v", n, ctx.Err())
		}
	}
	return greeting, qmpUp, marker
}

// bareQMP is when one bare QEMU sent its QMP greeting and when it answered
// its first command, from the burst's start.
type bareQMP struct{ greeting, answered time.Duration }

// bareQMPUp connects to a bare QEMU's QMP socket as soon as it exists and
// returns when QEMU sent its greeting and when it answered qmp_capabilities.
// The greeting is not "QEMU up": QEMU's monitor thread sends it on connect
// while the main thread is still initializing the machine (on an idle host
// the greeting comes at about 60 ms of QEMU's CPU, the first answer at about
// 165 ms). The answer comes from the main loop, once QEMU's init is done:
// the point where qemu-system -daemonize returns, which is the baseline
// issue #20 names ("all daemonized, QMP up"), and the point from which the
// node's QEMU can be told to run its guest.
func bareQMPUp(ctx context.Context, sock string, start time.Time) (bareQMP, error) {
	var c net.Conn
	for {
		var err error
		if c, err = net.Dial("unix", sock); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			return bareQMP{}, fmt.Errorf("QMP socket %s never accepted: %w", sock, err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	r := bufio.NewReader(c)
	line, err := r.ReadString('\n')
	if err != nil || !strings.Contains(line, `"QMP"`) {
		return bareQMP{}, fmt.Errorf("QMP greeting: %q %v", line, err)
	}
	q := bareQMP{greeting: time.Since(start)}
	if _, err := io.WriteString(c, `{"execute":"qmp_capabilities"}`+"\n"); err != nil {
		return bareQMP{}, fmt.Errorf("send qmp_capabilities: %w", err)
	}
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return bareQMP{}, fmt.Errorf("qmp_capabilities: no answer: %w", err)
		}
		switch {
		case strings.HasPrefix(line, `{"return"`):
			q.answered = time.Since(start)
			return q, nil
		case strings.HasPrefix(line, `{"error"`):
			return bareQMP{}, fmt.Errorf("qmp_capabilities refused: %s", strings.TrimSpace(line))
		}
		// An event ({"timestamp": ..., "event": ...}): read on.
	}
}

// burstResult is one pod burst, times from the first Create call (gone and
// vmsGone from the DeleteCollection call).
type burstResult struct {
	bound, ready, marker time.Duration
	gone, vmsGone        time.Duration
	grace                time.Duration
	// throttled: rate limiter waits over 100 ms in the agent's log during
	// the burst (allWaits: over client-go's 50 ms logging threshold).
	throttled, allWaits int
	maxThrottle         time.Duration
	// phaseAvg: mean start phase durations (s) of the burst's pods, from
	// the node's qemu_kubelet_vm_start_phase_duration_seconds.
	phaseAvg map[string]float64
	// hops: the per-pod timeline, step by step (burst_timeline_test.go);
	// conflicts: status writes the API server refused as stale (409).
	hops      []burstHop
	conflicts int
	// cpu: CPU time from the first Create call to all Ready, by process
	// (the agent, the control plane's components, "qemu": all the burst's
	// QEMUs, "host": all CPUs busy); hostBusyToReady: host CPU busy over
	// that window (all CPUs = 1).
	cpu             map[string]time.Duration
	hostBusyToReady float64
	// loadStart, loadReady: the host's 1-minute load average when the
	// burst began and when all its pods were Ready.
	loadStart, loadReady float64
	// rssPerVM, pssPerVM: the node's qemu_kubelet_vms_memory_{rss,pss}_bytes
	// / N once all VMs are at their marker.
	rssPerVM, pssPerVM float64
	// agentRSS: the agent's RSS with all N at the marker; agentIdleCPU and
	// hostIdleBusy: the agent's and the host's CPU (fraction of one CPU /
	// of all CPUs) over the idle window after that.
	agentRSS, agentIdleCPU, hostIdleBusy float64
}

// podBurst creates n VM pods at once, times them to bound, Ready and the
// boot marker, then deletes them at once and times them to gone.
func (e *podBenchEnv) podBurst(b *testing.B, n int, round string, idleWindow time.Duration) burstResult {
	b.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute+time.Duration(n)*12*time.Second)
	defer cancel()
	pods := e.c.Client().CoreV1().Pods("default")
	sel := "bench-burst=" + round
	// A retrying watch: a starved API server closes slow watchers (its
	// cacher's queue fills up under a burst of 60); this one resumes from
	// the last resource version it saw, as an informer would.
	list, err := pods.List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		b.Fatal(err)
	}
	w, err := watchtools.NewRetryWatcherWithContext(ctx, list.ResourceVersion, &cache.ListWatch{
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return pods.Watch(ctx, o)
		},
	})
	if err != nil {
		b.Fatal(err)
	}
	defer w.Stop()
	logFrom := fileSize(e.logPath)
	phasesBefore := benchPhaseSums(b, e.metricsURL)

	var r burstResult
	r.loadStart = load1m(b)
	procs := e.c.Pids()
	procs["agent"] = e.agentPid
	cpuStart, busyStart := procCPU(procs), hostBusy(b)
	start := time.Now()
	type created struct {
		name string
		uid  types.UID
		at   time.Time
		err  error
	}
	cr := make(chan created, n)
	for j := range n {
		p := vmPodSpec(fmt.Sprintf("burst-%s-%d", round, j), e.node, e.ref, corev1.RestartPolicyAlways, nil)
		p.Labels = map[string]string{"bench-burst": round}
		if j == 0 {
			r.grace = time.Duration(*p.Spec.TerminationGracePeriodSeconds) * time.Second
		}
		go func() {
			c, err := pods.Create(ctx, p, metav1.CreateOptions{})
			if err != nil {
				cr <- created{err: err}
				return
			}
			cr <- created{name: c.Namespace + "/" + c.Name, uid: c.UID, at: time.Now()}
		}()
	}
	var uids []types.UID
	timeline := map[string]*burstPod{}
	for range n {
		c := <-cr
		if c.err != nil {
			b.Fatal(c.err)
		}
		uids = append(uids, c.uid)
		timeline[c.name] = &burstPod{at: map[string]time.Time{"created": c.at}}
	}
	markerDone := make(chan time.Duration, 1)
	go func() { markerDone <- waitMarkers(ctx, e.dir, uids, start) }()

	bound, ready := map[string]bool{}, map[string]bool{}
	for len(ready) < n || len(bound) < n {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("watch closed with %d of %d Ready", len(ready), n)
			}
			if ev.Type == watch.Error {
				b.Fatalf("watch of the burst's pods failed with %d of %d Ready: %v", len(ready), n, apierrors.FromObject(ev.Object))
			}
			p, isPod := ev.Object.(*corev1.Pod)
			if !isPod {
				continue
			}
			if p.Status.Phase == corev1.PodFailed || p.Status.Phase == corev1.PodSucceeded {
				b.Fatalf("pod %s ended %s: %+v", p.Name, p.Status.Phase, p.Status)
			}
			tp := timeline[p.Namespace+"/"+p.Name]
			if tp == nil { // created, but its Create call not returned yet
				tp = &burstPod{at: map[string]time.Time{}}
				timeline[p.Namespace+"/"+p.Name] = tp
			}
			if p.Spec.NodeName != "" && !bound[p.Name] {
				bound[p.Name] = true
				r.bound = time.Since(start)
				tp.at["bound"] = time.Now()
			}
			for _, c := range p.Status.Conditions {
				if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue && !ready[p.Name] {
					ready[p.Name] = true
					r.ready = time.Since(start)
					tp.at["ready"] = time.Now()
				}
			}
		case <-ctx.Done():
			b.Fatalf("%d of %d pods Ready (%d bound): %v", len(ready), n, len(bound), ctx.Err())
		}
	}
	r.loadReady = load1m(b)
	// CPU from the first Create call to all Ready: the components', and
	// the QEMUs' (all started in the window) since their start.
	r.cpu = map[string]time.Duration{}
	cpuReady, busyReady, window := procCPU(procs), hostBusy(b), time.Since(start)
	for name, d := range cpuReady {
		r.cpu[name] = d - cpuStart[name]
	}
	qemuPids := vmtest.QEMUPids(e.dir)
	for _, pid := range qemuPids {
		r.cpu["qemu"] += procCPU(map[string]int{"q": pid})["q"]
	}
	r.cpu["host"] = busyReady - busyStart
	r.hostBusyToReady = (busyReady - busyStart).Seconds() / window.Seconds() / float64(runtime.NumCPU())
	if got := len(qemuPids); got != n {
		b.Fatalf("%d QEMU processes for %d Ready pods", got, n)
	}
	r.marker = <-markerDone
	if r.marker == 0 {
		b.Fatalf("not all %d pods reached the boot marker: %v", n, ctx.Err())
	}
	// Host memory per VM as the node measures it (its QEMUs' smaps_rollup).
	r.rssPerVM = benchGauge(b, e.metricsURL, telemetry.MetricVMsMemoryRSS) / float64(n)
	r.pssPerVM = benchGauge(b, e.metricsURL, telemetry.MetricVMsMemoryPSS) / float64(n)
	r.phaseAvg = map[string]float64{}
	for ph, s := range benchPhaseSums(b, e.metricsURL) {
		r.phaseAvg[ph] = (s - phasesBefore[ph]) / float64(n)
	}
	// Idle: all N guests past their marker, nothing else asked of the node.
	r.agentRSS = benchGauge(b, e.metricsURL, "process_resident_memory_bytes")
	cpu0, busy0, at0 := benchCounter(b, e.metricsURL, "process_cpu_seconds_total"), hostBusy(b), time.Now()
	time.Sleep(idleWindow)
	cpu1, busy1, el := benchCounter(b, e.metricsURL, "process_cpu_seconds_total"), hostBusy(b), time.Since(at0)
	r.agentIdleCPU = (cpu1 - cpu0) / el.Seconds()
	r.hostIdleBusy = (busy1 - busy0).Seconds() / el.Seconds() / float64(runtime.NumCPU())

	delStart := time.Now()
	if err := pods.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: sel}); err != nil {
		b.Fatal(err)
	}
	gone := map[string]bool{}
	for len(gone) < n {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				b.Fatalf("watch closed with %d of %d pods gone", len(gone), n)
			}
			if p, isPod := ev.Object.(*corev1.Pod); isPod && ev.Type == watch.Deleted {
				gone[p.Name] = true
				r.gone = time.Since(delStart)
			}
		case <-ctx.Done():
			b.Fatalf("%d of %d pods gone after delete: %v", len(gone), n, ctx.Err())
		}
	}
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 3*time.Minute, true, func(context.Context) (bool, error) {
		return len(vmtest.QEMUPids(e.dir)) == 0, nil
	})
	if err != nil {
		b.Fatalf("QEMU processes left after the delete burst: %v", err)
	}
	r.vmsGone = time.Since(delStart)

	log, err := os.ReadFile(e.logPath)
	if err != nil {
		b.Fatal(err)
	}
	burstLog := log[min(logFrom, int64(len(log))):]
	r.allWaits, r.throttled, r.maxThrottle = throttleWaits(string(burstLog), 100*time.Millisecond)
	if err := parseNodeTimeline(string(burstLog), start.Year(), timeline); err != nil {
		b.Fatalf("timeline of the burst from the agent's log: %v", err)
	}
	r.hops = burstHops(timeline, start)
	for _, p := range timeline {
		r.conflicts += p.conflicts
	}
	if d := os.Getenv("QK_BENCH_BURST_LOG_DIR"); d != "" {
		// Keep the agent's log of the burst for a closer look.
		p := filepath.Join(d, "agent-"+round+".log")
		if err := os.WriteFile(p, burstLog, 0o644); err != nil {
			b.Logf("keep agent log: %v", err)
		} else {
			b.Logf("agent log of the burst (from %s): %s", start.UTC().Format(time.RFC3339Nano), p)
		}
	}
	return r
}

// procCPU is the CPU time (user + system, all threads) of each named
// process; a process gone is left out.
func procCPU(pids map[string]int) map[string]time.Duration {
	out := map[string]time.Duration{}
	for name, pid := range pids {
		raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command name in parentheses: state is field 3,
		// utime and stime fields 14 and 15.
		f := strings.Fields(string(raw[strings.LastIndexByte(string(raw), ')')+1:]))
		if len(f) < 13 {
			continue
		}
		ut, err1 := strconv.ParseInt(f[11], 10, 64)
		st, err2 := strconv.ParseInt(f[12], 10, 64)
		if err1 != nil || err2 != nil {
			continue
		}
		out[name] = time.Duration(ut+st) * time.Second / 100 // USER_HZ
	}
	return out
}

// formatCPU lists CPU times per pod, largest first.
func formatCPU(cpu map[string]time.Duration, n int) string {
	names := make([]string, 0, len(cpu))
	for name := range cpu {
		names = append(names, name)
	}
	sort.Slice(names, func(i, j int) bool { return cpu[names[i]] > cpu[names[j]] })
	var parts []string
	for _, name := range names {
		parts = append(parts, fmt.Sprintf("%s %.0f ms", name, pbMs(cpu[name])/float64(n)))
	}
	return strings.Join(parts, ", ")
}

// load1m is the host's 1-minute load average (/proc/loadavg).
func load1m(b *testing.B) float64 {
	b.Helper()
	raw, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		b.Fatal(err)
	}
	f := strings.Fields(string(raw))
	if len(f) == 0 {
		b.Fatalf("/proc/loadavg: %q", raw)
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		b.Fatalf("/proc/loadavg: %q: %v", raw, err)
	}
	return v
}

// waitMarkers polls the consoles of the pods' VMs (reading only what was
// appended) and returns the time from start until all printed the boot
// marker; 0 if ctx ends first.
func waitMarkers(ctx context.Context, dir string, uids []types.UID, start time.Time) time.Duration {
	off := map[types.UID]int64{}
	left := map[types.UID]bool{}
	for _, u := range uids {
		left[u] = true
	}
	var last time.Duration
	for len(left) > 0 {
		if ctx.Err() != nil {
			return 0
		}
		for u := range left {
			f, err := os.Open(filepath.Join(dir, "state", "vms", string(u), qemu.ConsoleLogName))
			if err != nil {
				continue
			}
			from := max(off[u]-int64(len(vmtest.BootMarker)), 0)
			bs, _ := io.ReadAll(io.NewSectionReader(f, from, 1<<30))
			f.Close()
			off[u] = from + int64(len(bs))
			if strings.Contains(string(bs), vmtest.BootMarker) {
				delete(left, u)
				last = time.Since(start)
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	return last
}

var waitedRe = regexp.MustCompile(`"Waited before sending request" .*delay="([^"]+)"`)

// throttleWaits counts client-go's rate limiter waits in a klog text log:
// all logged ones, those over limit, and the longest.
func throttleWaits(log string, limit time.Duration) (all, over int, longest time.Duration) {
	for _, line := range strings.Split(log, "\n") {
		m := waitedRe.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		d, err := time.ParseDuration(m[1])
		if err != nil {
			continue
		}
		all++
		if d > limit {
			over++
		}
		longest = max(longest, d)
	}
	return all, over, longest
}

func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

// TestThrottleWaits: the parser of BenchmarkBurst's throttling count reads
// client-go's log line.
func TestThrottleWaits(t *testing.T) {
	log := `I1123 22:27:10.355205   29324 request.go:683] "Waited before sending request" node="n" delay="185.598943ms" reason="client-side throttling, not priority and fairness" verb="PUT" URL="https://x/api/v1/namespaces/d/pods/a/status"
I1123 22:27:10.455205   29324 request.go:683] "Waited before sending request" delay="60ms" reason="client-side throttling, not priority and fairness" verb="GET" URL="https://x"
I1123 22:27:11.355205   29324 other.go:1] "Pod deleted from node"
I1123 22:27:12.355205   29324 request.go:683] "Waited before sending request" delay="soon" reason="unparsable delay: skipped"`
	all, over, longest := throttleWaits(log, 100*time.Millisecond)
	if all != 2 || over != 1 || longest != 185598943*time.Nanosecond {
		t.Fatalf("all=%d over=%d longest=%v; want 2, 1, 185.598943ms", all, over, longest)
	}
}

// envPositive is the positive integer in the environment variable name, or
// def when it is unset.
func envPositive(b *testing.B, name string, def int) int {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		b.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// burstConfig is the node configuration of BenchmarkBurst: extra lines plus
// "overcommit: {cpu: 8}" unless they set an overcommit of their own.
func burstConfig(extra string) string {
	if strings.Contains(extra, "overcommit:") {
		return extra
	}
	return "overcommit: {cpu: 8}\n" + extra
}

// benchCounter is the value of an unlabelled counter on the node's /metrics.
func benchCounter(b *testing.B, url, name string) float64 {
	b.Helper()
	ms := benchScrape(b, url)[name].GetMetric()
	if len(ms) != 1 {
		b.Fatalf("metric %s: %d samples, want 1", name, len(ms))
	}
	return ms[0].GetCounter().GetValue()
}

// hostBusy is the host's CPU time not idle (all CPUs), from /proc/stat.
func hostBusy(b *testing.B) time.Duration {
	b.Helper()
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		b.Fatal(err)
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	f := strings.Fields(line) // cpu user nice system idle iowait irq softirq steal guest guest_nice
	if len(f) < 9 || f[0] != "cpu" {
		b.Fatalf("/proc/stat: first line %q", line)
	}
	var ticks int64
	for i, v := range f[1:9] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		t, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			b.Fatalf("/proc/stat field %d %q: %v", i+1, v, err)
		}
		ticks += t
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

// TestBareQMPUp: the bare baseline's QMP probe returns only once QEMU
// answered qmp_capabilities, not at the greeting; events before the answer
// are skipped; a refusal is an error.
func TestBareQMPUp(t *testing.T) {
	dir := t.TempDir()
	serve := func(name string, reply string) (sock string, answered chan struct{}, release chan struct{}) {
		sock = filepath.Join(dir, name)
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		answered, release = make(chan struct{}), make(chan struct{})
		go func() {
			c, err := l.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			r := bufio.NewReader(c)
			io.WriteString(c, `{"QMP": {"version": {}, "capabilities": ["oob"]}}`+"\n")
			if line, err := r.ReadString('\n'); err != nil || !strings.Contains(line, "qmp_capabilities") {
				t.Errorf("server got %q %v, want qmp_capabilities", line, err)
				return
			}
			<-release // QEMU's main loop is still initializing
			io.WriteString(c, `{"timestamp": {"seconds": 1, "microseconds": 2}, "event": "RESUME"}`+"\n")
			close(answered)
			io.WriteString(c, reply+"\n")
		}()
		return sock, answered, release
	}

	sock, answered, release := serve("ok.sock", `{"return": {}}`)
	done := make(chan bareQMP, 1)
	start := time.Now()
	go func() {
		q, err := bareQMPUp(context.Background(), sock, start)
		if err != nil {
			t.Errorf("bareQMPUp: %v", err)
		}
		done <- q
	}()
	select {
	case q := <-done:
		t.Fatalf("returned at the greeting (%+v), before QEMU answered", q)
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	q := <-done
	select {
	case <-answered:
	default:
		t.Fatal("returned before the server answered")
	}
	if q.greeting <= 0 || q.answered < q.greeting {
		t.Errorf("times %+v: want 0 < greeting <= answered", q)
	}

	sock, _, release = serve("refused.sock", `{"error": {"class": "CommandNotFound", "desc": "no"}}`)
	close(release)
	if _, err := bareQMPUp(context.Background(), sock, start); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("refusal: err %v, want refused", err)
	}

	// No socket ever: the context ends the wait with an error.
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if _, err := bareQMPUp(ctx, filepath.Join(dir, "none.sock"), start); err == nil || !strings.Contains(err.Error(), "never accepted") {
		t.Errorf("missing socket: err %v, want never accepted", err)
	}
}
