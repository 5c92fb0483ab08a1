package provider

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/klog/v2"
)

// Probes of a VM pod run against guest ports through the VM's user
// network: each probe gets a forward 127.0.0.1:<free port> -> guest port for
// the life of the run. tcpSocket succeeds when the guest accepts the
// connection: QEMU accepts the host side at once and closes it when the
// guest refuses, so the probe waits up to its timeout for that close (a
// server that accepts and closes at once without sending a byte counts as a
// failure). httpGet succeeds on a status in [200, 400) (HTTPS without
// certificate checks, as a kubelet). The probe's host field is ignored: a
// probe always targets the guest. exec probes run their command through
// qemu-guest-agent (VM.GuestExec, bounded by timeoutSeconds): exit code
// 0 passes, anything else (including no agent answering) fails. grpc probes
// are refused by Translate; check still fails them should one reach it.
//
// Timing follows the kubelet: initialDelaySeconds, periodSeconds,
// timeoutSeconds, successThreshold, failureThreshold; until a readiness or
// startup probe first passes in a run, the node also checks early, between
// periods (probeSchedule). Readiness starts
// false; liveness starts true, and failureThreshold failures kill the VM
// (exit 137), after which the restart policy applies as for any VM exit.

// probeState is what the probes of one run found, read by snapshot.
type probeState struct {
	// run is the start time of the VM run it belongs to.
	run     time.Time
	mu      sync.Mutex
	ready   bool
	started bool
	msg     string
}

func (s *probeState) set(ready bool, msg string) (changed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	changed = s.ready != ready
	s.ready, s.msg = ready, msg
	return changed
}

func (s *probeState) setStarted() {
	s.mu.Lock()
	s.started = true
	s.mu.Unlock()
}

// applyProbes sets the Ready and Started parts of status from the probes of
// pod's container while the VM runs: with a startupProbe, not started (and
// not ready) until it succeeded in this run; with a readinessProbe, not
// ready until it succeeded in this run (s is matched to the run by its start
// time). Without either the status is left as PodStatus made it.
func applyProbes(status *corev1.PodStatus, pod *corev1.Pod, s *probeState) {
	if len(pod.Spec.Containers) == 0 || len(status.ContainerStatuses) != 1 || status.ContainerStatuses[0].State.Running == nil {
		return
	}
	c := &pod.Spec.Containers[0]
	if c.ReadinessProbe == nil && c.StartupProbe == nil {
		return
	}
	var ready, started bool
	if s != nil && s.run.Equal(status.ContainerStatuses[0].State.Running.StartedAt.Time) {
		s.mu.Lock()
		ready, started = s.ready, s.started
		s.mu.Unlock()
	}
	if c.StartupProbe == nil {
		started = true
	}
	if c.ReadinessProbe == nil {
		ready = started
	}
	ready = ready && started
	cs := &status.ContainerStatuses[0]
	cs.Ready = ready
	cs.Started = &started
	for i := range status.Conditions {
		cond := &status.Conditions[i]
		if cond.Type != corev1.ContainersReady && cond.Type != corev1.PodReady {
			continue
		}
		if ready {
			cond.Status, cond.Reason, cond.Message = corev1.ConditionTrue, "", ""
		} else {
			cond.Status, cond.Reason, cond.Message = corev1.ConditionFalse, "ContainersNotReady", "containers with unready status: ["+cs.Name+"]"
		}
	}
}

// probeCounter applies success/failure thresholds to probe outcomes.
type probeCounter struct {
	successThreshold, failureThreshold int32
	result                             bool
	successes, failures                int32
}

func newProbeCounter(p *corev1.Probe, initial bool) *probeCounter {
	c := &probeCounter{successThreshold: p.SuccessThreshold, failureThreshold: p.FailureThreshold, result: initial}
	if c.successThreshold < 1 {
		c.successThreshold = 1
	}
	if c.failureThreshold < 1 {
		c.failureThreshold = 3
	}
	return c
}

