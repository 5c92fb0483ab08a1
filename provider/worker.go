package provider

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// The pod worker's executor: it waits for the events of the pure
// machine in podworker.go and carries out its actions.

// Who owns what (one pod):
//   - the worker goroutine (run) alone starts, stops and replaces the VM,
//     its overlay and the image it boots: every power and flash request of
//     the pod's Jumpstarter exporter (package exporter) is sent to it on rec.ctl
//     and answered on the request's reply channel, so power, flash, delete,
//     restart and recovery never race;
//   - the console and guest port forwards (kubectl attach/port-forward,
//     the exporter's console and TCP drivers), exec, stats and the probes
//     use the running VM read from rec.vm (its one copy, which the worker
//     alone sets); they never change its lifecycle (VM methods are safe
//     for concurrent use): a failed liveness or startup probe reaches
//     the worker as an event (evProbeFailed), a memory snapshot is saved
//     by the worker (actSaveSnapshot);
//   - the exporter supervisor goroutine (package exporter) owns the
//     exporter and the condition it shows.
//
// The worker is a state machine (podworker.go): its states, events and
// transitions are there; run only waits for events and does the actions.
// The exporter (package exporter) starts when the pod is first Ready (the
// worker's evReady) or is found powered off, and then lives with the pod:
// a lease never lands on a target still pulling its image or booting, and
// a powered-off VM still answers power on.

// worker is the executor of one pod's state machine: what the pure state
// (podWorker) does not hold. Worker goroutine only.
type worker struct {
	// podRun: the pod's run (its record, node and pod map); its steps and actions.
	*podRun
	ctx context.Context
	log klog.Logger
	pod *corev1.Pod
	// req is the request being served (evRequest, statePoweringOff,
	// stateFlashing).
	req vmRequest
	// backoff fires at the end of the crash-loop back-off (nil: no wait).
	backoff *time.Timer
	// waiter is a power on or flash request answered by the next start's
	// result (nil: none).
	waiter chan<- error
	// probed wakes the worker when the probes' results changed (the
	// probes' sink sends, never blocking): the pod may have turned Ready.
	probed chan struct{}
	// probeFailed carries a failed liveness or startup probe from the
	// probes' sink (evProbeFailed); failure is the one taken.
	probeFailed chan probeFailure
	failure     probeFailure
}

// run owns one pod's VM until the pod is deleted or the provider stops.
func (r *podRun) run() {
	p, rec := r.node, r.rec
	defer close(rec.done)
	pod, found := rec.read()
	f := recoveredFacts{final: found.Final, vm: rec.vm.get() != nil, pendingExit: rec.handoff.pendingExit, poweredOff: found.PoweredOff}
	w := &worker{podRun: r, pod: pod, probed: make(chan struct{}, 1), probeFailed: make(chan probeFailure)}
	rec.handoff.pendingExit = false
	w.log = p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	w.ctx = klog.NewContext(p.base, w.log)
	defer w.answer(errWorkerGone)
	defer w.stopBackOff()

	st, acts := initialWorker(pod.Spec.RestartPolicy, f)
	for {
		w.do(acts)
		if st.state.ended() {
			return
		}
		e := w.step(st)
		from := st.state
		st, acts = next(st, e)
		if st.state != from {
			w.log.V(2).Info("Pod worker", "from", from, "event", e.kind, "to", st.state, "actions", acts)
		}
		if st.state != stateBackOff {
			w.stopBackOff()
		}
	}
}

// answer answers the request waiting for the next start (w.waiter), once.
func (w *worker) answer(err error) {
	if w.waiter != nil {
		w.waiter <- err
		w.waiter = nil
	}
}

func (w *worker) stopBackOff() {
	if w.backoff != nil {
		w.backoff.Stop()
		w.backoff = nil
	}
}

