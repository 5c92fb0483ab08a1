package probe

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
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
// false; liveness starts true, and failureThreshold failures are reported
// (Sink.Failed) for the VM's owner, the pod's worker, to kill it (exit
// 137), after which the restart policy applies as for any VM exit. The
// probes never act on the VM's lifecycle themselves.

// NewState is the probes' state of the run of the VM started at run,
// before any probe succeeded.
func NewState(run time.Time) *State {
	return &State{run: run, msg: "probes have not succeeded yet"}
}

// State is what the probes of one run found, read by the pod's status.
type State struct {
	// run is the start time of the VM run it belongs to.
	run     time.Time
	mu      sync.Mutex
	ready   bool
	started bool
	msg     string
}

func (s *State) set(ready bool, msg string) (changed bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	changed = s.ready != ready
	s.ready, s.msg = ready, msg
	return changed
}

func (s *State) setStarted() {
	s.mu.Lock()
	s.started = true
	s.mu.Unlock()
}

// Apply sets the Ready and Started parts of status from the probes of
// pod's container while the VM runs: with a startupProbe, not started (and
// not ready) until it succeeded in this run; with a readinessProbe, not
// ready until it succeeded in this run (s is matched to the run by its start
// time). Without either the status is left as PodStatus made it.
func Apply(status *corev1.PodStatus, pod *corev1.Pod, s *State) {
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

// Sink is what the probes of a run report to.
type Sink interface {
	// Event records an event on the pod.
	Event(typ, reason, msg string)
	// Changed: the results the pod's status shows changed (a readiness
	// probe's pass or failure, a startup probe's pass).
	Changed()
	// Failed: the liveness or startup probe (kind) failed failureThreshold
	// times (msg is the last failure): the run is to be killed, by the VM's
	// owner. Called once per probe and run; it may block until the owner
	// takes it or the run ends.
	Failed(kind, msg string)
}

// Start starts the probes of container c for this run of vm, with
// their results in state; they end when the VM exits, gone is closed (the
// pod is deleted) or ctx ends. A startupProbe runs first and holds the
// others until it succeeded; its failure is reported like a liveness
// failure (Sink.Failed).
func Start(ctx context.Context, vm VM, c *corev1.Container, state *State, gone <-chan struct{}, sink Sink) {
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
	failed := func(kind, msg string) {
		klog.FromContext(ctx).Info(kind+" probe failed; the VM is to be killed", "msg", msg)
		sink.Failed(kind, msg)
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
				failed("Startup", msg)
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
			}
			return true
		})
	}
	if c.LivenessProbe != nil {
		go runProbe(ctx, vm, c, "Liveness", c.LivenessProbe, true, false, stop, afterStart(started, runStart), sink, func(ok bool, msg string) bool {
			if !ok {
				failed("Liveness", msg)
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
//
// An early check also ends after the window the in-flight checks span
// (maxEarly checks begun fast apart: 1 s), not only at the probe's
// timeout: with timeoutSeconds 5, ten checks hung on connections the
// booting guest never saw held every slot for 5 s, and the guest's port,
// answering since, was seen only when one of them ended (2 s after the
// boot marker, BenchmarkLeaseFromZero). The regular checks keep the
// probe's timeout: a guest that answers slower than the window is still
// seen, a period later.
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
	// timeout bounds a regular check (the probe's), earlyTimeout an early
	// one (timeoutOf).
	timeout, earlyTimeout time.Duration
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
	s := probeSchedule{period: period, timeout: timeout, earlyTimeout: timeout}
	if early && period > probeFastInterval {
		s.fast = probeFastInterval
		s.maxEarly = maxEarly
		if s.maxEarly <= 0 {
			s.maxEarly = min(maxEarlyChecks, max(1, int((timeout+probeFastInterval-1)/probeFastInterval)))
		}
		if s.maxEarly > 1 {
			// The window of the overlapping checks (maxEarlyChecks); one
			// at a time (exec) has no slot another check waits for.
			s.earlyTimeout = min(timeout, time.Duration(s.maxEarly)*s.fast)
		}
	}
	return s
}

// timeoutOf is how long a regular or an early check may take. Pure.
func (s probeSchedule) timeoutOf(regular bool) time.Duration {
	if regular {
		return s.timeout
	}
	return s.earlyTimeout
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
func runProbe(ctx context.Context, vm VM, c *corev1.Container, kind string, probe *corev1.Probe, initial, early bool, stop <-chan struct{}, gate *probeGate, sink Sink, onResult func(ok bool, msg string) bool) {
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
			checkTimeout := sched.timeoutOf(regular)
			go func() {
				ok, msg := g.check(checkCtx, checkTimeout)
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

// VM is what the probes use of a running VM: the guest side (exec,
// forwards, usernet queries). Nothing of its lifecycle: a failed liveness
// or startup probe is reported (Sink.Failed), never acted on.
type VM interface {
	guest.VM
	// Pid and StateDir identify the run in the forwards ledger.
	Pid() int
	StateDir() string
}