// observe records one outcome and returns the (possibly changed) result.
func (c *probeCounter) observe(ok bool) bool {
	if ok {
		c.failures = 0
		c.successes++
		if c.successes >= c.successThreshold {
			c.result = true
		}
	} else {
		c.successes = 0
		c.failures++
		if c.failures >= c.failureThreshold {
			c.result = false
		}
	}
	return c.result
}

func probeDurations(p *corev1.Probe) (delay, period, timeout time.Duration) {
	delay = time.Duration(p.InitialDelaySeconds) * time.Second
	period = time.Duration(p.PeriodSeconds) * time.Second
	if period <= 0 {
		period = 10 * time.Second
	}
	timeout = time.Duration(p.TimeoutSeconds) * time.Second
	if timeout <= 0 {
		timeout = time.Second
	}
	return delay, period, timeout
}

// probePort resolves a probe's port (number or container port name).
func probePort(port intstr.IntOrString, c *corev1.Container) (int, error) {
	if port.Type == intstr.Int {
		if port.IntVal < 1 || port.IntVal > 65535 {
			return 0, fmt.Errorf("port %d out of range", port.IntVal)
		}
		return int(port.IntVal), nil
	}
	for _, cp := range c.Ports {
		if cp.Name == port.StrVal {
			return int(cp.ContainerPort), nil
		}
	}
	if n, err := strconv.Atoi(port.StrVal); err == nil && n > 0 && n < 65536 {
		return n, nil
	}
	return 0, fmt.Errorf("port %q not found among the container's ports", port.StrVal)
}

// guestProber runs one probe's checks against a VM.
type guestProber struct {
	vm    ProbeVM
	probe *corev1.Probe
	c     *corev1.Container
	// hostPorts: guest port -> forwarded host port (added on first use);
	// under mu (early checks run at once).
	mu        sync.Mutex
	hostPorts map[int]int
}

// check runs the probe once; msg says why it failed.
func (g *guestProber) check(ctx context.Context, timeout time.Duration) (bool, string) {
	h := g.probe.ProbeHandler
	switch {
	case h.TCPSocket != nil:
		port, err := probePort(h.TCPSocket.Port, g.c)
		if err != nil {
			return false, err.Error()
		}
		hp, err := g.forward(ctx, port, timeout)
		if err != nil {
			return false, err.Error()
		}
		return tcpCheck(ctx, boundedQuery(guest.Usernet(g.vm), timeout), hp, port, timeout)
	case h.HTTPGet != nil:
		port, err := probePort(h.HTTPGet.Port, g.c)
		if err != nil {
			return false, err.Error()
		}
		hp, err := g.forward(ctx, port, timeout)
		if err != nil {
			return false, err.Error()
		}
		return httpCheck(ctx, h.HTTPGet, hp, timeout)
	case h.Exec != nil:
		return execCheck(ctx, g.vm, h.Exec.Command, timeout)
	case h.GRPC != nil:
		return false, "grpc probes are not supported for VM pods"
	}
	return false, "probe has no handler"
}

// maxProbeOutput bounds the command output quoted in a probe's message.
const maxProbeOutput = 256