// step waits in st's state for its next event (and, in the states that
// work, does the work).
func (w *worker) step(st podWorker) workerEvent {
	rec, ctx, s := w.rec, w.ctx, st.state
	if s != stateTerminating && w.deleteRequested() {
		return workerEvent{kind: evDelete}
	}
	switch s {
	case stateStarting:
		return w.start()
	case stateRunning:
		return w.waitRunning(st.ready)
	case stateExited:
		term := rec.stateCopy().Terminated
		if term == nil { // recovery always records it
			return workerEvent{kind: evExited, reason: podstatus.ReasonStartError, exitCode: 128}
		}
		return workerEvent{kind: evExited, exitCode: term.ExitCode, reason: term.Reason}
	case stateBackOff:
		if w.backoff == nil {
			return workerEvent{kind: evBackOffDone}
		}
		return w.wait(w.backoff.C)
	case statePoweredOff, stateFinished:
		return w.wait(nil)
	case statePoweringOff:
		err := w.powerOff(ctx, "on request", w.req.now)
		w.req.reply <- err
		if err != nil {
			return workerEvent{kind: evStopFailed}
		}
		return workerEvent{kind: evStopped}
	case stateFlashing:
		req := w.req
		if w.rec.vm.get() != nil { // a reset comes from BackOff and PoweredOff too
			// A reset drops the guest's state: no need to shut it down.
			if err := w.powerOff(ctx, "to "+flashVerb(req), req.op == opReset); err != nil {
				req.refuse(err)
				return workerEvent{kind: evStopFailed}
			}
		}
		if err := w.installFlash(req.flash); err != nil {
			req.reply <- err
			return workerEvent{kind: evFlashFailed}
		}
		w.update(func(st *podstatus.VMState) { st.PoweredOff = false })
		w.waiter = req.reply // answered by the start of the new image
		return workerEvent{kind: evFlashed}
	case stateTerminating:
		w.finishDelete()
		return workerEvent{kind: evDeleted}
	}
	panic(fmt.Sprintf("pod worker: no step for state %s", s))
}

// wait waits for a delete, the shutdown, a request or the back-off timer
// (nil: none).
func (w *worker) wait(timer <-chan time.Time) workerEvent {
	select {
	case <-timer:
		w.backoff = nil
		return workerEvent{kind: evBackOffDone}
	case <-w.rec.deleteReq:
		return workerEvent{kind: evDelete}
	case <-w.ctx.Done():
		return workerEvent{kind: evShutdown}
	case req := <-w.rec.ctl:
		return w.request(req)
	}
}

// request takes a request as the current one.
func (w *worker) request(req vmRequest) workerEvent {
	w.req = req
	return workerEvent{kind: evRequest, op: req.op}
}

// start is stateStarting's step: wait for the pod to be confirmed and its
// features, pull the image and start QEMU.
func (w *worker) start() workerEvent {
	rec, ctx := w.rec, w.ctx
	// A recovered pod whose VM must be (re)started waits until the library
	// shows the pod still exists (or deletes it).
	select {
	case <-rec.confirmed:
	case <-rec.deleteReq:
		return workerEvent{kind: evDelete}
	case <-ctx.Done():
		return workerEvent{kind: evShutdown}
	}
	if rec.handoff.unrecorded {
		if e, ok := w.record(); !ok {
			return e
		}
		rec.handoff.unrecorded = false
	}
	// A pod needing a disabled feature waits (features.go).
	if !w.holdForFeatures(ctx) {
		if ctx.Err() != nil {
			return workerEvent{kind: evShutdown}
		}
		return workerEvent{kind: evDelete}
	}
	if w.pullAndStart(ctx) {
		return workerEvent{kind: evStarted}
	}
	if ctx.Err() != nil {
		return workerEvent{kind: evShutdown}
	}
	if w.deleteRequested() {
		return workerEvent{kind: evDelete}
	}
	// The start failed; recorded as a terminated run.
	e := workerEvent{kind: evStartFailed, exitCode: 128, reason: podstatus.ReasonStartError}
	if t := rec.stateCopy().Terminated; t != nil {
		e.exitCode, e.reason = t.ExitCode, t.Reason
	}
	return e
}

