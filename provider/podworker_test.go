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

func ev(k eventKind) workerEvent { return workerEvent{kind: k} }
func evReq(op vmOp) workerEvent  { return workerEvent{kind: evRequest, op: op} }
func evExit(code int32, reason string, ranLong bool) workerEvent {
	return workerEvent{kind: evExited, exitCode: code, reason: reason, ranLong: ranLong}
}
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
		{"started", podWorker{stateStarting, 2, always}, ev(evStarted), stateRunning, 2, "AnswerStarted,StartProbes,ExporterIfReady"},
		{"start failed, Always: back-off", podWorker{stateStarting, 0, always}, evStartFail(podstatus.ReasonStartError), stateBackOff, 1, "AnswerStartError,BeginBackOff(1)"},
		{"start failed, crash counted on", podWorker{stateStarting, 3, always}, evStartFail(podstatus.ReasonStartError), stateBackOff, 4, "AnswerStartError,BeginBackOff(4)"},
		{"start failed, OnFailure: back-off", podWorker{stateStarting, 0, onFailure}, evStartFail(podstatus.ReasonStartError), stateBackOff, 1, "AnswerStartError,BeginBackOff(1)"},
		{"start failed, Never: finished", podWorker{stateStarting, 0, never}, evStartFail(podstatus.ReasonStartError), stateFinished, 0, "AnswerStartError,MarkFinal,ReleaseImage,AnswerFinished,StopExporter"},
		{"invalid spec never restarts", podWorker{stateStarting, 0, always}, evStartFail(podstatus.ReasonInvalidVMSpec), stateFinished, 0, "AnswerStartError,MarkFinal,ReleaseImage,AnswerFinished,StopExporter"},
		{"delete while starting", podWorker{stateStarting, 1, always}, ev(evDelete), stateTerminating, 1, "AnswerDeleted"},
		{"shutdown while starting", podWorker{stateStarting, 0, always}, ev(evShutdown), stateDetached, 0, ""},
		{"starting takes no request", podWorker{stateStarting, 0, always}, evReq(opPowerOff), stateStarting, 0, ""},

		// Running: the VM's exit and the restart policy.
		{"exit 0, Always: back-off", podWorker{stateRunning, 0, always}, evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 1, Always: back-off", podWorker{stateRunning, 2, always}, evExit(1, "Error", false), stateBackOff, 3, "BeginBackOff(3)"},
		{"long run resets the crash count", podWorker{stateRunning, 5, always}, evExit(1, "Error", true), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 0, OnFailure: finished", podWorker{stateRunning, 0, onFailure}, evExit(0, "Completed", false), stateFinished, 0, "MarkFinal,ReleaseImage,AnswerFinished,StopExporter"},
		{"exit 1, OnFailure: back-off", podWorker{stateRunning, 0, onFailure}, evExit(1, "Error", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"exit 1, Never: finished", podWorker{stateRunning, 0, never}, evExit(1, "Error", false), stateFinished, 0, "MarkFinal,ReleaseImage,AnswerFinished,StopExporter"},
		{"unset policy is Always", podWorker{stateRunning, 0, ""}, evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"delete while running", podWorker{stateRunning, 0, always}, ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown while running detaches", podWorker{stateRunning, 0, always}, ev(evShutdown), stateDetached, 0, "Detach"},
		{"power on while running", podWorker{stateRunning, 0, always}, evReq(opPowerOn), stateRunning, 0, "Reply"},
		{"power off while running", podWorker{stateRunning, 0, always}, evReq(opPowerOff), statePoweringOff, 0, ""},
		{"flash while running", podWorker{stateRunning, 0, always}, evReq(opFlash), stateFlashing, 0, ""},

		// Power off and flash of a running VM.
		{"powered off", podWorker{statePoweringOff, 2, always}, ev(evStopped), statePoweredOff, 2, "StartExporter"},
		{"power off failed: still running", podWorker{statePoweringOff, 0, always}, ev(evStopFailed), stateRunning, 0, "StartProbes,ExporterIfReady"},
		{"flashed: boot the new image", podWorker{stateFlashing, 0, always}, ev(evFlashed), stateStarting, 0, ""},
		{"flash: stop failed", podWorker{stateFlashing, 0, always}, ev(evStopFailed), stateRunning, 0, "StartProbes,ExporterIfReady"},
		{"flash: install failed, stays off", podWorker{stateFlashing, 0, always}, ev(evFlashFailed), statePoweredOff, 0, "StartExporter"},

		// Crash-loop back-off.
		{"back-off over: restart", podWorker{stateBackOff, 3, always}, ev(evBackOffDone), stateStarting, 3, "CountRestart"},
		{"delete during back-off", podWorker{stateBackOff, 3, always}, ev(evDelete), stateTerminating, 3, "AnswerDeleted"},
		{"shutdown during back-off", podWorker{stateBackOff, 3, always}, ev(evShutdown), stateDetached, 3, ""},
		{"power on during back-off: start now", podWorker{stateBackOff, 3, always}, evReq(opPowerOn), stateStarting, 3, "AwaitStart,CountRestart"},
		{"power off during back-off: stay off", podWorker{stateBackOff, 3, always}, evReq(opPowerOff), statePoweredOff, 3, "OffInBackOff,StartExporter"},
		{"flash during back-off: install, keep waiting", podWorker{stateBackOff, 3, always}, evReq(opFlash), stateBackOff, 3, "InstallImage"},

		// Powered off on request.
		{"power on", podWorker{statePoweredOff, 4, always}, evReq(opPowerOn), stateStarting, 0, "PowerOn,AwaitStart"},
		{"power off when off", podWorker{statePoweredOff, 0, always}, evReq(opPowerOff), statePoweredOff, 0, "Reply"},
		{"flash when off", podWorker{statePoweredOff, 0, always}, evReq(opFlash), statePoweredOff, 0, "InstallImage"},
		{"delete when off", podWorker{statePoweredOff, 0, always}, ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown when off", podWorker{statePoweredOff, 0, always}, ev(evShutdown), stateDetached, 0, ""},

		// Recovery found the VM ended.
		{"recovered exit, Always", podWorker{stateExited, 0, always}, evExit(0, "Completed", false), stateBackOff, 1, "BeginBackOff(1)"},
		{"recovered exit, Never", podWorker{stateExited, 0, never}, evExit(137, "Error", false), stateFinished, 0, "MarkFinal,ReleaseImage,AnswerFinished,StopExporter"},
		{"recovered unreachable QEMU, OnFailure", podWorker{stateExited, 0, onFailure}, evExit(128, podstatus.ReasonStartError, false), stateBackOff, 1, "BeginBackOff(1)"},
		{"delete before the recovered exit is handled", podWorker{stateExited, 0, always}, ev(evDelete), stateTerminating, 0, "AnswerDeleted"},

		// Finished: only the delete.
		{"finished refuses power on", podWorker{stateFinished, 0, never}, evReq(opPowerOn), stateFinished, 0, "RefuseFinished"},
		{"finished refuses flash", podWorker{stateFinished, 0, never}, evReq(opFlash), stateFinished, 0, "RefuseFinished"},
		{"delete when finished", podWorker{stateFinished, 0, never}, ev(evDelete), stateTerminating, 0, "AnswerDeleted"},
		{"shutdown when finished", podWorker{stateFinished, 0, never}, ev(evShutdown), stateDetached, 0, ""},

		// Terminating and the ends.
		{"deleted", podWorker{stateTerminating, 0, always}, ev(evDeleted), stateTerminated, 0, ""},
		{"second delete while terminating", podWorker{stateTerminating, 0, always}, ev(evDelete), stateTerminating, 0, ""},
		{"nothing after terminated", podWorker{stateTerminated, 0, always}, ev(evDelete), stateTerminated, 0, ""},
		{"nothing after detached", podWorker{stateDetached, 0, always}, ev(evStarted), stateDetached, 0, ""},
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
		{recoveredFacts{vm: true}, stateRunning, "StartProbes,ExporterIfReady"},
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
	for k := evDelete; k <= evDeleted; k++ {
		assert.NotContains(t, k.String(), "eventKind(", fmt.Sprint("event ", int(k)))
	}
	for k := actReply; k <= actDetach; k++ {
		assert.NotContains(t, k.String(), "actionKind(", fmt.Sprint("action ", int(k)))
	}
}
