package provider

import (
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
)

// The pod worker as a state machine, like the kubelet's pod workers: one
// goroutine per pod (run, in worker.go) owns the pod's VM; it waits in
// the current state for the next event (a step: start the VM, wait for its
// exit, a request, the back-off timer, a delete), asks next what that event
// means, and carries out the actions next returns. next is pure: every
// decision the worker makes is one of its transitions (podworker_test.go
// lists them all); the steps and actions only do what they are told.
// docs/architecture.md draws the machine.

// podState is the state of a pod's worker.
type podState int

const (
	// stateStarting: no VM; wait until the pod is confirmed (recovery),
	// hold while it needs a disabled feature (features.go), pull the image
	// (ErrImagePull / ImagePullBackOff), wait for its config
	// (CreateContainerConfigError), make the overlay (or restore a memory
	// snapshot: snapshots.go) and start QEMU.
	stateStarting podState = iota + 1
	// stateRunning: the VM runs: wait for its exit, a request, a delete,
	// and (until the run was Ready) for the pod to turn Ready.
	stateRunning
	// stateExited: recovery found the VM ended while nobody watched (its
	// Terminated is in the state): the restart policy still applies.
	stateExited
	// stateBackOff: the VM ended and restarts after the crash-loop back-off
	// (CrashLoopBackOff; no wait when the delay is 0).
	stateBackOff
	// statePoweredOff: powered off on request: nothing runs and the restart
	// policy does not apply; wait for power on, flash or delete.
	statePoweredOff
	// statePoweringOff: a requested power off is stopping the VM.
	statePoweringOff
	// stateFlashing: a flash request is stopping the VM and installing the
	// new image; a reset request (from Running, BackOff or PoweredOff)
	// stops the VM if one runs and installs the pod's own definition.
	stateFlashing
	// stateFinished: the VM will not run again (restart policy, invalid
	// spec, rejected by this build): wait for the delete.
	stateFinished
	// stateTerminating: the pod is deleted: stop the VM, clean up, forget
	// the pod (finishDelete).
	stateTerminating
	// stateTerminated: the pod is gone; the worker has ended.
	stateTerminated
	// stateDetached: the agent is shutting down; the worker has ended and
	// the VM keeps running for the next agent to adopt (recovery.go).
	stateDetached
)

var podStateNames = map[podState]string{
	stateStarting: "Starting", stateRunning: "Running", stateExited: "Exited",
	stateBackOff: "BackOff", statePoweredOff: "PoweredOff", statePoweringOff: "PoweringOff",
	stateFlashing: "Flashing", stateFinished: "Finished", stateTerminating: "Terminating",
	stateTerminated: "Terminated", stateDetached: "Detached",
}

func (s podState) String() string {
	if n, ok := podStateNames[s]; ok {
		return n
	}
	return fmt.Sprintf("podState(%d)", int(s))
}

// ended: the worker has nothing more to do.
func (s podState) ended() bool { return s == stateTerminated || s == stateDetached }

// eventKind is what a step of the worker observed.
type eventKind int

const (
	// evDelete: DeletePod was called.
	evDelete eventKind = iota + 1
	// evShutdown: the agent is stopping (the provider's context ended).
	evShutdown
	// evStarted: QEMU started (stateStarting).
	evStarted
	// evStartFailed: the start failed, recorded as a terminated run (exit
	// code 128, reason StartError or InvalidVMSpec).
	evStartFailed
	// evExited: the VM ended (stateRunning), or recovery found it ended
	// (stateExited); its Terminated is recorded.
	evExited
	// evBackOffDone: the crash-loop back-off is over.
	evBackOffDone
	// evRequest: a power, flash or resize request (package exporter) arrived; what
	// it means is next's (only Running, BackOff and PoweredOff serve one,
	// Finished refuses it, the other states leave it waiting).
	evRequest
	// evStopped: the requested power off stopped the VM.
	evStopped
	// evStopFailed: the VM did not stop (power off or flash).
	evStopFailed
	// evFlashed: the VM is off and the flashed image installed.
	evFlashed
	// evFlashFailed: the VM is off but the image could not be installed.
	evFlashFailed
	// evDeleted: finishDelete is done.
	evDeleted
	// evReady: the pod is Ready (stateRunning): its probes' results made
	// it so, or it has no readiness or startup probe and the VM runs.
	evReady
	// evProbeFailed: a liveness or startup probe failed (stateRunning):
	// the VM is to be killed; its exit follows as evExited. current: the
	// failing probe is of the VM running now (else an ended run's, stale).
	evProbeFailed
)

