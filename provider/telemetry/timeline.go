package telemetry

import (
	"strconv"
	"time"

	"github.com/go-logr/logr"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// A start timeline is the wall-clock steps of a pod's first start on the
// node, from the library's CreatePod call to the first Ready status handed
// back to it. It is logged once, at V(2) from this file
// ("-vmodule=timeline=2" shows it alone), as "Start timeline": the burst
// benchmark (e2e/burstbench_test.go) joins it with the API server's side
// (created, bound, status written, Ready seen) to show where a burst's
// time goes. A pod recovered after a restart has none; a restart of the
// VM after the first Ready adds nothing.

// TimelineStep names one step of a start timeline.
type TimelineStep int

// The steps, in the order a start passes them. Each is the time the step
// was done (the last time, when a failed start was retried).
const (
	// StepCreatePod: the library called CreatePod (its pod sync worker
	// picked the pod up).
	StepCreatePod TimelineStep = iota
	// StepAdmitted: admission decided (under the handler's lock).
	StepAdmitted
	// StepRecorded: the intent record (pod.json) and status.json written
	// and synced by the pod's worker, its first step (CreatePod returned
	// after admission).
	StepRecorded
	// StepWorker: the worker began the start (pull, overlay, QEMU).
	StepWorker
	// StepImage: the image was resolved (cached) or pulled.
	StepImage
	// StepOverlay: the VM spec was built and its overlay created.
	StepOverlay
	// StepQEMUExec: QEMU was exec'd (qemu.StartTimes.Exec).
	StepQEMUExec
	// StepQMPSocket: QEMU's QMP socket first accepted a connection.
	StepQMPSocket
	// StepQMP: QMP greeted and capabilities were negotiated.
	StepQMP
	// StepStarted: qemu.Start returned (vCPUs released).
	StepStarted
	// StepPushed: the first Ready status was handed to the library's
	// callback (the status pump's delivery began).
	StepPushed
	// StepDelivered: the library's callback returned (the status is in
	// its update queue).
	StepDelivered
	numTimelineSteps
)

// timelineStepNames are the log keys of the steps (milliseconds since
// StepCreatePod; createPodUnixMicro is the origin).
var timelineStepNames = [numTimelineSteps]string{
	"createPod", "admitted", "recorded", "worker", "image", "overlay",
	"qemuExec", "qmpSocket", "qmp", "started", "pushed", "delivered",
}

// String is the step's log key.
func (s TimelineStep) String() string {
	if s < 0 || s >= numTimelineSteps {
		return "step" + strconv.Itoa(int(s))
	}
	return timelineStepNames[s]
}

// startTimeline is one pod's steps (zero: not reached).
type startTimeline [numTimelineSteps]time.Time

// timelineMaxAge bounds how long a timeline whose pod never turned Ready
// is kept (a pod deleted while starting, a crash loop).
const timelineMaxAge = 10 * time.Minute

// BeginTimeline starts uid's timeline at CreatePod; it sweeps timelines
// older than timelineMaxAge.
func (t *Telemetry) BeginTimeline(uid types.UID, at time.Time) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for u, tl := range t.timelines {
		if at.Sub(tl[StepCreatePod]) > timelineMaxAge {
			delete(t.timelines, u)
		}
	}
	tl := &startTimeline{}
	tl[StepCreatePod] = at
	t.timelines[uid] = tl
}

// Mark records step of uid's timeline at at (no timeline: nothing).
func (t *Telemetry) Mark(uid types.UID, step TimelineStep, at time.Time) {
	if t == nil || at.IsZero() {
		return
	}
	t.mu.Lock()
	if tl := t.timelines[uid]; tl != nil {
		tl[step] = at
	}
	t.mu.Unlock()
}

// markQEMU records the steps of a QEMU start (vm nil: the start failed).
func (t *Telemetry) markQEMU(uid types.UID, vm StartedVM) {
	if t == nil || vm == nil {
		return
	}
	st := vm.StartTimes()
	t.Mark(uid, StepQEMUExec, st.Exec)
	t.Mark(uid, StepQMPSocket, st.Socket)
	t.Mark(uid, StepQMP, st.QMP)
	t.Mark(uid, StepStarted, st.Released)
}

// StatusDelivered is called after the library's callback took pod's
// status (handed over at sent, returned now): the first Ready status ends
// the pod's timeline, which is logged.
func (t *Telemetry) StatusDelivered(log logr.Logger, pod *corev1.Pod, sent, now time.Time) {
	if t == nil || !podstatus.Ready(pod) {
		return
	}
	t.mu.Lock()
	tl := t.timelines[pod.UID]
	delete(t.timelines, pod.UID)
	t.mu.Unlock()
	if tl == nil {
		return
	}
	tl[StepPushed], tl[StepDelivered] = sent, now
	if v := log.V(2); v.Enabled() {
		v.Info("Start timeline", append([]any{"pod", klog.KObj(pod), "uid", pod.UID}, tl.keysAndValues()...)...)
	}
}

// keysAndValues: createPodUnixMicro, then each step reached as
// "<step>Ms" (milliseconds since CreatePod, microsecond precision).
func (tl *startTimeline) keysAndValues() []any {
	t0 := tl[StepCreatePod]
	kv := []any{"createPodUnixMicro", t0.UnixMicro()}
	for s := StepAdmitted; s < numTimelineSteps; s++ {
		if tl[s].IsZero() {
			continue
		}
		kv = append(kv, s.String()+"Ms", float64(tl[s].Sub(t0).Microseconds())/1000)
	}
	return kv
}

// StartedVM is what the start timeline reads of a started VM.
type StartedVM interface {
	StartTimes() qemu.StartTimes
}