// execCheck runs an exec probe's command in the guest through the guest
// agent, within timeout.
func execCheck(ctx context.Context, vm ProbeVM, command []string, timeout time.Duration) (bool, string) {
	if len(command) == 0 || command[0] == "" {
		return false, "exec probe has no command"
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	res, err := vm.GuestExec(ctx, qemu.ExecRequest{Path: command[0], Args: command[1:]})
	if errors.Is(err, context.DeadlineExceeded) {
		return false, fmt.Sprintf("command %q timed out after %s", strings.Join(command, " "), timeout)
	}
	if err != nil {
		return false, err.Error()
	}
	if res.ExitCode != 0 {
		out := strings.TrimSpace(string(res.Stdout) + string(res.Stderr))
		if len(out) > maxProbeOutput {
			out = out[:maxProbeOutput] + "..."
		}
		return false, fmt.Sprintf("command %q exited with %d: %s", strings.Join(command, " "), res.ExitCode, out)
	}
	return true, ""
}

// forward returns the host port forwarded to guestPort, adding the forward
// (a QMP command, bounded by max(timeout, probeQMPMin): a hung QEMU fails
// the probe) on
// first use.
func (g *guestProber) forward(ctx context.Context, guestPort int, timeout time.Duration) (int, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if hp, ok := g.hostPorts[guestPort]; ok {
		return hp, nil
	}
	ctx, cancel := context.WithTimeout(ctx, max(timeout, probeQMPMin))
	defer cancel()
	hp, err := g.vm.ForwardPort(ctx, guestPort, 0)
	if err != nil {
		return 0, err
	}
	g.hostPorts[guestPort] = hp
	recordProbeForward(g.vm, hp)
	return hp, nil
}

func (g *guestProber) close() {
	select {
	case <-g.vm.Done():
		return
	default:
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, hp := range g.hostPorts {
		_ = g.vm.RemoveForward(ctx, hp)
	}
}

// ProbeForwardsFileName lists the probe forwards added to the VM ("<QEMU
// pid> <host port>" lines): forwards a qemu-kubelet that stopped
// (detaching from its VMs) could not remove are removed by the next one
// when it adopts the VM.
const ProbeForwardsFileName = "probe-forwards"

func recordProbeForward(vm ProbeVM, hostPort int) {
	f, err := os.OpenFile(filepath.Join(vm.StateDir(), ProbeForwardsFileName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return // best effort: at worst a forward outlives its prober
	}
	fmt.Fprintf(f, "%d %d\n", vm.Pid(), hostPort)
	f.Close()
}

// staleProbeForwards parses the ledger: the host ports recorded for QEMU
// pid (other pids: earlier VMs, gone). Pure.
func staleProbeForwards(ledger []byte, pid int) []int {
	var out []int
	for _, line := range strings.Split(string(ledger), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 || f[0] != strconv.Itoa(pid) {
			continue
		}
		if p, err := strconv.Atoi(f[1]); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// removeStaleProbeForwards removes the forwards earlier probers of this
// QEMU left behind and empties the ledger.
func removeStaleProbeForwards(ctx context.Context, vm ProbeVM) {
	path := filepath.Join(vm.StateDir(), ProbeForwardsFileName)
	b, err := os.ReadFile(path)
	if err != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	for _, hp := range staleProbeForwards(b, vm.Pid()) {
		_ = vm.RemoveForward(ctx, hp) // already gone: fine
	}
	os.Remove(path)
}

// probeQMPMin is the least time a probe's QMP command (adding its forward,
// asking for the connection state) gets: on a loaded host QEMU may answer
// later than a 1 s probe timeout, but a hung QEMU must fail the probe.
const probeQMPMin = 5 * time.Second

// boundedQuery bounds each QMP query of q by max(timeout, probeQMPMin): a
// probe against a hung QEMU fails instead of waiting forever.
func boundedQuery(q guest.UsernetQuery, timeout time.Duration) guest.UsernetQuery {
	return func(ctx context.Context) (string, error) {
		ctx, cancel := context.WithTimeout(ctx, max(timeout, probeQMPMin))
		defer cancel()
		return q(ctx)
	}
}

// tcpCheck connects through the forward and waits up to timeout for the
// guest to accept (see awaitGuest).
func tcpCheck(ctx context.Context, query guest.UsernetQuery, hostPort, guestPort int, timeout time.Duration) (bool, string) {
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(ctx, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(hostPort)))
	if err != nil {
		return false, fmt.Sprintf("dial tcp guest port %d: %v", guestPort, err)
	}
	defer conn.Close()
	if _, err := guest.AwaitGuest(ctx, query, conn, hostPort, timeout); err != nil {
		return false, fmt.Sprintf("dial tcp guest port %d: %v", guestPort, err)
	}
	return true, ""
}

// httpCheck is the kubelet's httpGet probe against the forward.
func httpCheck(ctx context.Context, hg *corev1.HTTPGetAction, hostPort int, timeout time.Duration) (bool, string) {
	scheme := "http"
	if hg.Scheme == corev1.URISchemeHTTPS {
		scheme = "https"
	}
	path := hg.Path
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	url := fmt.Sprintf("%s://127.0.0.1:%d%s", scheme, hostPort, path)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return false, err.Error()
	}
	req.Header.Set("User-Agent", "kube-probe/qemu-kubelet")
	for _, h := range hg.HTTPHeaders {
		if strings.EqualFold(h.Name, "Host") {
			req.Host = h.Value
			continue
		}
		req.Header.Add(h.Name, h.Value)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, DisableKeepAlives: true} //nolint:gosec // as the kubelet's probes
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Do(req)
	if err != nil {
		if errors.Is(err, io.EOF) || strings.Contains(err.Error(), "EOF") || strings.Contains(err.Error(), "connection reset") ||
			strings.Contains(err.Error(), "server closed idle connection") { // the close raced the request write
			return false, fmt.Sprintf("Get %q: %v (nothing listening on guest port %s?)", hg.Path, err, hg.Port.String())
		}
		return false, fmt.Sprintf("Get %q: %v", hg.Path, err)
	}
	io.Copy(io.Discard, io.LimitReader(resp.Body, 10<<10)) //nolint:errcheck
	resp.Body.Close()
	if resp.StatusCode >= 200 && resp.StatusCode < 400 {
		return true, ""
	}
	return false, fmt.Sprintf("HTTP probe failed with statuscode: %d", resp.StatusCode)
}

// probeSink is what the probes of a run report to.
type probeSink interface {
	// Event records an event on the pod.
	Event(typ, reason, msg string)
	// Changed: the results the pod's status shows changed.
	Changed()
	// Ready: the readiness probe passed (after failing, or first).
	Ready()
}

// runProbes starts the probes of container c for this run of vm, with
// their results in state; they end when the VM exits, gone is closed (the
// pod is deleted) or ctx ends. A startupProbe runs first and holds the
// others until it succeeded; its failure kills the VM like a liveness
// failure.
func runProbes(ctx context.Context, vm ProbeVM, c *corev1.Container, state *probeState, gone <-chan struct{}, sink probeSink) {
	removeStaleProbeForwards(ctx, vm)
	if c.ReadinessProbe == nil && c.LivenessProbe == nil && c.StartupProbe == nil {
		return
	}
	runStart := time.Now()
	stop := make(chan struct{})
	go func() {
		select {
		case <-vm.Done():
		case <-gone:
		case <-ctx.Done():
		}
		close(stop)
	}()
	kill := func(kind, msg string) {
		klog.FromContext(ctx).Info(kind+" probe failed; killing the VM", "msg", msg)
		sink.Event(corev1.EventTypeNormal, "Killing", fmt.Sprintf("Container %s failed %s probe, will be restarted", c.Name, strings.ToLower(kind)))
		vm.Kill()
	}
	started := make(chan struct{})
	if c.StartupProbe != nil {
		go runProbe(ctx, vm, c, "Startup", c.StartupProbe, false, true, stop, nil, sink, func(ok bool, msg string) bool {
			if ok {
				state.setStarted()
				sink.Changed()
				close(started)
				return false
			}
			if msg != "" {
				kill("Startup", msg)
				return false
			}
			return true
		})
	} else {
		state.setStarted()
		close(started)
	}
	if c.ReadinessProbe != nil {
		go runProbe(ctx, vm, c, "Readiness", c.ReadinessProbe, false, true, stop, afterStart(started, runStart), sink, func(ok bool, msg string) bool {
			if state.set(ok, msg) {
				sink.Changed()
				if ok {
					sink.Ready()
				}
			}
			return true
		})
	}
	if c.LivenessProbe != nil {
		go runProbe(ctx, vm, c, "Liveness", c.LivenessProbe, true, false, stop, afterStart(started, runStart), sink, func(ok bool, msg string) bool {
			if !ok {
				kill("Liveness", msg)
				return false
			}
			return true
		})
	}
}

// afterStart is a probe's gate: closed once the startup probe succeeded,
// with the time the run started (initialDelaySeconds counts from it).
func afterStart(started <-chan struct{}, runStart time.Time) *probeGate {
	return &probeGate{started: started, runStart: runStart}
}

type probeGate struct {
	started  <-chan struct{}
	runStart time.Time
}

// probeFastInterval is how often a readiness or startup probe begins an
// early check until its first success in a run (never more often than its
// period): a booting guest is seen ready within about this of its port
// answering, not within a period.
const probeFastInterval = 100 * time.Millisecond

// maxEarlyChecks bounds the early checks in flight at once. They overlap:
// a connection made before the guest's network was up is answered only at
// a retransmission (seconds later), and a guest answering slowly while it
// boots takes long; neither holds back the next check.
const maxEarlyChecks = 10

// probeSchedule is when a probe's loop begins checks, as plain data
// (durations from the end of the initial delay). The regular checks follow
// the kubelet: one at a time, each a period after the start of the previous
// one (a check that takes long counts against the period). Until the
// probe's first success in the run, with fast > 0, early checks begin every
// fast, beside the regular ones, each with the probe's timeout, at most
// maxEarly in flight: an early check counts only when it succeeds (a
// success seen sooner); its failure is neither counted against
// failureThreshold nor reported, so a probe fails exactly when the
// kubelet's would and initialDelaySeconds still holds.
type probeSchedule struct {
	period, fast time.Duration
	maxEarly     int
	// due is when the next regular check is due; regularBusy: one runs.
	due         time.Duration
	regularBusy bool
	// lastEarly is when the last early check began; earlyBusy how many run.
	lastEarly time.Duration
	earlyBusy int
	// succeeded: a check passed in this run (no more early checks).
	succeeded bool
}

// newProbeSchedule is the schedule of a probe of period and timeout;
// early checks every probeFastInterval (when period is longer) when early
// is set, at most maxEarly at once (0: maxEarlyChecks, or as many as fit in
// the timeout).
func newProbeSchedule(period, timeout time.Duration, early bool, maxEarly int) probeSchedule {
	s := probeSchedule{period: period}
	if early && period > probeFastInterval {
		s.fast = probeFastInterval
		s.maxEarly = maxEarly
		if s.maxEarly <= 0 {
			s.maxEarly = min(maxEarlyChecks, max(1, int((timeout+probeFastInterval-1)/probeFastInterval)))
		}
	}
	return s
}

// next is the next check to begin at or after now: when, and whether it is
// regular; ok false: none until a running check ends. Pure.
func (s probeSchedule) next(now time.Duration) (at time.Duration, regular, ok bool) {
	if !s.regularBusy {
		at, regular, ok = max(s.due, now), true, true
	}
	if s.fast > 0 && !s.succeeded && s.earlyBusy < s.maxEarly {
		if e := max(s.lastEarly+s.fast, now); !ok || e < at {
			at, regular, ok = e, false, true
		}
	}
	return at, regular, ok
}

// began records a check begun at at. Pure.
func (s probeSchedule) began(at time.Duration, regular bool) probeSchedule {
	if regular {
		s.regularBusy = true
	} else {
		s.earlyBusy++
		s.lastEarly = at
	}
	return s
}

// done records the end of a check begun at began: a regular check, or an
// early one that succeeded, sets the next regular check a period after it.
// Pure.
func (s probeSchedule) done(began time.Duration, regular, ok bool) probeSchedule {
	if regular {
		s.regularBusy = false
	} else {
		s.earlyBusy--
	}
	if regular || ok {
		s.due = max(s.due, began+s.period)
	}
	if ok {
		s.succeeded = true
	}
	return s
}

// counts: the check's result is counted (a regular check, or an early one
// that succeeded). Pure.
func (s probeSchedule) counts(regular, ok bool) bool { return regular || ok }

// probeResult is one check's outcome, sent to runProbe's loop.
type probeResult struct {
	began       time.Duration
	regular, ok bool
	msg         string
}

// runProbe is one probe's loop. It waits for gate (nil: none), then the
// probe's initial delay (counted from the run's start when gated), then
// begins checks on its probeSchedule (early checks until the first success
// when early is set); onResult gets the thresholded result after every
// counted check, and the message of the failing check when the result is a
// failure (empty while failures are below the threshold); it returns
// whether to go on.
func runProbe(ctx context.Context, vm ProbeVM, c *corev1.Container, kind string, probe *corev1.Probe, initial, early bool, stop <-chan struct{}, gate *probeGate, sink probeSink, onResult func(ok bool, msg string) bool) {
	delay, period, timeout := probeDurations(probe)
	g := &guestProber{vm: vm, probe: probe, c: c, hostPorts: map[int]int{}}
	defer g.close()
	counter := newProbeCounter(probe, initial)
	wait := func(d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-stop:
			return false
		}
	}
	if gate != nil {
		select {
		case <-gate.started:
		case <-stop:
			return
		}
		delay -= time.Since(gate.runStart)
	}
	if delay > 0 && !wait(delay) {
		return
	}
	maxEarly := 0
	if probe.Exec != nil {
		maxEarly = 1 // the guest agent runs one command at a time
	}
	sched := newProbeSchedule(period, timeout, early, maxEarly)
	// Checks run on their own goroutines and end with the loop (cctx);
	// early ones also end at the first success (ectx).
	cctx, cancel := context.WithCancel(ctx)
	ectx, ecancel := context.WithCancel(cctx)
	defer ecancel()
	running := 0
	results := make(chan probeResult)
	defer func() {
		cancel()
		for ; running > 0; running-- {
			<-results
		}
	}()
	go func() {
		select {
		case <-stop:
			cancel()
		case <-cctx.Done():
		}
	}()
	origin := time.Now()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		at, regular, ok := sched.next(time.Since(origin))
		var fire <-chan time.Time
		if ok {
			timer.Reset(at - time.Since(origin))
			fire = timer.C
		}
		select {
		case <-cctx.Done():
			return
		case <-fire:
			began := time.Since(origin)
			sched = sched.began(began, regular)
			checkCtx := cctx
			if !regular {
				checkCtx = ectx
			}
			running++
			go func() {
				ok, msg := g.check(checkCtx, timeout)
				results <- probeResult{began: began, regular: regular, ok: ok, msg: msg}
			}()
			continue
		case r := <-results:
			running--
			if !timer.Stop() {
				select {
				case <-timer.C:
				default:
				}
			}
			if cctx.Err() != nil {
				return
			}
			sched = sched.done(r.began, r.regular, r.ok)
			if !sched.counts(r.regular, r.ok) {
				continue // an early check: only its success counts
			}
			if r.ok {
				ecancel() // the early checks are over
			}
			if !r.ok {
				sink.Event(corev1.EventTypeWarning, "Unhealthy", fmt.Sprintf("%s probe failed: %s", kind, r.msg))
			}
			res := counter.observe(r.ok)
			failMsg := ""
			if !res && !r.ok && counter.failures >= counter.failureThreshold {
				failMsg = r.msg
			}
			if !onResult(res, failMsg) {
				return
			}
		}
	}
}

// ProbeVM is what the probes use of a running VM: the guest side (exec,
// forwards, usernet queries), and Kill for a failed liveness or startup
// probe.
type ProbeVM interface {
	guest.VM
	Kill()
	// Pid and StateDir identify the run in the forwards ledger.
	Pid() int
	StateDir() string
}