var eventKindNames = map[eventKind]string{
	evDelete: "Delete", evShutdown: "Shutdown", evStarted: "Started", evStartFailed: "StartFailed",
	evExited: "Exited", evBackOffDone: "BackOffDone", evRequest: "Request", evStopped: "Stopped",
	evStopFailed: "StopFailed", evFlashed: "Flashed", evFlashFailed: "FlashFailed", evDeleted: "Deleted",
	evReady: "Ready", evProbeFailed: "ProbeFailed",
}

func (k eventKind) String() string {
	if n, ok := eventKindNames[k]; ok {
		return n
	}
	return fmt.Sprintf("eventKind(%d)", int(k))
}

// workerEvent is one event, as plain data.
type workerEvent struct {
	kind eventKind
	// op is the request's (evRequest).
	op vmOp
	// exitCode and reason are the run's end (evStartFailed, evExited).
	exitCode int32
	reason   string
	// ranLong: the run lasted at least CrashLoopResetAfter (evExited from
	// a running VM): the crash count starts again.
	ranLong bool
	// current: the event is of the VM running now (evProbeFailed).
	current bool
}

// actionKind is one thing the worker does on a transition.
type actionKind int

const (
	// actReply answers the request with nil (already in the asked state).
	actReply actionKind = iota + 1
	// actRefuseFinished answers the request with errPodFinished.
	actRefuseFinished
	// actInstallImage installs the flashed image (no VM runs) and answers
	// the request with the result.
	actInstallImage
	// actPowerOn clears PoweredOff: the next start boots the VM.
	actPowerOn
	// actOffInBackOff: a power off during the back-off: show PoweredOff, answer
	// the request.
	actOffInBackOff
	// actAwaitStart: the request is answered by the next start's result.
	actAwaitStart
	// actAnswerStarted answers the waiting request: started.
	actAnswerStarted
	// actAnswerStartError answers the waiting request with the failed
	// start's error.
	actAnswerStartError
	// actAnswerFinished answers the waiting request with errPodFinished.
	actAnswerFinished
	// actAnswerDeleted answers the waiting request with errPodDeleted.
	actAnswerDeleted
	// actBeginBackOff starts the crash-loop back-off for crash number n:
	// CrashLoopBackOff and a timer when its delay is > 0.
	actBeginBackOff
	// actCountRestart adds one to the container's restart count.
	actCountRestart
	// actMarkFinal records that the VM never runs again.
	actMarkFinal
	// actReleaseImage gives up the pod's hold on its image.
	actReleaseImage
	// actStopExporter stops the pod's exporter (nothing to power on).
	actStopExporter
	// actStartExporter starts the pod's exporter (idempotent).
	actStartExporter
	// actStartProbes starts this run's probes (probes.go).
	actStartProbes
	// actEndBoot ends the run's boot span: the pod is Ready (podtelemetry.go).
	actEndBoot
	// actSaveSnapshot saves the memory snapshot the run owes at its ready
	// point (a snapshot-start pod's creator, snapshots.go; none owed:
	// nothing), the guest paused meanwhile.
	actSaveSnapshot
	// actDetach lets go of the VM, which keeps running.
	actDetach
	// actKill kills the VM at once (a failed liveness or startup probe,
	// with the kubelet's Killing event).
	actKill
	// actResize checks and records the size the request asks for (its
	// next starts apply it) and answers the request with the result.
	actResize
)