// record writes a new pod's intent record (pod.json, then status.json)
// before anything of its VM exists: from here on a crash of the agent is
// reconciled at the next start (recovery.go); before it, the next start
// knows nothing of the pod and the library creates it again. A record that
// cannot be written (a full disk) is retried with the back-off while the
// pod waits in ContainerCreating with a FailedToRecordState event; a
// delete or the agent's shutdown ends the wait (ok false, with its event).
func (w *worker) record() (e workerEvent, ok bool) {
	p, rec, ctx := w.node, w.rec, w.ctx
	for attempt := 1; ; attempt++ {
		err := w.writeIntent()
		if err == nil {
			p.cfg.Telemetry.Mark(rec.uid, telemetry.StepRecorded, time.Now())
			return workerEvent{}, true
		}
		delay := min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)
		w.log.Error(err, "Pod not recorded on the node; retrying", "attempt", attempt, "in", delay)
		p.event(w.pod, corev1.EventTypeWarning, ReasonFailedToRecordState,
			fmt.Sprintf("Could not record the pod on the node (retrying in %s; its VM starts once it is recorded): %v", delay.Round(time.Second), err))
		t := time.NewTimer(delay)
		select {
		case <-t.C:
		case <-rec.deleteReq:
			t.Stop()
			return workerEvent{kind: evDelete}, false
		case <-ctx.Done():
			t.Stop()
			return workerEvent{kind: evShutdown}, false
		}
	}
}

