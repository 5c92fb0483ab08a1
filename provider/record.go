package provider

import (
	"encoding/json"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/probe"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// podVM is one pod's record, owned by the pod's run (podRun, podrun.go)
// and shared by the goroutines that serve the pod: its worker (worker.go),
// which alone starts, stops and replaces the VM;
// the kubelet-API entry points (CreatePod, UpdatePod, DeletePod, GetPod...);
// the status pump; the probes; the exporter supervisor; the status resync.
//
// Who writes each field, and what guards it (the one place that says so):
//
//	uid, dir     newPodVM (VMs.newRun); never changed                 no lock
//	ctl          newPodVM; the exporter sends, the worker receives    channel
//	deleteReq    closed by DeletePod (requestDelete)                  channel
//	confirmed    closed by CreatePod, GetPod, UpdatePod, DeletePod    channel (confirm)
//	done         closed by the worker when it ends                    channel
//	plan         admission (CreatePod) or recoverOne, before the
//	             record is shared; never changed after                no lock
//	vm           the worker (recoverOne, before it starts)            runningVM (atomic)
//	probes       the worker, at each start (startProbes)              atomic
//	exp          the worker, once (startExporter)                     atomic
//	release      the worker (recoverOne before it starts; a
//	             rejected pod, which has no worker: finishDelete)     worker goroutine only
//	snap         the worker                                           worker goroutine only
//	handoff      CreatePod or recoverOne, before the worker starts;
//	             the worker's alone after                             worker goroutine only
//	pod          CreatePod, recoverOne; replaced by UpdatePod and
//	             DeletePod, never changed in place                    mu
//	state        the worker (its resize and flash requests included:
//	             recordSize, installFlash); CreatePod and recoverOne
//	             before it starts; a rejected pod's finishDelete      mu
//	del          DeletePod (deleting, grace), finishDelete (removed)  mu
//	resync       the status resync (statusresync.go)                  mu
//	statusFile   whoever persists (persist.go)                        statusFile.mu
//
// The fields under mu are read and written through the methods below
// (record.go), which alone take it. The worker's own state (the request it
// serves, the request waiting for the next start, the back-off timer) is
// on worker (worker.go), off this record.
type podVM struct {
	uid types.UID
	dir string

	// ctl carries power, flash and resize requests (package exporter) to
	// the worker.
	ctl       chan vmRequest
	deleteReq chan struct{} // closed by DeletePod
	confirmed chan struct{} // closed (through confirm) once the pod is known to still exist
	confirm   sync.Once
	done      chan struct{} // closed when the worker ends

	// plan is the pod's VM plan (podspec), set when the pod is admitted.
	plan podspec.Plan

	// vm is the running VM, the one copy of it.
	vm runningVM
	// probes is the readiness of the current run (probes.go); nil: no
	// readiness probe yet.
	probes atomic.Pointer[probe.State]
	// exp is the pod's Jumpstarter exporter (nil: none started): it lives
	// with the pod and owns its own state (the condition it shows).
	exp atomic.Pointer[exporter.Supervisor]
	// release gives up the pod's hold on its image (nil: none).
	release func()
	snap    snapshotRun
	handoff workerHandoff

	// mu guards pod, state, del and resync. It is taken after VMs.mu and
	// after statusFile.mu, never before them (docs/architecture.md).
	mu sync.Mutex
	// pod is the pod as bound, with its current metadata: replaced under
	// mu, never changed in place, so a pointer read under mu stays valid.
	pod *corev1.Pod
	// state is the pod's VMState, persisted to status.json (persist.go).
	state  podstatus.VMState
	del    podDeletion
	resync statusResync
	// statusFile: the writes of status.json (persist.go).
	statusFile statusFileWriter
}

// runningVM holds a pod's running VM (nil: none). Safe for concurrent use;
// one writer, the pod's worker.
type runningVM struct{ p atomic.Pointer[vmRef] }

type vmRef struct{ vm VM }

// get is the running VM, nil when none runs.
func (r *runningVM) get() VM {
	if ref := r.p.Load(); ref != nil {
		return ref.vm
	}
	return nil
}

// set records vm as the running VM (nil: none runs). Worker only.
func (r *runningVM) set(vm VM) {
	if vm == nil {
		r.p.Store(nil)
		return
	}
	r.p.Store(&vmRef{vm: vm})
}

// workerHandoff is what the pod's creator leaves its worker: written by
// CreatePod or Recover before the worker goroutine starts, the worker's
// alone after.
type workerHandoff struct {
	// pendingExit: recovered with a VM that ended while nobody watched;
	// the restart policy still has to be applied.
	pendingExit bool
	// unrecorded: the intent record (pod.json) is not written yet: the
	// worker writes it before anything of the VM exists (record).
	unrecorded bool
}

// podDeletion is the pod's deletion (lifecycle.go, delete.go): DeletePod
// sets deleting and grace; the worker's finishDelete sets removed once the
// state dir is gone.
type podDeletion struct {
	deleting bool
	grace    time.Duration
	removed  bool
}

// snapshotRun is the current run's memory snapshot (snapshots.go, package
// snapshot): written by the worker when it starts the VM; the claim is
// taken by saveSnapshot (at readiness) or dropped by the worker.
type snapshotRun struct {
	// claim is the snapshot this run saves at readiness.
	claim *snapshot.Claim
	// used is the snapshot the run was restored from.
	used *snapshot.Use
	// restoreFailed makes the next decision boot.
	restoreFailed bool
}

// statusResync is the status resync's (statusresync.go).
type statusResync struct {
	// apiResourceVersion: the resourceVersion of the API server's copy
	// whose status disagreed with the node's; sent with the next status so
	// the library does not skip it as already sent.
	apiResourceVersion string
	// count is the number of resyncs (a made-up resourceVersion when the
	// API server's copy has none).
	count int
}

// statusFileWriter orders the writes of status.json (persist.go).
type statusFileWriter struct {
	// mu serializes the writes; taken before podVM.mu.
	mu sync.Mutex
	// failing: the last write failed (an event was sent).
	failing bool
}

// newPodVM is the record of a new pod (CreatePod) or a recovered one
// (recovery.go), made with its run (VMs.newRun) before its worker starts.
func newPodVM(uid types.UID, dir string, pod *corev1.Pod) *podVM {
	return &podVM{uid: uid, dir: dir, pod: pod, ctl: make(chan vmRequest),
		deleteReq: make(chan struct{}), confirmed: make(chan struct{}), done: make(chan struct{})}
}

// The fields under mu, read and written.

// podCopy is the pod as it is now (a copy).
func (rec *podVM) podCopy() *corev1.Pod {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.pod.DeepCopy()
}

// setPod replaces the pod (the caller's copy is kept: do not change it after).
func (rec *podVM) setPod(pod *corev1.Pod) {
	rec.mu.Lock()
	rec.pod = pod
	rec.mu.Unlock()
}

// updatePod replaces the pod with what f makes of a copy of it.
func (rec *podVM) updatePod(f func(cur *corev1.Pod)) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	cur := rec.pod.DeepCopy()
	f(cur)
	rec.pod = cur
}