var actionKindNames = map[actionKind]string{
	actReply: "Reply", actRefuseFinished: "RefuseFinished", actInstallImage: "InstallImage",
	actPowerOn: "PowerOn", actOffInBackOff: "OffInBackOff", actAwaitStart: "AwaitStart",
	actAnswerStarted: "AnswerStarted", actAnswerStartError: "AnswerStartError",
	actAnswerFinished: "AnswerFinished", actAnswerDeleted: "AnswerDeleted",
	actBeginBackOff: "BeginBackOff", actCountRestart: "CountRestart", actMarkFinal: "MarkFinal",
	actReleaseImage: "ReleaseImage", actStopExporter: "StopExporter", actStartExporter: "StartExporter",
	actStartProbes: "StartProbes", actEndBoot: "EndBoot", actSaveSnapshot: "SaveSnapshot", actDetach: "Detach", actKill: "Kill",
	actResize: "Resize",
}

func (k actionKind) String() string {
	if n, ok := actionKindNames[k]; ok {
		return n
	}
	return fmt.Sprintf("actionKind(%d)", int(k))
}

// workerAction is one action, as plain data.
type workerAction struct {
	kind actionKind
	// crash is the crash number (actBeginBackOff): its back-off delay is
	// Backoff.RestartDelay(crash).
	crash int
}

func (a workerAction) String() string {
	if a.kind == actBeginBackOff {
		return fmt.Sprintf("%s(%d)", a.kind, a.crash)
	}
	return a.kind.String()
}

// podWorker is the worker's state as plain data: next's input and output.
type podWorker struct {
	state podState
	// crashes counts the runs that ended in a row (the back-off's exponent);
	// reset by a run that lasted CrashLoopResetAfter and by a power on.
	crashes int
	// policy is the pod's restart policy.
	policy corev1.RestartPolicy
	// ready: the current run of the VM was Ready (evReady); a new run
	// (stateStarting) clears it. Until it is set, stateRunning waits for
	// the pod to turn Ready too.
	ready bool
}

// recoveredFacts is what the worker knows of its pod when it starts.
type recoveredFacts struct {
	final, vm, pendingExit, poweredOff bool
}

// initialWorker is the state a worker starts in, with the actions of
// entering it: a new pod starts; recovery (recovery.go) finds the VM
// running (adopted), ended (pendingExit), powered off, or the pod
// finished. Pure.
func initialWorker(policy corev1.RestartPolicy, f recoveredFacts) (podWorker, []workerAction) {
	w := podWorker{policy: policy}
	switch {
	case f.final:
		return w.enter(stateFinished)
	case f.vm:
		return w.enter(stateRunning)
	case f.pendingExit:
		return w.enter(stateExited)
	case f.poweredOff:
		return w.enter(statePoweredOff)
	}
	return w.enter(stateStarting)
}

// enter moves to s with the actions every entry into s takes.
func (w podWorker) enter(s podState, acts ...workerAction) (podWorker, []workerAction) {
	w.state = s
	switch s {
	case stateStarting:
		w.ready = false
	case stateRunning:
		acts = append(acts, act(actStartProbes))
	case statePoweredOff:
		acts = append(acts, act(actStartExporter))
	case stateFinished:
		acts = append(acts, act(actAnswerFinished), act(actStopExporter))
	case stateTerminating:
		acts = append(acts, act(actAnswerDeleted))
	}
	return w, acts
}

func act(k actionKind) workerAction { return workerAction{kind: k} }