// writeIntent writes rec's state dir, pod.json (the pod as it is now) and
// status.json; a failed pod.json leaves no dir behind.
func (r *podRun) writeIntent() error {
	rec := r.rec
	pod := rec.podCopy()
	if err := os.MkdirAll(rec.dir, 0o700); err != nil {
		return fmt.Errorf("create state dir for pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	// Before QEMU's user may write the dir (exporter/flashdir.go).
	if err := exporter.MakeFlashDir(rec.dir); err != nil {
		os.RemoveAll(rec.dir)
		return fmt.Errorf("create state dir for pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if err := atomicfile.WriteJSON(filepath.Join(rec.dir, PodFileName), pod); err != nil {
		os.RemoveAll(rec.dir)
		return fmt.Errorf("record pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	r.persist()
	return nil
}

// waitRunning is stateRunning's step: wait for the VM's exit (recorded
// here), a request, a delete or the shutdown; and, until the run was Ready
// (ready), for the pod to turn Ready: at once when it is (no readiness or
// startup probe, or an adopted VM whose pod shows Ready), else when its
// probes' results change to Ready.
func (w *worker) waitRunning(ready bool) workerEvent {
	p, rec, ctx, vm := w.node, w.rec, w.ctx, w.rec.vm.get()
	var probed <-chan struct{}
	if !ready {
		if podstatus.Ready(p.withStatus(rec)) {
			return workerEvent{kind: evReady}
		}
		probed = w.probed
	}
	for exited := false; !exited; {
		select {
		case <-ctx.Done():
			return workerEvent{kind: evShutdown}
		case <-rec.deleteReq:
			return workerEvent{kind: evDelete}
		case req := <-rec.ctl:
			return w.request(req)
		case <-probed:
			if podstatus.Ready(p.withStatus(rec)) {
				return workerEvent{kind: evReady}
			}
		case f := <-w.probeFailed:
			w.failure = f
			return workerEvent{kind: evProbeFailed, current: f.vm == vm}
		case <-vm.Done():
			exited = true
		}
	}
	ex, _ := vm.Exit()
	st := rec.stateCopy()
	started := runStart(&st)
	rec.vm.set(nil)
	w.dropSnapshotClaim()
	term := podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(rec.uid))
	w.log.Info("VM exited", "exitCode", ex.ExitCode, "class", ex.Class, "reason", ex.Reason)
	p.cfg.Telemetry.VMExited(rec.uid, ex)
	typ := corev1.EventTypeNormal
	if ex.ExitCode != 0 {
		typ = corev1.EventTypeWarning
	}
	p.event(w.pod, typ, "VMExited", fmt.Sprintf("VM exited with code %d: %s", ex.ExitCode, ex.Reason))
	w.update(func(st *podstatus.VMState) { st.SetTerminated(term) })
	return workerEvent{kind: evExited, exitCode: term.ExitCode, reason: term.Reason,
		ranLong: ex.At.Sub(started) >= podstatus.CrashLoopResetAfter}
}

// do carries out the actions of a transition, in order.
func (w *worker) do(acts []workerAction) {
	rec, ctx := w.rec, w.ctx
	for _, a := range acts {
		switch a.kind {
		case actReply:
			w.req.reply <- nil
		case actRefuseFinished:
			w.req.refuse(errPodFinished)
		case actInstallImage:
			w.req.reply <- w.installFlash(w.req.flash)
		case actPowerOn:
			w.log.Info("Powering on on request")
			w.update(func(st *podstatus.VMState) { st.PoweredOff = false })
		case actOffInBackOff:
			w.update(func(st *podstatus.VMState) {
				st.SetWaiting(podstatus.ReasonPoweredOff, "powered off on request during the crash-loop back-off; power it on to boot again")
				st.PoweredOff = true
			})
			w.req.reply <- nil
		case actAwaitStart:
			w.waiter = w.req.reply
		case actAnswerStarted:
			w.answer(nil)
		case actAnswerStartError:
			w.answer(w.startError())
		case actAnswerFinished:
			w.answer(errPodFinished)
		case actAnswerDeleted:
			w.answer(errPodDeleted)
		case actBeginBackOff:
			w.beginBackOff(a.crash)
		case actCountRestart:
			rec.change(func(st *podstatus.VMState) { st.RestartCount++ })
		case actMarkFinal:
			w.update(func(st *podstatus.VMState) { st.Final = true })
		case actReleaseImage:
			w.releaseImage()
		case actStopExporter:
			rec.stopExporter()
		case actStartExporter:
			w.startExporter(ctx) // idempotent
		case actStartProbes:
			w.startProbes(ctx, rec.vm.get(), w.probed, w.probeFailed) // probes.go: end with this run
		case actEndBoot:
			w.endBoot() // podtelemetry.go
		case actSaveSnapshot:
			w.saveSnapshot(ctx, rec.vm.get()) // snapshots.go
		case actDetach:
			rec.vm.get().Detach()
		case actKill:
			w.kill()
		case actResize:
			w.req.reply <- w.recordSize(w.req.resize) // exporter.go
		default:
			panic(fmt.Sprintf("pod worker: unknown action %s", a))
		}
	}
}

// kill kills the VM for the failed probe taken (w.failure), as the
// kubelet kills a container: its exit is then the run's end.
func (w *worker) kill() {
	f := w.failure
	name := "vm"
	if len(w.pod.Spec.Containers) > 0 {
		name = w.pod.Spec.Containers[0].Name
	}
	w.log.Info("Killing the VM", "probe", f.kind, "msg", f.msg)
	w.node.event(w.pod, corev1.EventTypeNormal, "Killing", fmt.Sprintf("Container %s failed %s probe, will be restarted", name, strings.ToLower(f.kind)))
	w.rec.vm.get().Kill()
}

// beginBackOff starts the crash-loop back-off before the restart after
// crash number crash: CrashLoopBackOff with a timer, or, with no delay, the
// ended run becomes the last state at once.
func (w *worker) beginBackOff(crash int) {
	p, rec := w.node, w.rec
	delay := p.cfg.Backoff.RestartDelay(crash)
	if delay <= 0 {
		w.update(func(st *podstatus.VMState) { st.LastTerminated = st.Terminated })
		return
	}
	name := "vm"
	pod := rec.podCopy()
	if len(pod.Spec.Containers) > 0 {
		name = pod.Spec.Containers[0].Name
	}
	msg := podstatus.CrashLoopMessage(delay, name, string(rec.uid))
	w.update(func(st *podstatus.VMState) {
		st.LastTerminated = st.Terminated
		st.SetWaiting(podstatus.ReasonCrashLoopBackOff, msg)
	})
	p.event(pod, corev1.EventTypeWarning, "BackOff", "Back-off restarting failed VM")
	w.stopBackOff()
	w.backoff = time.NewTimer(delay)
}

func (r *podRun) deleteRequested() bool {
	rec := r.rec
	select {
	case <-rec.deleteReq:
		return true
	default:
		return false
	}
}
