package provider

import (
	"fmt"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
)

// acts renders actions as "A,B(n),C" for the tables.
func actsString(acts []workerAction) string {
	s := make([]string, len(acts))
	for i, a := range acts {
		s[i] = a.String()
	}
	return strings.Join(s, ",")
}

// pw is a worker in state s after crashes crashes, under policy, whose
// current run was not Ready yet.
func pw(s podState, crashes int, policy corev1.RestartPolicy) podWorker {
	return podWorker{state: s, crashes: crashes, policy: policy}
}

// wasReady is w with its current run having been Ready.
func wasReady(w podWorker) podWorker { w.ready = true; return w }

func ev(k eventKind) workerEvent { return workerEvent{kind: k} }
func evReq(op vmOp) workerEvent  { return workerEvent{kind: evRequest, op: op} }
func evExit(code int32, reason string, ranLong bool) workerEvent {
	return workerEvent{kind: evExited, exitCode: code, reason: reason, ranLong: ranLong}
}
func evProbe(current bool) workerEvent { return workerEvent{kind: evProbeFailed, current: current} }
func evStartFail(reason string) workerEvent {
	return workerEvent{kind: evStartFailed, exitCode: 128, reason: reason}
}

// Every transition the worker makes, one row each.
func TestPodWorkerTransitions(t *testing.T) {
	const (
		always    = corev1.RestartPolicyAlways
		onFailure = corev1.RestartPolicyOnFailure
		never     = corev1.RestartPolicyNever
	)
	for _, tc := range []struct {
		name        string
		from        podWorker
		e           workerEvent
		to          podState
		crashes     int
		wantActions string
	}{
		// Starting: pull and start.
		{"started", pw(stateStarting, 2, always), ev(evStarted), stateRunning, 2, "AnswerStarted,StartProbes"},
		{"start failed, Always: back-off", pw(stateStarting, 0, always), evStartFail(podstatus.ReasonStartError), stateBackOff, 1, "AnswerStartError,BeginBackOff(1)"},
		{"start failed, crash counted on", pw(stateStarting, 3, always), evStartFail(podstatus.ReasonStartError), stateBackOff, 4, "AnswerStartError,BeginBackOff(4)"},
		{"start failed, OnFailure: back-off", pw(stateStarting, 0, onFailure), evStartFail(podstatus.ReasonStartError), stateBackOff, 1, "AnswerStartError,BeginBackOff(1)"},
		{"start failed, Never: finished", pw(stateStarting, 0, never), evStartFail(podstatus.ReasonStartError), stateFinished, 0, "AnswerStartError,ReleaseImage,MarkFinal,AnswerFinished,StopExporter"},
		{"invalid spec never restarts", pw(stateStarting, 0, always), evStartFail(podstatus.ReasonInvalidVMSpec), stateFinished, 0, "AnswerStartError,ReleaseImage,MarkFinal,AnswerFinished,StopExporter"},
		{"delete while starting", pw(stateStarting, 1, always), ev(evDelete), stateTerminating, 1, "AnswerDeleted"},
		{"shutdown while starting", pw(stateStarting, 0, always), ev(evShutdown), stateDetached, 0, ""},
		{"starting takes no request", pw(stateStarting, 0, always), evReq(opPowerOff), stateStarting, 0, ""},
		{"starting takes no resize", pw(stateStarting, 0, always), evReq(opResize), stateStarting, 0, ""},
		{"powering off takes no resize", pw(statePoweringOff, 0, always), evReq(opResize), statePoweringOff, 0, ""},

		// Running: the VM's exit and the restart policy.
		{"exit 0, Always: back-off", pw(stateRunning, 0, always), evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 1, Always: back-off", pw(stateRunning, 2, always), evExit(1, "Error", false), stateBackOff, 3, "BeginBackOff(3)"},
		{"long run resets the crash count", pw(stateRunning, 5, always), evExit(1, "Error", true), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 0, OnFailure: finished", pw(stateRunning, 0, onFailure), evExit(0, "Completed", false), stateFinished, 0, "ReleaseImage,MarkFinal,AnswerFinished,StopExporter"},
		{"exit 1, OnFailure: back-off", pw(stateRunning, 0, onFailure), evExit(1, "Error", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 1, Never: finished", pw(stateRunning, 0, never), evExit(1, "Error", false), stateFinished, 0, "ReleaseImage,MarkFinal,AnswerFinished,StopExporter"},
		{"unset policy is Always", pw(stateRunning, 0, ""), evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"delete while running", pw(stateRunning, 0, always), ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown while running detaches", pw(stateRunning, 0, always), ev(evShutdown), stateDetached, 0, "Detach"},
		{"power on while running", pw(stateRunning, 0, always), evReq(opPowerOn), stateRunning, 0, "Reply"},
		{"power off while running", pw(stateRunning, 0, always), evReq(opPowerOff), statePoweringOff, 0, ""},
		{"flash while running", pw(stateRunning, 0, always), evReq(opFlash), stateFlashing, 0, ""},
		{"reset while running: stop, reset, start", pw(stateRunning, 0, always), evReq(opReset), stateFlashing, 0, ""},
		{"resize while running: for the next start", wasReady(pw(stateRunning, 1, always)), evReq(opResize), stateRunning, 1, "Resize"},

		// Running: the run's first Ready ends the boot and starts the exporter.
		{"first Ready: boot over, exporter on", pw(stateRunning, 1, always), ev(evReady), stateRunning, 1, "EndBoot,SaveSnapshot,StartExporter"},
		{"Ready again in the same run", wasReady(pw(stateRunning, 0, always)), ev(evReady), stateRunning, 0, ""},
		{"exit after Ready: back-off", wasReady(pw(stateRunning, 0, always)), evExit(1, "Error", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"Ready ignored while starting", pw(stateStarting, 0, always), ev(evReady), stateStarting, 0, ""},
		{"Ready ignored while powering off", pw(statePoweringOff, 0, always), ev(evReady), statePoweringOff, 0, ""},
		{"Ready ignored when off", pw(statePoweredOff, 0, always), ev(evReady), statePoweredOff, 0, ""},
		{"Ready ignored when finished", pw(stateFinished, 0, never), ev(evReady), stateFinished, 0, ""},

		// Running: a failed liveness or startup probe has the worker kill
		// the VM (its exit then goes through the restart policy); only the
		// running VM's probes count.
		{"liveness failure kills the VM", pw(stateRunning, 1, always), evProbe(true), stateRunning, 1, "Kill"},
		{"liveness failure after Ready kills the VM", wasReady(pw(stateRunning, 0, always)), evProbe(true), stateRunning, 0, "Kill"},
		{"an ended run's probe failure is stale", pw(stateRunning, 0, always), evProbe(false), stateRunning, 0, ""},
		{"probe failure ignored while powering off", pw(statePoweringOff, 0, always), evProbe(true), statePoweringOff, 0, ""},
		{"probe failure ignored during back-off", pw(stateBackOff, 1, always), evProbe(true), stateBackOff, 1, ""},

		// Power off and flash of a running VM.
		{"powered off", pw(statePoweringOff, 2, always), ev(evStopped), statePoweredOff, 2, "StartExporter"},
		{"power off failed: still running", pw(statePoweringOff, 0, always), ev(evStopFailed), stateRunning, 0, "StartProbes"},
		{"flashed: boot the new image", pw(stateFlashing, 0, always), ev(evFlashed), stateStarting, 0, ""},
		{"flash: stop failed", pw(stateFlashing, 0, always), ev(evStopFailed), stateRunning, 0, "StartProbes"},
		{"flash: install failed, stays off", pw(stateFlashing, 0, always), ev(evFlashFailed), statePoweredOff, 0, "StartExporter"},

		// Crash-loop back-off.
		{"back-off over: restart", pw(stateBackOff, 3, always), ev(evBackOffDone), stateStarting, 3, "CountRestart"},
		{"delete during back-off", pw(stateBackOff, 3, always), ev(evDelete), stateTerminating, 3, "AnswerDeleted"},
		{"shutdown during back-off", pw(stateBackOff, 3, always), ev(evShutdown), stateDetached, 3, ""},
		{"power on during back-off: start now", pw(stateBackOff, 3, always), evReq(opPowerOn), stateStarting, 3, "AwaitStart,CountRestart"},
		{"power off during back-off: stay off", pw(stateBackOff, 3, always), evReq(opPowerOff), statePoweredOff, 3, "OffInBackOff,StartExporter"},
		{"flash during back-off: install, keep waiting", pw(stateBackOff, 3, always), evReq(opFlash), stateBackOff, 3, "InstallImage"},
		{"reset during back-off: reset, start now", pw(stateBackOff, 3, always), evReq(opReset), stateFlashing, 0, ""},
		{"resize during back-off: the restart's size", pw(stateBackOff, 3, always), evReq(opResize), stateBackOff, 3, "Resize"},

		// Powered off on request.
		{"power on", pw(statePoweredOff, 4, always), evReq(opPowerOn), stateStarting, 0, "PowerOn,AwaitStart"},
		{"power off when off", pw(statePoweredOff, 0, always), evReq(opPowerOff), statePoweredOff, 0, "Reply"},
		{"flash when off", pw(statePoweredOff, 0, always), evReq(opFlash), statePoweredOff, 0, "InstallImage"},
		{"reset when off: reset, power on", pw(statePoweredOff, 2, always), evReq(opReset), stateFlashing, 0, ""},
		{"resize when off: the next power on's size", pw(statePoweredOff, 0, always), evReq(opResize), statePoweredOff, 0, "Resize"},
		{"delete when off", pw(statePoweredOff, 0, always), ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown when off", pw(statePoweredOff, 0, always), ev(evShutdown), stateDetached, 0, ""},

		// Recovery found the VM ended.
		{"recovered exit, Always", pw(stateExited, 0, always), evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"recovered exit, Never", pw(stateExited, 0, never), evExit(137, "Error", false), stateFinished, 0, "ReleaseImage,MarkFinal,AnswerFinished,StopExporter"},
		{"recovered unreachable QEMU, OnFailure", pw(stateExited, 0, onFailure), evExit(128, podstatus.ReasonStartError, false), stateBackOff, 1, "BeginBackOff(1)"},
		{"delete before the recovered exit is handled", pw(stateExited, 0, always), ev(evDelete), stateTerminating, 0, "AnswerDeleted"},

		// Finished: only the delete.
		{"finished refuses power on", pw(stateFinished, 0, never), evReq(opPowerOn), stateFinished, 0, "RefuseFinished"},
		{"finished refuses flash", pw(stateFinished, 0, never), evReq(opFlash), stateFinished, 0, "RefuseFinished"},
		{"finished refuses reset", pw(stateFinished, 0, never), evReq(opReset), stateFinished, 0, "RefuseFinished"},
		{"finished refuses power off", pw(stateFinished, 0, never), evReq(opPowerOff), stateFinished, 0, "RefuseFinished"},
		{"finished refuses resize", pw(stateFinished, 0, never), evReq(opResize), stateFinished, 0, "RefuseFinished"},
		{"delete when finished", pw(stateFinished, 0, never), ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown when finished", pw(stateFinished, 0, never), ev(evShutdown), stateDetached, 0, ""},

		// Terminating and the ends.
		{"deleted", pw(stateTerminating, 0, always), ev(evDeleted), stateTerminated, 0, ""},
		{"second delete while terminating", pw(stateTerminating, 0, always), ev(evDelete), stateTerminating, 0, ""},
		{"nothing after terminated", pw(stateTerminated, 0, always), ev(evDelete), stateTerminated, 0, ""},
		{"nothing after detached", pw(stateDetached, 0, always), ev(evStarted), stateDetached, 0, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, acts := next(tc.from, tc.e)
			assert.Equal(t, tc.to, got.state, "state after %s in %s", tc.e.kind, tc.from.state)
			assert.Equal(t, tc.crashes, got.crashes, "crash count")
			assert.Equal(t, tc.from.policy, got.policy, "the policy never changes")
			assert.Equal(t, tc.wantActions, actsString(acts))
		})
	}
}

func TestPodWorkerInitialState(t *testing.T) {
	for _, tc := range []struct {
		f    recoveredFacts
		want podState
		acts string
	}{
		{recoveredFacts{}, stateStarting, ""},
		{recoveredFacts{vm: true}, stateRunning, "StartProbes"},
		{recoveredFacts{pendingExit: true}, stateExited, ""},
		{recoveredFacts{poweredOff: true}, statePoweredOff, "StartExporter"},
		{recoveredFacts{final: true}, stateFinished, "AnswerFinished,StopExporter"},
		{recoveredFacts{final: true, poweredOff: true}, stateFinished, "AnswerFinished,StopExporter"},
	} {
		w, acts := initialWorker(corev1.RestartPolicyAlways, tc.f)
		assert.Equal(t, tc.want, w.state, "%+v", tc.f)
		assert.Equal(t, tc.acts, actsString(acts), "%+v", tc.f)
		assert.Zero(t, w.crashes)
	}
}

// Sequences of events as the worker meets them: the crash loop under each
// restart policy, and the back-off delay's growth.
func TestPodWorkerCrashLoop(t *testing.T) {
	run := func(policy corev1.RestartPolicy, code int32, n int) (podState, []string) {
		w, _ := initialWorker(policy, recoveredFacts{})
		var backoffs []string
		for i := 0; i < n && !w.state.ended() && w.state != stateFinished; i++ {
			var acts []workerAction
			w, _ = next(w, ev(evStarted))
			w, acts = next(w, evExit(code, "Error", false))
			for _, a := range acts {
				if a.kind == actBeginBackOff {
					backoffs = append(backoffs, a.String())
				}
			}
			if w.state == stateBackOff {
				w, _ = next(w, ev(evBackOffDone))
			}
		}
		return w.state, backoffs
	}
	st, b := run(corev1.RestartPolicyAlways, 1, 4)
	assert.Equal(t, stateStarting, st)
	assert.Equal(t, []string{"BeginBackOff(1)", "BeginBackOff(2)", "BeginBackOff(3)", "BeginBackOff(4)"}, b)
	st, b = run(corev1.RestartPolicyAlways, 0, 2)
	assert.Equal(t, stateStarting, st, "Always restarts a clean exit")
	assert.Len(t, b, 2)
	st, b = run(corev1.RestartPolicyOnFailure, 1, 3)
	assert.Equal(t, stateStarting, st)
	assert.Len(t, b, 3)
	st, b = run(corev1.RestartPolicyOnFailure, 0, 3)
	assert.Equal(t, stateFinished, st, "OnFailure stops after a clean exit")
	assert.Empty(t, b)
	st, b = run(corev1.RestartPolicyNever, 1, 3)
	assert.Equal(t, stateFinished, st)
	assert.Empty(t, b)
}

// Every state has a name, and every state the worker can be in handles
// delete and shutdown: the worker can always be ended.
func TestPodWorkerAlwaysEnds(t *testing.T) {
	for s := stateStarting; s <= stateDetached; s++ {
		assert.NotContains(t, s.String(), "podState(", "state %d has a name", int(s))
		if s.ended() {
			continue
		}
		w, _ := next(podWorker{state: s}, ev(evDelete))
		if s != stateTerminating {
			assert.Equal(t, stateTerminating, w.state, "delete in %s", s)
		}
		w, _ = next(w, ev(evDeleted))
		assert.Equal(t, stateTerminated, w.state, "deleted after %s", s)
		w, _ = next(podWorker{state: s}, ev(evShutdown))
		assert.Equal(t, stateDetached, w.state, "shutdown in %s", s)
	}
	for k := evDelete; k <= evProbeFailed; k++ {
		assert.NotContains(t, k.String(), "eventKind(", fmt.Sprint("event ", int(k)))
	}
	for k := actReply; k <= actResize; k++ {
		assert.NotContains(t, k.String(), "actionKind(", fmt.Sprint("action ", int(k)))
	}
}

// The run's Ready as the worker meets it: a run's first Ready ends its
// boot and starts the exporter, once; a failed power off keeps the run
// (and its Ready); every new run (restart, power on, flash) waits for its
// own first Ready.
func TestPodWorkerReadyPerRun(t *testing.T) {
	firstReady := "EndBoot,SaveSnapshot,StartExporter"
	w, _ := initialWorker(corev1.RestartPolicyAlways, recoveredFacts{})
	w, _ = next(w, ev(evStarted))
	assert.False(t, w.ready, "a started run is not Ready yet")
	w, acts := next(w, ev(evReady))
	assert.Equal(t, firstReady, actsString(acts))
	assert.True(t, w.ready)
	_, acts = next(w, ev(evReady))
	assert.Empty(t, acts, "one first Ready per run")

	// A power off that fails leaves the same run running.
	w, _ = next(w, evReq(opPowerOff))
	w, _ = next(w, ev(evStopFailed))
	assert.Equal(t, stateRunning, w.state)
	assert.True(t, w.ready, "the run goes on: no second first Ready")

	// A crash and restart: the new run waits for its own Ready.
	w, _ = next(w, evExit(1, "Error", false))
	assert.True(t, w.ready, "the back-off keeps what the ended run saw")
	w, _ = next(w, ev(evBackOffDone))
	assert.Equal(t, stateStarting, w.state)
	assert.False(t, w.ready, "a new run")
	w, _ = next(w, ev(evStarted))
	_, acts = next(w, ev(evReady))
	assert.Equal(t, firstReady, actsString(acts))

	// Power on and flash start new runs too.
	off := wasReady(pw(statePoweredOff, 0, corev1.RestartPolicyAlways))
	on, _ := next(off, evReq(opPowerOn))
	assert.False(t, on.ready, "power on: a new run")
	fl, _ := next(wasReady(pw(stateFlashing, 0, corev1.RestartPolicyAlways)), ev(evFlashed))
	assert.False(t, fl.ready, "flashed: a new run")

	// A recovered running VM is a run this worker has not seen Ready.
	rw, _ := initialWorker(corev1.RestartPolicyAlways, recoveredFacts{vm: true})
	_, acts = next(rw, ev(evReady))
	assert.Equal(t, firstReady, actsString(acts))
}