// next is the worker's transition: what event e in w's state leads to and
// what the worker does on the way. An event a state does not expect leaves
// it unchanged with no action. Pure.
func next(w podWorker, e workerEvent) (podWorker, []workerAction) {
	if w.state.ended() {
		return w, nil
	}
	switch e.kind {
	case evDelete:
		if w.state == stateTerminating {
			return w, nil
		}
		return w.enter(stateTerminating)
	case evShutdown:
		if w.state == stateRunning {
			return w.enter(stateDetached, act(actDetach))
		}
		return w.enter(stateDetached)
	}
	switch w.state {
	case stateStarting:
		switch e.kind {
		case evStarted:
			return w.enter(stateRunning, act(actAnswerStarted))
		case evStartFailed:
			return w.afterExit(e, act(actAnswerStartError))
		}
	case stateRunning:
		return w.running(e)
	case stateExited:
		if e.kind == evExited {
			return w.afterExit(e)
		}
	case stateBackOff:
		switch e.kind {
		case evBackOffDone:
			return w.enter(stateStarting, act(actCountRestart))
		case evRequest:
			switch e.op {
			case opPowerOn: // start now, not at the end of the back-off
				return w.enter(stateStarting, act(actAwaitStart), act(actCountRestart))
			case opPowerOff: // no VM runs: do not restart it, stay off
				return w.enter(statePoweredOff, act(actOffInBackOff))
			case opFlash: // the image the restart boots
				return w, []workerAction{act(actInstallImage)}
			case opReset: // the pod's definition, started now
				w.crashes = 0
				return w.enter(stateFlashing)
			case opResize: // the size the restart boots with
				return w, []workerAction{act(actResize)}
			}
			return w, []workerAction{act(actRefuseFinished)}
		}
	case statePoweredOff:
		if e.kind == evRequest {
			switch e.op {
			case opPowerOn: // answered by the start
				w.crashes = 0
				return w.enter(stateStarting, act(actPowerOn), act(actAwaitStart))
			case opFlash: // the image the next power on boots; stay off
				return w, []workerAction{act(actInstallImage)}
			case opReset: // the pod's definition, powered on
				w.crashes = 0
				return w.enter(stateFlashing)
			case opResize: // the size the next power on boots with
				return w, []workerAction{act(actResize)}
			}
			return w, []workerAction{act(actReply)} // off already
		}
	case statePoweringOff:
		switch e.kind {
		case evStopped:
			return w.enter(statePoweredOff)
		case evStopFailed:
			return w.enter(stateRunning)
		}
	case stateFlashing:
		switch e.kind {
		case evFlashed: // answered by the start of the new image
			return w.enter(stateStarting)
		case evFlashFailed: // the VM is off (powerOff recorded it)
			return w.enter(statePoweredOff)
		case evStopFailed:
			return w.enter(stateRunning)
		}
	case stateFinished:
		if e.kind == evRequest {
			return w, []workerAction{act(actRefuseFinished)}
		}
	case stateTerminating:
		if e.kind == evDeleted {
			return w.enter(stateTerminated)
		}
	}
	return w, nil
}

// running is next in stateRunning: the VM's exit, a request, its first
// Ready, a failed probe.
func (w podWorker) running(e workerEvent) (podWorker, []workerAction) {
	switch e.kind {
	case evExited:
		if e.ranLong {
			w.crashes = 0
		}
		return w.afterExit(e)
	case evRequest:
		switch e.op {
		case opPowerOff: // stop the VM and stay off
			return w.enter(statePoweringOff)
		case opFlash, opReset: // stop the VM, install the image (or the pod's own), start it
			return w.enter(stateFlashing)
		case opResize: // for the next start; the VM runs on
			return w, []workerAction{act(actResize)}
		}
		return w, []workerAction{act(actReply)} // on already
	case evReady:
		// The run's first Ready ends its boot, is the point its memory
		// snapshot is saved at, and starts the pod's exporter, which
		// from then on lives with the pod (a later run's first Ready
		// finds it running): a lease never lands on a target still
		// pulling its image, booting or paused for its snapshot.
		if w.ready {
			return w, nil
		}
		w.ready = true
		return w, []workerAction{act(actEndBoot), act(actSaveSnapshot), act(actStartExporter)}
	case evProbeFailed:
		// As the kubelet: the failed container is killed, and its exit
		// goes through the restart policy. A failure of an ended run's
		// probes is not this run's.
		if !e.current {
			return w, nil
		}
		return w, []workerAction{act(actKill)}
	}
	return w, nil
}

// afterExit applies the restart policy to the run that just ended: the
// pod finishes, or the VM restarts after the back-off (crash counted).
func (w podWorker) afterExit(e workerEvent, acts ...workerAction) (podWorker, []workerAction) {
	if !podstatus.RestartDecision(w.policy, e.exitCode) || e.reason == podstatus.ReasonInvalidVMSpec {
		// The state dir (console log) stays until the pod is deleted.
		// The image is given up before the status says finished: a pod
		// shown Succeeded or Failed holds no image.
		return w.enter(stateFinished, append(acts, act(actReleaseImage), act(actMarkFinal))...)
	}
	w.crashes++
	return w.enter(stateBackOff, append(acts, workerAction{kind: actBeginBackOff, crash: w.crashes})...)
}