// stateCopy is the VMState as it is now (a copy; its pointers are shared:
// read only).
func (rec *podVM) stateCopy() podstatus.VMState {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.state
}

// read is the pod (a copy) and its VMState, as they are together now.
func (rec *podVM) read() (*corev1.Pod, podstatus.VMState) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.pod.DeepCopy(), rec.state
}

// change changes the VMState (neither persisted nor pushed: podRun.update does
// both).
func (rec *podVM) change(f func(st *podstatus.VMState)) {
	rec.mu.Lock()
	f(&rec.state)
	rec.mu.Unlock()
}

// stateJSON is the VMState as status.json holds it, and whether the pod is
// removed (nothing to write).
func (rec *podVM) stateJSON() (b []byte, removed bool, err error) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	b, err = json.MarshalIndent(rec.state, "", "  ")
	return b, rec.del.removed, err
}

// deletion is the pod's deletion as it is now.
func (rec *podVM) deletion() podDeletion {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.del
}

// beginDelete marks the pod deleting with grace; first: it was not already.
func (rec *podVM) beginDelete(grace time.Duration) (first bool) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.del.deleting {
		return false
	}
	rec.del.deleting, rec.del.grace = true, grace
	return true
}

// markRemoved records that the pod is gone from the node: final, removed.
func (rec *podVM) markRemoved() {
	rec.mu.Lock()
	rec.state.Final = true
	rec.del.removed = true
	rec.mu.Unlock()
}

// matches: the live (not removed) record of namespace/name, and whether it
// is being deleted.
func (rec *podVM) matches(namespace, name string) (match, deleting bool) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	return rec.pod.Namespace == namespace && rec.pod.Name == name && !rec.del.removed, rec.del.deleting
}

// admissionClaim is the pod as admission counts it (nil: it claims
// nothing: deleting, finished or rejected), with a size set through the
// exporter (exporter/vmsize.go).
func (rec *podVM) admissionClaim() *corev1.Pod {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.del.deleting || rec.state.Final || rec.state.Rejection != nil {
		return nil
	}
	return podspec.WithMemoryClaim(rec.pod, rec.state.Size.MemoryOrZero())
}

// markResync marks the next status as differing from the API server's
// copy of resourceVersion apiRV (statusresync.go).
func (rec *podVM) markResync(apiRV string) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	// The mark only has to differ from the last status sent: the library
	// sets the resourceVersion it writes from its own copy.
	rec.resync.count++
	rec.resync.apiResourceVersion = apiRV
	if apiRV == "" {
		rec.resync.apiResourceVersion = "resync-" + strconv.Itoa(rec.resync.count)
	}
}

// withStatus is the pod with its current status: the VMState, the
// probes' results, the exporter's condition and a size set through it.
func (rec *podVM) withStatus(nodeIP string, now time.Time) *corev1.Pod {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	pod := rec.pod.DeepCopy()
	if rec.resync.apiResourceVersion != "" {
		pod.ResourceVersion = rec.resync.apiResourceVersion // statusresync.go
	}
	pod.Status = podstatus.PodStatus(rec.pod, rec.state, nodeIP, now)
	probe.Apply(&pod.Status, rec.pod, rec.probes.Load()) // probes.go: readiness probe result
	rec.exp.Load().Apply(&pod.Status)                    // package exporter: the Jumpstarter exporter condition
	podstatus.ApplyVMSize(&pod.Status, rec.state.Size)   // exporter/vmsize.go: a size set through the exporter
	return pod
}

// runStart is when the run st shows started (Running), else now.
func runStart(st *podstatus.VMState) time.Time {
	if st.Running != nil {
		return st.Running.StartedAt.Time
	}
	return time.Now()
}
