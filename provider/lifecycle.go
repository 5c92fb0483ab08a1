package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// Files of a pod's state dir (<stateDir>/vms/<pod uid>/), next to the
// ones package qemu keeps there (spec.json, console.log, sockets...).
const (
	// PodFileName is the intent record: the pod as bound, written by its
	// worker before anything else is created for it, so a restart finds
	// every pod it had started to create a VM for.
	PodFileName = "pod.json"
	// StatusFileName is the VMState, rewritten on every transition.
	StatusFileName = "status.json"
	// OverlayFileName is the VM's writable disk (qcow2 over the image).
	OverlayFileName = "disk.qcow2"
	// VMsDirName is the directory under the node's state dir holding one
	// directory per pod UID.
	VMsDirName = "vms"
)

// VMsConfig configures the VM pod handler.
type VMsConfig struct {
	NodeName string
	// NodeIP is reported as hostIP and podIP.
	NodeIP string
	// StateDir is the node's state dir; pods live under StateDir/vms/<uid>.
	StateDir   string
	QEMUBinary string
	// Hypervisor starts and re-adopts the VMs (nil: QEMU{}, package
	// qemu); tests pass fakes.
	Hypervisor Hypervisor
	// Arch is the guest architecture of the node's VMs (default the
	// host's): machine types, the kernel console and the QEMU binary follow.
	Arch qemu.Arch
	// Accelerator the node probed: "kvm" or "tcg".
	Accelerator string
	// Images is the image cache; ImageDir its root (VMs may open files
	// under it read-only). nil: no store (flash is refused).
	Images   ImageStore
	ImageDir string
	// Allocatable returns the node's current allocatable (admission).
	Allocatable func() corev1.ResourceList
	// Secrets reads a pull secret (nil: pull secrets are ignored) or a
	// secret a volume or env var refers to (nil: such pods wait).
	Secrets func(ctx context.Context, namespace, name string) (*corev1.Secret, error)
	// ConfigMaps reads a config map a volume or env var refers to.
	ConfigMaps func(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error)
	// Recorder receives kubelet-style pod events (optional).
	Recorder record.EventRecorder
	// ForceDelete writes the final status of a deleted pod and removes it
	// from the API server once its VM is gone, as the kubelet does
	// (optional: the library otherwise deletes it when the grace period
	// ends). pod carries the terminal status.
	ForceDelete func(ctx context.Context, pod *corev1.Pod) error
	// Backoff for image pulls and crash loops (default DefaultBackoff).
	Backoff podstatus.Backoff
	// ErrImagePullHold is how long ErrImagePull is shown before
	// ImagePullBackOff (default 2s).
	ErrImagePullHold time.Duration
	// UEFICode and UEFIVars are OVMF files; empty: UEFI pods are refused.
	UEFICode, UEFIVars string
	// StartTimeout bounds a QEMU start (default 60s).
	StartTimeout time.Duration
	// DefaultGrace is the grace period when a pod gives none (default 30s).
	DefaultGrace time.Duration
	// Telemetry receives start/exit metrics and spans (optional; tracing.go).
	Telemetry *telemetry.Telemetry
	// Exporters runs the Jumpstarter exporters of pods that name an
	// exporter Secret (exporter.go); nil: such pods show the exporter
	// condition Failed (their VMs still run).
	Exporters ExporterRunner
	// Memory is the node's memory tuning, given to every VM (vmMemory in
	// the node configuration).
	Memory qemu.MemoryTuning
	// VMNice is the nice value of every QEMU (vmNice in the node
	// configuration).
	VMNice int
	// EmulatedKernelArgs are added to the command line of an x86-64
	// kernel booted directly under TCG (emulatedKernelArgs in the node
	// configuration; EmulatedKernelCmdline).
	EmulatedKernelArgs []string
	// VMOverhead is QEMU's own memory per VM in bytes, counted by
	// admission next to the pod's memory request (podspec.Admit).
	VMOverhead int64
	// VMCgroup, when set (vmCgroup mode Own), runs every QEMU in a cgroup
	// of its own under its Root and Parent, with the limits VMCgroup
	// (cgroup.go) derives from the pod; nil: the agent's cgroup.
	VMCgroup *qemu.Cgroup
	// Features in force at start (nil: the defaults); SetFeatures swaps
	// them on a reload (features.go).
	Features *config.FeatureConfig
}

// VMs is the pod side of the provider: every pod bound to the node becomes
// one QEMU VM. It implements the virtual-kubelet PodLifecycleHandler and
// PodNotifier: status is pushed on every transition (pull results, VM start,
// VM exit events), never polled.
type VMs struct {
	cfg  VMsConfig
	base context.Context
	log  klog.Logger
	now  func() time.Time

	// features are the features in force: written by SetFeatures (the
	// reload's owner), read anywhere (features.go).
	features atomic.Pointer[config.FeatureConfig]

	mu     sync.Mutex
	pods   map[types.UID]*podVM
	notify func(*corev1.Pod)
	// featuresChanged is closed (and replaced) by SetFeatures: it wakes
	// the pods held for features.
	featuresChanged chan struct{}
	// pump delivers statuses to notify, per pod, newest only (statuspump.go).
	pump podstatus.StatusPump
	// snaps: who creates which memory snapshot (snapshots.go).
	snaps snapshotStore
}

// podVM is one pod and its VM. Its worker goroutine owns the VM; other
// methods only read the state and send requests.
type podVM struct {
	uid types.UID
	dir string

	mu sync.Mutex
	// pod is the pod as bound, with its current metadata: replaced under
	// mu, never changed in place, so a pointer read under mu stays valid.
	pod      *corev1.Pod
	plan     podspec.Plan
	state    podstatus.VMState
	vm       VM
	release  func()
	deleting bool
	grace    time.Duration
	removed  bool
	// pendingExit: recovered with a VM that ended while nobody watched;
	// the restart policy still has to be applied.
	pendingExit bool
	// probes is the readiness of the current run (probes.go); nil: no
	// readiness probe.
	probes *probeState
	// Snapshot start (snapshots.go), set by the worker: snapClaim is the
	// snapshot this run saves at readiness (taken by captureSnapshot);
	// snapUsed the snapshot the run was restored from; snapRestoreFailed
	// makes the next decision boot.
	snapClaim         *snapshotClaim
	snapUsed          *snapshotUse
	snapRestoreFailed bool

	// apiResourceVersion: the resourceVersion of the API server's copy
	// whose status disagreed with the node's (statusresync.go); sent with
	// the next status so the library does not skip it as already sent.
	apiResourceVersion string
	resyncs            int

	// ctl carries power and flash requests (exporter.go) to the worker.
	ctl chan vmRequest
	// exporter is the state of the pod's Jumpstarter exporter (nil: none),
	// shown as a pod condition; written by the exporter supervisor.
	exporter *exporterStatus
	// waiter is a power on or flash request answered by the next start's
	// result (worker goroutine only).
	waiter chan<- error
	// stopExp ends the exporter supervisor; expDone is closed when it has
	// ended (both nil: no exporter).
	stopExp context.CancelFunc
	expDone chan struct{}
	// expStarted: the supervisor was started once (never again: it lives
	// with the pod).
	expStarted bool
	// persistMu orders the writes of status.json (persist.go);
	// persistFailing: the last write failed (an event was sent).
	persistMu      sync.Mutex
	persistFailing bool
	// unrecorded: the intent record (pod.json) is not written yet: the
	// worker writes it before anything of the VM exists (record). Set by
	// CreatePod before the worker starts; the worker's alone after.
	unrecorded bool

	deleteReq chan struct{} // closed by DeletePod
	confirmed chan struct{} // closed once the pod is known to still exist
	confirm   sync.Once
	done      chan struct{} // closed when the worker ends
}

// NewVMs returns the pod handler. ctx bounds the workers: when it ends they
// detach from their VMs, which keep running for the next start to adopt.
// Call Recover before handing it to the pod controller.
func NewVMs(ctx context.Context, cfg VMsConfig) *VMs {
	if cfg.Backoff.Initial <= 0 {
		cfg.Backoff = podstatus.DefaultBackoff
	}
	if cfg.ErrImagePullHold <= 0 {
		cfg.ErrImagePullHold = 2 * time.Second
	}
	if cfg.StartTimeout <= 0 {
		cfg.StartTimeout = 60 * time.Second
	}
	if cfg.DefaultGrace <= 0 {
		cfg.DefaultGrace = 30 * time.Second
	}
	if cfg.Hypervisor == nil {
		cfg.Hypervisor = QEMU{}
	}
	p := &VMs{cfg: cfg, base: ctx, log: klog.FromContext(ctx).WithName("vms"), now: time.Now, pods: map[types.UID]*podVM{}, featuresChanged: make(chan struct{})}
	p.features.Store(cfg.Features)
	return p
}

func (p *VMs) vmsDir() string { return filepath.Join(p.cfg.StateDir, VMsDirName) }

func (p *VMs) podDir(uid types.UID) string { return filepath.Join(p.vmsDir(), string(uid)) }

// ---- PodLifecycleHandler ----

// CreatePod translates and admits the pod; an admitted pod gets its intent
// record on disk and a worker that pulls the image and runs the VM. A pod
// that is not admitted gets a Failed status naming why. Returns quickly: the
// work is asynchronous.
func (p *VMs) CreatePod(ctx context.Context, pod *corev1.Pod) error {
	called := time.Now()
	log := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod), "uid", pod.UID)
	rec := newPodVM(pod.UID, p.podDir(pod.UID), pod.DeepCopy())
	rec.confirm.Do(func() { close(rec.confirmed) })
	rec.state.StartTime = p.now().UTC()
	plan, rej := podspec.Translate(pod, p.arch())
	node := p.nodeCapacity()

	// Admit and insert under one lock: the library calls CreatePod from
	// several workers, and two pods admitted against the same active set
	// could overcommit the node.
	p.mu.Lock()
	if _, known := p.pods[pod.UID]; known {
		p.mu.Unlock()
		return nil // already known (e.g. recovered): nothing to create
	}
	if rej == nil {
		rej = podspec.Admit(pod, plan, node, p.activePodsLocked())
	}
	if rej != nil {
		rec.state.Rejection = rej
		rec.state.Final = true
		close(rec.done)
	} else {
		rec.plan = plan
		rec.state.SetWaiting(podstatus.ReasonContainerCreating, "")
	}
	p.pods[pod.UID] = rec
	p.mu.Unlock()
	if rej == nil {
		p.cfg.Telemetry.BeginTimeline(pod.UID, called) // timeline.go
		p.cfg.Telemetry.Mark(pod.UID, telemetry.StepAdmitted, time.Now())
	}

	if rej != nil {
		log.Info("Pod not admitted", "reason", rej.Reason, "message", rej.Message)
		p.event(pod, corev1.EventTypeWarning, rej.Reason, rej.Message)
		p.push(rec)
		return nil
	}

	// The intent record is the worker's first step (worker.record): the
	// library's pod sync workers are not held by disk writes, so a burst's
	// pods reach their workers at once.
	rec.unrecorded = true
	log.Info("Pod admitted; creating VM", "image", plan.Image, "cpus", plan.CPUs, "memoryMiB", plan.MemoryMiB, "machine", plan.Machine)
	p.push(rec)
	go p.run(rec)
	return nil
}

// UpdatePod refreshes the pod's metadata and spec as stored; a running VM
// is not changed. A pod with the same name but a new UID replaces the old
// one (whose VM is stopped).
func (p *VMs) UpdatePod(ctx context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	rec := p.findLocked(pod.Namespace, pod.Name)
	p.mu.Unlock()
	if rec == nil {
		return errdefs.NotFoundf("pod %s/%s not found on node %s", pod.Namespace, pod.Name, p.cfg.NodeName)
	}
	if rec.uid != pod.UID {
		p.requestDelete(rec, 0)
		return p.CreatePod(ctx, pod)
	}
	rec.confirm.Do(func() { close(rec.confirmed) })
	rec.mu.Lock()
	st := rec.pod.Status
	metaChanged := !maps.Equal(rec.pod.Labels, pod.Labels) || !maps.Equal(rec.pod.Annotations, pod.Annotations)
	rec.pod = pod.DeepCopy()
	rec.pod.Status = st
	rec.mu.Unlock()
	if metaChanged {
		// The library writes the last pod pushed, metadata included, and
		// the API server refuses a node's status update whose labels
		// differ: push the current metadata (e.g. a lease label set while
		// the agent was down, on a pod recovered from its state file).
		p.push(rec)
	}
	return nil
}

// DeletePod stops the VM gracefully (ACPI power button, then quit, then
// kill at the grace deadline), removes its state and pushes a terminal
// status. Asynchronous and idempotent; an unknown pod is NotFound.
func (p *VMs) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	p.mu.Lock()
	rec := p.pods[pod.UID]
	if rec == nil {
		rec = p.findLocked(pod.Namespace, pod.Name)
	}
	p.mu.Unlock()
	if rec == nil {
		return errdefs.NotFoundf("pod %s/%s not found on node %s", pod.Namespace, pod.Name, p.cfg.NodeName)
	}
	grace := p.cfg.DefaultGrace
	switch {
	case pod.DeletionTimestamp != nil && pod.DeletionGracePeriodSeconds != nil:
		// The API server set deletionTimestamp = request time + grace; the
		// library removes the pod at that deadline, so count from it.
		grace = time.Until(pod.DeletionTimestamp.Time)
	case pod.DeletionGracePeriodSeconds != nil:
		grace = time.Duration(*pod.DeletionGracePeriodSeconds) * time.Second
	case pod.Spec.TerminationGracePeriodSeconds != nil:
		grace = time.Duration(*pod.Spec.TerminationGracePeriodSeconds) * time.Second
	}
	rec.mu.Lock()
	// rec.pod is replaced, never changed in place: readers that took it
	// under the lock (a held pod's features check) keep a stable pod.
	cur := rec.pod.DeepCopy()
	if pod.DeletionTimestamp != nil {
		cur.DeletionTimestamp = pod.DeletionTimestamp.DeepCopy()
		cur.DeletionGracePeriodSeconds = pod.DeletionGracePeriodSeconds
	}
	if pod.UID == rec.uid {
		// The library calls UpdatePod only for pods not being deleted: a
		// label changed just before the deletion (a lease released) arrives
		// here. The terminal status carries the metadata, and the API
		// server refuses a node's status update whose labels differ.
		cur.Labels = maps.Clone(pod.Labels)
		cur.Annotations = maps.Clone(pod.Annotations)
	}
	rec.pod = cur
	rec.mu.Unlock()
	klog.FromContext(ctx).Info("Deleting pod", "pod", klog.KObj(pod), "uid", rec.uid, "grace", grace)
	p.requestDelete(rec, grace)
	return nil
}

func (p *VMs) requestDelete(rec *podVM, grace time.Duration) {
	rec.mu.Lock()
	first := !rec.deleting
	if first {
		rec.deleting = true
		rec.grace = grace
		close(rec.deleteReq)
	}
	rec.mu.Unlock()
	rec.confirm.Do(func() { close(rec.confirmed) })
	if first && rec.state.Rejection != nil {
		// Never had a VM: done at once.
		go p.finishDelete(rec, nil)
	}
}

// GetPod returns the pod as the provider knows it, or NotFound. It also
// tells a recovered pod that the API server still has it.
func (p *VMs) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	p.mu.Lock()
	rec := p.findLocked(namespace, name)
	p.mu.Unlock()
	if rec != nil {
		rec.mu.Lock()
		stopping := rec.deleting
		rec.mu.Unlock()
		if stopping {
			// A pod being stopped is gone for the library: a new pod of the
			// same name (StatefulSet) must be created, not "updated".
			rec = nil
		}
	}
	if rec == nil {
		return nil, errdefs.NotFoundf("pod %s/%s not found on node %s", namespace, name, p.cfg.NodeName)
	}
	rec.confirm.Do(func() { close(rec.confirmed) })
	return p.snapshot(rec), nil
}

// GetPodStatus returns the pod's status or NotFound.
func (p *VMs) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, err := p.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

// GetPods returns exactly the pods this node has (running, stopping or
// finished), with their namespace, name and UID as bound.
func (p *VMs) GetPods(context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	recs := make([]*podVM, 0, len(p.pods))
	for _, r := range p.pods {
		recs = append(recs, r)
	}
	p.mu.Unlock()
	out := make([]*corev1.Pod, 0, len(recs))
	for _, r := range recs {
		out = append(out, p.snapshot(r))
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Name < out[j].Name
	})
	return out, nil
}

// NotifyPods registers the library's status callback and pushes every
// current status (pods recovered before the callback existed).
func (p *VMs) NotifyPods(_ context.Context, cb func(*corev1.Pod)) {
	p.mu.Lock()
	p.notify = cb
	recs := make([]*podVM, 0, len(p.pods))
	for _, r := range p.pods {
		recs = append(recs, r)
	}
	p.mu.Unlock()
	for _, r := range recs {
		p.push(r)
	}
}

// ---- helpers ----

// findLocked returns the live record for namespace/name: the one not being
// deleted, else any.
func (p *VMs) findLocked(namespace, name string) *podVM {
	var any *podVM
	for _, r := range p.pods {
		r.mu.Lock()
		match := r.pod.Namespace == namespace && r.pod.Name == name && !r.removed
		deleting := r.deleting
		r.mu.Unlock()
		if !match {
			continue
		}
		if !deleting {
			return r
		}
		any = r
	}
	return any
}

// activePodsLocked: admitted, not finished, not being deleted.
func (p *VMs) activePodsLocked() []*corev1.Pod {
	var out []*corev1.Pod
	for _, r := range p.pods {
		r.mu.Lock()
		if !r.deleting && !r.state.Final && r.state.Rejection == nil {
			out = append(out, podspec.WithMemoryClaim(r.pod, r.state.Size.memoryBytes())) // vmsize.go
		}
		r.mu.Unlock()
	}
	return out
}

func (p *VMs) allocatable() corev1.ResourceList {
	if p.cfg.Allocatable == nil {
		return nil
	}
	return p.cfg.Allocatable()
}

// snapshot is the pod with its current status.
func (p *VMs) snapshot(rec *podVM) *corev1.Pod {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	pod := rec.pod.DeepCopy()
	if rec.apiResourceVersion != "" {
		pod.ResourceVersion = rec.apiResourceVersion // statusresync.go
	}
	pod.Status = podstatus.PodStatus(rec.pod, rec.state, p.cfg.NodeIP, p.now())
	applyProbes(&pod.Status, rec.pod, rec.probes) // probes.go: readiness probe result
	applyExporter(&pod.Status, rec.exporter)      // exporter.go: Jumpstarter exporter condition
	applyVMSize(&pod.Status, rec.state.Size)      // vmsize.go: a size set through the exporter
	return pod
}

// push has the pod's current status sent to the library: asynchronously,
// coalesced per pod and in order (statuspump.go).
func (p *VMs) push(rec *podVM) {
	p.pump.Push(rec.uid, func() {
		p.mu.Lock()
		cb := p.notify
		p.mu.Unlock()
		pod := p.snapshot(rec)
		sent := time.Now()
		if cb != nil {
			cb(pod)
		}
		p.cfg.Telemetry.StatusDelivered(p.log, pod, sent, time.Now()) // timeline.go
		if podstatus.Ready(pod) {
			p.startExporter(p.base, rec) // exporter.go: first Ready; idempotent
		}
	})
	p.observeReady(rec) // tracing.go: boot ends when the pod turns Ready
}

func (p *VMs) event(pod *corev1.Pod, typ, reason, msg string) {
	p.mu.Lock()
	r := p.cfg.Recorder
	p.mu.Unlock()
	if r != nil {
		r.Event(pod, typ, reason, msg)
	}
}

// SetRecorder sets the recorder of pod events (e.g. once the pod
// controller's event broadcaster exists).
func (p *VMs) SetRecorder(r record.EventRecorder) {
	p.mu.Lock()
	p.cfg.Recorder = r
	p.mu.Unlock()
}

// update changes the state under the lock, persists it and pushes it.
func (p *VMs) update(rec *podVM, f func(st *podstatus.VMState)) {
	rec.mu.Lock()
	f(&rec.state)
	rec.mu.Unlock()
	p.persist(rec) // persist.go
	p.push(rec)
}

func writeJSONAtomic(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return writeFileAtomic(path, append(b, '\n')) // persist.go
}

// ---- the worker ----

// Who owns what (one pod):
//   - the worker goroutine (run) alone starts, stops and replaces the VM,
//     its overlay and the image it boots: every power and flash request of
//     the pod's Jumpstarter exporter (exporter.go) is sent to it on rec.ctl
//     and answered on the request's reply channel, so power, flash, delete,
//     restart and recovery never race;
//   - the console and guest port forwards (kubectl attach/port-forward,
//     the exporter's console and TCP drivers) use the running VM
//     read from rec.vm under rec.mu; they never change its lifecycle
//     (VM methods are safe for concurrent use);
//   - the exporter supervisor goroutine (exporter.go) owns the exporter
//     and rec.exporter (the condition it shows).
//
// The worker is a state machine (podworker.go): its states, events and
// transitions are there; run only waits for events and does the actions.
// The exporter (exporter.go) starts once the pod is first Ready (push) or
// is found powered off, and then lives with the pod: a lease never lands on
// a target still pulling its image or booting, and a powered-off VM still
// answers power on.

// worker is the executor of one pod's state machine: what the pure state
// (podWorker) does not hold. Worker goroutine only.
type worker struct {
	p   *VMs
	rec *podVM
	ctx context.Context
	log klog.Logger
	pod *corev1.Pod
	// vm is the running VM (nil: none).
	vm VM
	// req is the request being served (evRequest, statePoweringOff,
	// stateFlashing).
	req vmRequest
	// backoff fires at the end of the crash-loop back-off (nil: no wait).
	backoff *time.Timer
}

// run owns one pod's VM until the pod is deleted or the provider stops.
func (p *VMs) run(rec *podVM) {
	defer close(rec.done)
	rec.mu.Lock()
	pod := rec.pod.DeepCopy()
	f := recoveredFacts{final: rec.state.Final, vm: rec.vm != nil, pendingExit: rec.pendingExit, poweredOff: rec.state.PoweredOff}
	w := &worker{p: p, rec: rec, pod: pod, vm: rec.vm}
	rec.pendingExit = false
	rec.mu.Unlock()
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
		e := w.step(st.state)
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

// answer answers the request waiting for the next start (rec.waiter), once.
func (w *worker) answer(err error) {
	if w.rec.waiter != nil {
		w.rec.waiter <- err
		w.rec.waiter = nil
	}
}

func (w *worker) stopBackOff() {
	if w.backoff != nil {
		w.backoff.Stop()
		w.backoff = nil
	}
}

// step waits in state s for its next event (and, in the states that work,
// does the work).
func (w *worker) step(s podState) workerEvent {
	p, rec, ctx := w.p, w.rec, w.ctx
	if s != stateTerminating && p.deleteRequested(rec) {
		return workerEvent{kind: evDelete}
	}
	switch s {
	case stateStarting:
		return w.start()
	case stateRunning:
		return w.waitRunning()
	case stateExited:
		rec.mu.Lock()
		term := rec.state.Terminated
		rec.mu.Unlock()
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
		err := p.powerOff(ctx, rec, w.vm, "on request")
		w.req.reply <- err
		if err != nil {
			return workerEvent{kind: evStopFailed}
		}
		w.vm = nil
		return workerEvent{kind: evStopped}
	case stateFlashing:
		req := w.req
		if err := p.powerOff(ctx, rec, w.vm, "to flash "+req.what()); err != nil {
			req.refuse(err)
			return workerEvent{kind: evStopFailed}
		}
		w.vm = nil
		if err := p.installImage(rec, req); err != nil {
			req.reply <- err
			return workerEvent{kind: evFlashFailed}
		}
		p.update(rec, func(st *podstatus.VMState) { st.PoweredOff = false })
		rec.waiter = req.reply // answered by the start of the new image
		return workerEvent{kind: evFlashed}
	case stateTerminating:
		p.finishDelete(rec, w.vm)
		w.vm = nil
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
	p, rec, ctx := w.p, w.rec, w.ctx
	// A recovered pod whose VM must be (re)started waits until the library
	// shows the pod still exists (or deletes it).
	select {
	case <-rec.confirmed:
	case <-rec.deleteReq:
		return workerEvent{kind: evDelete}
	case <-ctx.Done():
		return workerEvent{kind: evShutdown}
	}
	if rec.unrecorded {
		if e, ok := w.record(); !ok {
			return e
		}
		rec.unrecorded = false
	}
	// A pod needing a disabled feature waits (features.go).
	if !p.holdForFeatures(ctx, rec) {
		if ctx.Err() != nil {
			return workerEvent{kind: evShutdown}
		}
		return workerEvent{kind: evDelete}
	}
	vm, ok := p.pullAndStart(ctx, rec)
	if ok {
		w.vm = vm
		return workerEvent{kind: evStarted}
	}
	if ctx.Err() != nil {
		return workerEvent{kind: evShutdown}
	}
	if p.deleteRequested(rec) {
		return workerEvent{kind: evDelete}
	}
	// The start failed; recorded as a terminated run.
	e := workerEvent{kind: evStartFailed, exitCode: 128, reason: podstatus.ReasonStartError}
	rec.mu.Lock()
	if t := rec.state.Terminated; t != nil {
		e.exitCode, e.reason = t.ExitCode, t.Reason
	}
	rec.mu.Unlock()
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
	p, rec, ctx := w.p, w.rec, w.ctx
	for attempt := 1; ; attempt++ {
		err := p.writeIntent(rec)
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
func (p *VMs) writeIntent(rec *podVM) error {
	rec.mu.Lock()
	pod := rec.pod.DeepCopy()
	rec.mu.Unlock()
	if err := os.MkdirAll(rec.dir, 0o700); err != nil {
		return fmt.Errorf("create state dir for pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	if err := writeJSONAtomic(filepath.Join(rec.dir, PodFileName), pod); err != nil {
		os.RemoveAll(rec.dir)
		return fmt.Errorf("record pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	p.persist(rec)
	return nil
}

// waitRunning is stateRunning's step: wait for the VM's exit (recorded
// here), a request, a delete or the shutdown.
func (w *worker) waitRunning() workerEvent {
	p, rec, ctx, vm := w.p, w.rec, w.ctx, w.vm
	select {
	case <-ctx.Done():
		return workerEvent{kind: evShutdown}
	case <-rec.deleteReq:
		return workerEvent{kind: evDelete}
	case req := <-rec.ctl:
		return w.request(req)
	case <-vm.Done():
	}
	ex, _ := vm.Exit()
	rec.mu.Lock()
	started := time.Now()
	if rec.state.Running != nil {
		started = rec.state.Running.StartedAt.Time
	}
	rec.vm = nil
	rec.mu.Unlock()
	w.vm = nil
	p.dropSnapshotClaim(rec)
	term := podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(rec.uid))
	w.log.Info("VM exited", "exitCode", ex.ExitCode, "class", ex.Class, "reason", ex.Reason)
	p.cfg.Telemetry.VMExited(rec.uid, ex)
	typ := corev1.EventTypeNormal
	if ex.ExitCode != 0 {
		typ = corev1.EventTypeWarning
	}
	p.event(w.pod, typ, "VMExited", fmt.Sprintf("VM exited with code %d: %s", ex.ExitCode, ex.Reason))
	p.update(rec, func(st *podstatus.VMState) { st.SetTerminated(term) })
	return workerEvent{kind: evExited, exitCode: term.ExitCode, reason: term.Reason,
		ranLong: ex.At.Sub(started) >= podstatus.CrashLoopResetAfter}
}

// do carries out the actions of a transition, in order.
func (w *worker) do(acts []workerAction) {
	p, rec, ctx := w.p, w.rec, w.ctx
	for _, a := range acts {
		switch a.kind {
		case actReply:
			w.req.reply <- nil
		case actRefuseFinished:
			w.req.refuse(errPodFinished)
		case actInstallImage:
			w.req.reply <- p.installImage(rec, w.req)
		case actPowerOn:
			w.log.Info("Powering on on request")
			p.update(rec, func(st *podstatus.VMState) { st.PoweredOff = false })
		case actOffInBackOff:
			p.update(rec, func(st *podstatus.VMState) {
				st.SetWaiting(podstatus.ReasonPoweredOff, "powered off on request during the crash-loop back-off; power it on to boot again")
				st.PoweredOff = true
			})
			w.req.reply <- nil
		case actAwaitStart:
			rec.waiter = w.req.reply
		case actAnswerStarted:
			w.answer(nil)
		case actAnswerStartError:
			w.answer(p.startError(rec))
		case actAnswerFinished:
			w.answer(errPodFinished)
		case actAnswerDeleted:
			w.answer(errPodDeleted)
		case actBeginBackOff:
			w.beginBackOff(a.crash)
		case actCountRestart:
			rec.mu.Lock()
			rec.state.RestartCount++
			rec.mu.Unlock()
		case actMarkFinal:
			p.update(rec, func(st *podstatus.VMState) { st.Final = true })
		case actReleaseImage:
			p.releaseImage(rec)
		case actStopExporter:
			rec.stopExporter()
		case actStartExporter:
			p.startExporter(ctx, rec) // idempotent
		case actStartProbes:
			p.startProbes(ctx, rec, w.vm) // probes.go: end with this run
		case actExporterIfReady:
			if podstatus.Ready(p.snapshot(rec)) {
				// Ready without a status change (no readiness probe, or a
				// re-adopted VM): push has nothing new to deliver.
				p.startExporter(ctx, rec) // exporter.go: idempotent
			}
		case actDetach:
			w.vm.Detach()
		default:
			panic(fmt.Sprintf("pod worker: unknown action %s", a))
		}
	}
}

// beginBackOff starts the crash-loop back-off before the restart after
// crash number crash: CrashLoopBackOff with a timer, or, with no delay, the
// ended run becomes the last state at once.
func (w *worker) beginBackOff(crash int) {
	p, rec := w.p, w.rec
	delay := p.cfg.Backoff.RestartDelay(crash)
	if delay <= 0 {
		p.update(rec, func(st *podstatus.VMState) { st.LastTerminated = st.Terminated })
		return
	}
	name := "vm"
	rec.mu.Lock()
	if len(rec.pod.Spec.Containers) > 0 {
		name = rec.pod.Spec.Containers[0].Name
	}
	pod := rec.pod.DeepCopy()
	rec.mu.Unlock()
	msg := podstatus.CrashLoopMessage(delay, name, string(rec.uid))
	p.update(rec, func(st *podstatus.VMState) {
		st.LastTerminated = st.Terminated
		st.SetWaiting(podstatus.ReasonCrashLoopBackOff, msg)
	})
	p.event(pod, corev1.EventTypeWarning, "BackOff", "Back-off restarting failed VM")
	w.stopBackOff()
	w.backoff = time.NewTimer(delay)
}

func (p *VMs) deleteRequested(rec *podVM) bool {
	select {
	case <-rec.deleteReq:
		return true
	default:
		return false
	}
}

// pullAndStart pulls the image (retrying with back-off, showing
// ErrImagePull / ImagePullBackOff) and starts the VM. ok is false when
// interrupted (delete, shutdown) or when the start failed (recorded as a
// terminated run).
func (p *VMs) pullAndStart(ctx context.Context, rec *podVM) (VM, bool) {
	log := klog.FromContext(ctx)
	p.dropSnapshotClaim(rec) // an earlier run's, unused
	rec.mu.Lock()
	rec.snapUsed, rec.snapRestoreFailed = nil, false
	pod := rec.pod.DeepCopy()
	plan := rec.plan
	if rec.state.FlashedImage != "" {
		// Flashed (exporter.go): boot that image, pinned by digest.
		plan.Image, plan.PullPolicy = rec.state.FlashedImage, oci.PullIfNotPresent
	}
	var size VMSize // set through the exporter (vmsize.go)
	if rec.state.Size != nil {
		size = *rec.state.Size
		if size.MemoryBytes > 0 {
			plan.MemoryMiB = podspec.MemoryMiB(size.MemoryBytes)
		}
		plan.DiskBytes = size.DiskBytes
	}
	rec.mu.Unlock()

	// Cancel the pull when the pod is deleted.
	pctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-rec.deleteReq:
			cancel()
		case <-pctx.Done():
		}
	}()
	att := p.cfg.Telemetry.BeginStart(pctx, rec.uid, pod, plan.Image) // tracing.go: pod.start span, start metrics
	defer att.Done()

	// A flashed root (exporter_flash.go) boots instead of any image.
	img := p.flashedRoot(rec)
	for attempt := 1; img == nil; attempt++ {
		t0 := time.Now()
		if img = p.presentImage(pctx, plan); img != nil {
			// As the kubelet: one Pulled event, no Pulling, for a cached image.
			att.Pulled(t0, nil)
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Container image %q already present on machine", plan.Image))
			break
		}
		auth := p.pullSecrets(pctx, pod, plan.PullSecrets)
		p.event(pod, corev1.EventTypeNormal, "Pulling", fmt.Sprintf("Pulling image %q", plan.Image))
		var err error
		img, err = p.cfg.Images.Pull(pctx, plan.Image, oci.PullOptions{Auth: auth, Policy: plan.PullPolicy})
		att.Pulled(t0, err)
		if err == nil {
			p.event(pod, corev1.EventTypeNormal, "Pulled", fmt.Sprintf("Successfully pulled image %q (%s) in %s", plan.Image, img.Digest, time.Since(t0).Round(time.Millisecond)))
			break
		}
		if pctx.Err() != nil {
			return nil, false
		}
		msg := err.Error()
		log.Info("Image pull failed", "image", plan.Image, "attempt", attempt, "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", fmt.Sprintf("Failed to pull image %q: %s", plan.Image, msg))
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podstatus.ReasonErrImagePull, msg) })
		delay := p.cfg.Backoff.Delay(attempt)
		hold := min(p.cfg.ErrImagePullHold, delay)
		if !sleepCtx(pctx, hold) {
			return nil, false
		}
		p.update(rec, func(st *podstatus.VMState) {
			st.SetWaiting(podstatus.ReasonImagePullBackOff, podstatus.PullBackOffMessage(plan.Image, msg))
		})
		p.event(pod, corev1.EventTypeNormal, "BackOff", fmt.Sprintf("Back-off pulling image %q", plan.Image))
		if !sleepCtx(pctx, delay-hold) {
			return nil, false
		}
	}

	// Hold the image while the pod lives.
	rec.mu.Lock()
	haveRelease := rec.release != nil && rec.state.ImageDigest == img.Digest
	rec.mu.Unlock()
	if !haveRelease {
		p.releaseImage(rec)
	}
	if !haveRelease && !isFlashedRoot(img) {
		if rel, err := p.cfg.Images.Acquire(img.Digest); err == nil {
			rec.mu.Lock()
			rec.release = rel
			rec.mu.Unlock()
		} else {
			log.Error(err, "Acquire image")
		}
	}
	p.update(rec, func(st *podstatus.VMState) {
		st.ImageDigest = img.Digest
		st.ImageID = imageID(img)
		st.SetWaiting(podstatus.ReasonContainerCreating, "")
	})

	spec, err := p.vmSpec(ctx, rec, pod, plan, img)
	for attempt := 1; err != nil && podspec.IsConfigError(err); attempt++ {
		// A missing Secret/ConfigMap: wait for it, as a kubelet (podspec.PrepareGuestDisks).
		msg := err.Error()
		log.Info("VM config not available", "err", msg)
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+msg)
		p.update(rec, func(st *podstatus.VMState) { st.SetWaiting(podspec.ReasonCreateContainerConfigError, msg) })
		if !sleepCtx(pctx, min(p.cfg.Backoff.Delay(attempt), podspec.ConfigRetryMax)) {
			return nil, false
		}
		rec.mu.Lock()
		pod = rec.pod.DeepCopy()
		rec.mu.Unlock()
		spec, err = p.vmSpec(ctx, rec, pod, plan, img)
	}
	att.Overlaid(err)
	if err != nil {
		reason := podstatus.ReasonStartError
		if _, ok := errors.AsType[podspec.InvalidSpec](err); ok {
			reason = podstatus.ReasonInvalidVMSpec
		}
		log.Error(err, "VM not started", "reason", reason)
		p.event(pod, corev1.EventTypeWarning, "Failed", err.Error())
		now := p.now()
		p.update(rec, func(st *podstatus.VMState) {
			st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: reason, Message: err.Error(),
				StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
		})
		return nil, false
	}
	sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
	vm, err := p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
	scancel()
	if err != nil && spec.Incoming != "" && pctx.Err() == nil {
		// The snapshot cannot be loaded: discard it and boot (snapshots.go).
		spec, err = p.restoreFailed(ctx, rec, pod, plan, img, err)
		if err == nil {
			sctx, scancel := context.WithTimeout(pctx, p.cfg.StartTimeout)
			vm, err = p.cfg.Hypervisor.Start(sctx, spec, rec.dir)
			scancel()
		}
	}
	att.QEMUStarted(vm, err)
	if err != nil {
		if pctx.Err() != nil {
			return nil, false
		}
		log.Error(err, "QEMU start failed")
		p.event(pod, corev1.EventTypeWarning, "Failed", "Error: "+err.Error())
		now := p.now()
		p.update(rec, func(st *podstatus.VMState) {
			st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 128, Reason: podstatus.ReasonStartError, Message: err.Error(),
				StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
		})
		return nil, false
	}
	rec.mu.Lock()
	rec.vm = vm
	rec.mu.Unlock()
	from := ""
	if spec.Incoming != "" {
		from = ", restored from a memory snapshot"
	}
	log.Info("VM started", "pid", vm.Pid(), "accelerator", spec.Accelerator, "fromSnapshot", spec.Incoming != "")
	p.event(pod, corev1.EventTypeNormal, "Started", fmt.Sprintf("Started VM (QEMU pid %d, %s, %d vCPU, %d MiB%s)", vm.Pid(), spec.Accelerator, spec.CPUs, spec.MemoryMiB, from))
	p.update(rec, func(st *podstatus.VMState) {
		st.SetRunning(p.now())
		if st.Size != nil && (st.Size.AppliedMemoryBytes != size.MemoryBytes || st.Size.AppliedDiskBytes != size.DiskBytes) {
			st.Size.AppliedMemoryBytes, st.Size.AppliedDiskBytes = size.MemoryBytes, size.DiskBytes
			st.Size.Changed = p.now().UTC()
		}
	})
	return vm, true
}

// presentImage returns the cached image of plan when its pull policy lets
// the node use it without asking the registry (IfNotPresent, Never), else
// nil. It never contacts a registry.
func (p *VMs) presentImage(ctx context.Context, plan podspec.Plan) *oci.Image {
	if plan.PullPolicy == oci.PullAlways {
		return nil
	}
	img, err := p.cfg.Images.Pull(ctx, plan.Image, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil
	}
	return img
}

// vmSpec builds the VM spec for a pulled image and readies the overlay:
// a fresh one (each run starts from the image, as a container starts from
// its image), or with state policy Retain the one the last run left
// (state.go).
func (p *VMs) vmSpec(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image) (qemu.Spec, error) {
	accel := qemu.Accelerator(p.cfg.Accelerator)
	if plan.Accelerator != "" {
		accel = qemu.Accelerator(plan.Accelerator)
	}
	spec := qemu.Spec{
		Name:        vmName(pod),
		Arch:        p.arch(),
		QEMUBinary:  p.cfg.QEMUBinary,
		Accelerator: accel,
		Machine:     plan.Machine,
		CPUs:        plan.CPUs,
		MemoryMiB:   plan.MemoryMiB,
		Firmware:    plan.Firmware,
		Kernel:      img.Kernel,
		Initrd:      img.Initrd,
		Cmdline:     strings.TrimSpace(img.Cmdline + " " + plan.ExtraCmdline),
		Network:     true,
		AllowedDirs: []string{p.cfg.ImageDir},
		StateDir:    rec.dir,
		Memory:      p.cfg.Memory,
		Nice:        p.cfg.VMNice,
		Display:     plan.Display,
		// features.consoleLogSize in force when the VM starts.
		ConsoleCapBytes: p.Features().ConsoleLogSize,
		Cgroup:          podspec.VMCgroup(p.cfg.VMCgroup, plan, p.cfg.VMOverhead),
	}
	if img.Kernel != "" {
		spec.Cmdline = podspec.KernelCmdline(p.arch(), img.Cmdline, plan.ExtraCmdline) // the arch's console unless one is named
		spec.Cmdline = podspec.EmulatedKernelCmdline(p.arch(), spec.Accelerator, spec.Cmdline, p.cfg.EmulatedKernelArgs)
	}
	if plan.Firmware == qemu.FirmwareUEFI {
		spec.UEFICode, spec.UEFIVarsTemplate = p.cfg.UEFICode, p.cfg.UEFIVars
		spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(p.cfg.UEFICode), filepath.Dir(p.cfg.UEFIVars))
	}
	p.applyFlashedFirmware(rec, &spec) // exporter_flash.go
	if img.Kernel == "" && plan.ExtraCmdline != "" {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("annotation %s: image %s has no kernel to pass a command line to", podspec.AnnotationKernelCmdline, plan.Image)}
	}
	overlay := filepath.Join(rec.dir, OverlayFileName)
	if img.Disk != "" {
		spec.Disks = []qemu.Disk{{Path: overlay, Format: qemu.FormatQCOW2}}
	}
	if err := p.checkExporterConfig(ctx, pod); err != nil {
		return spec, err // exporter.go: the pod waits for its exporter Secret
	}
	guest, err := podspec.PrepareGuestDisks(ctx, rec.dir, pod, podspec.ConfigSources{Secret: p.cfg.Secrets, ConfigMap: p.cfg.ConfigMaps})
	if err != nil {
		return spec, err
	}
	spec.Disks = append(spec.Disks, guest...)
	base, baseFormat := img.Disk, qemu.DiskFormat(img.DiskFormat)
	if b := p.prepareSnapshotStart(ctx, rec, pod, plan, img, &spec); b != "" { // snapshots.go
		base, baseFormat = b, qemu.FormatQCOW2
	}
	if err := spec.Validate(); err != nil {
		return spec, podspec.InvalidSpec{Err: fmt.Errorf("VM spec for image %s: %w", plan.Image, err)}
	}
	if img.Disk != "" {
		reason, msg, err := prepareOverlay(ctx, plan.StatePolicy, overlay, base, baseFormat) // state.go
		if err != nil {
			return spec, err
		}
		if reason != "" {
			klog.FromContext(ctx).Info("VM disk", "reason", reason, "message", msg)
			p.event(pod, corev1.EventTypeNormal, reason, msg)
		}
		if plan.DiskBytes > 0 { // set through the exporter (vmsize.go)
			grew, err := qemu.GrowImage(ctx, overlay, plan.DiskBytes)
			if err != nil {
				return spec, err
			}
			if grew {
				p.event(pod, corev1.EventTypeNormal, ReasonResized, fmt.Sprintf("VM disk grown to %s", podspec.BytesOf(plan.DiskBytes)))
			}
		}
	}
	return spec, nil
}

// arch is the node's guest architecture.
func (p *VMs) arch() qemu.Arch {
	if p.cfg.Arch != "" {
		return p.cfg.Arch
	}
	return qemu.HostArch()
}

// vmName is a QEMU-safe label: namespace.name, cut to 63 characters.
func vmName(pod *corev1.Pod) string {
	n := pod.Namespace + "." + pod.Name
	if len(n) > 63 {
		n = n[:63]
	}
	return strings.TrimRight(n, ".-_")
}

func imageID(img *oci.Image) string {
	repo := img.Ref
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	} else if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	return repo + "@" + img.Digest
}

// pullSecrets reads the pod's pull secrets as Docker config JSON documents;
// a missing secret is skipped with an event, as the kubelet does.
func (p *VMs) pullSecrets(ctx context.Context, pod *corev1.Pod, names []string) [][]byte {
	if p.cfg.Secrets == nil {
		return nil
	}
	var out [][]byte
	for _, n := range names {
		s, err := p.cfg.Secrets(ctx, pod.Namespace, n)
		if err != nil {
			p.event(pod, corev1.EventTypeWarning, "FailedToRetrieveImagePullSecret",
				fmt.Sprintf("Unable to retrieve image pull secret %q; the image pull may not succeed: %v", n, err))
			continue
		}
		if b, ok := s.Data[corev1.DockerConfigJsonKey]; ok {
			out = append(out, b)
		} else if b, ok := s.Data[corev1.DockerConfigKey]; ok {
			out = append(out, []byte(`{"auths":`+string(b)+`}`))
		}
	}
	return out
}

func (p *VMs) releaseImage(rec *podVM) {
	rec.mu.Lock()
	rel := rec.release
	rec.release = nil
	rec.mu.Unlock()
	if rel != nil {
		rel()
	}
}

// finishDelete stops the VM (if any) within the grace period, removes the
// state dir, pushes the terminal status and forgets the pod.
func (p *VMs) finishDelete(rec *podVM, vm VM) {
	rec.mu.Lock()
	if vm == nil {
		vm = rec.vm
	}
	grace := rec.grace
	pod := rec.pod.DeepCopy()
	rejected := rec.state.Rejection != nil
	rec.mu.Unlock()
	log := p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	ctx := context.WithoutCancel(p.base)
	// The exporter unregisters first: no lease lands on a VM going away.
	rec.stopExporter()
	p.dropSnapshotClaim(rec)

	if !rejected {
		if vm != nil {
			acpi := podstatus.ACPIBudget(grace)
			p.event(pod, corev1.EventTypeNormal, "Killing", fmt.Sprintf("Stopping VM (ACPI power button, %s before quit)", acpi.Round(time.Second)))
			// Everything is kept until the disk's reclaim policy is applied
			// below.
			ex, err := vm.Stop(ctx, qemu.StopOptions{Grace: acpi, QuitGrace: 2 * time.Second, Keep: []string{"*"}})
			if err != nil {
				log.Error(err, "Stop VM")
			}
			log.Info("VM stopped", "exitCode", ex.ExitCode, "reason", ex.Reason)
			p.cfg.Telemetry.VMExited(rec.uid, ex)
			rec.mu.Lock()
			started := time.Now()
			if rec.state.Running != nil {
				started = rec.state.Running.StartedAt.Time
			}
			rec.state.SetTerminated(podstatus.TerminatedFromExit(ex, started, podstatus.ContainerIDPrefix+string(rec.uid)))
			rec.vm = nil
			rec.mu.Unlock()
		} else {
			rec.mu.Lock()
			if rec.state.Terminated == nil {
				now := p.now()
				rec.state.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 137, Reason: "ContainerStatusUnknown",
					Message: "the pod was deleted before its VM started", StartedAt: podstatus.MetaTime(now), FinishedAt: podstatus.MetaTime(now)})
			}
			rec.mu.Unlock()
		}
		if p.reclaimDisk(ctx, rec, pod) { // state.go: the disk kept first, if asked
			if err := qemu.CleanStateDir(rec.dir, nil); err != nil {
				log.Error(err, "Remove pod state dir")
			}
		}
		p.releaseImage(rec)
	}
	rec.mu.Lock()
	rec.state.Final = true
	rec.removed = true
	rec.mu.Unlock()
	p.push(rec)
	p.pump.Flush(rec.uid) // the terminal status reaches the library before the pod goes
	p.mu.Lock()
	if p.pods[rec.uid] == rec {
		delete(p.pods, rec.uid)
	}
	p.mu.Unlock()
	rec.waitExporter(10 * time.Second)
	log.Info("Pod deleted from node")
	if p.cfg.ForceDelete != nil && pod.DeletionTimestamp != nil {
		if err := p.cfg.ForceDelete(ctx, p.snapshot(rec)); err != nil {
			log.V(1).Info("Final delete of pod", "err", err)
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// ---- kubelet API (logs.go, attach.go, portforward.go, exec.go, stats.go) ----

// GetContainerLogs returns the VM's serial console (logs.go).
func (p *VMs) GetContainerLogs(ctx context.Context, namespace, podName, containerName string, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	return p.consoleLogs(ctx, namespace, podName, containerName, opts)
}

// RunInContainer: exec needs a guest agent (exec.go).
func (p *VMs) RunInContainer(ctx context.Context, namespace, podName, containerName string, cmd []string, attach api.AttachIO) error {
	return p.execInVM(ctx, namespace, podName, containerName, cmd, attach)
}

// AttachToContainer attaches to the VM's serial console (attach.go).
func (p *VMs) AttachToContainer(ctx context.Context, namespace, podName, containerName string, attach api.AttachIO) error {
	return p.attachToConsole(ctx, namespace, podName, containerName, attach)
}

// PortForward forwards to a guest TCP port (portforward.go).
func (p *VMs) PortForward(ctx context.Context, namespace, pod string, port int32, stream io.ReadWriteCloser) error {
	return p.portForward(ctx, namespace, pod, port, stream)
}

// GetStatsSummary reports the node and each VM's QEMU process (stats.go).
func (p *VMs) GetStatsSummary(ctx context.Context) (*statsv1alpha1.Summary, error) {
	return p.statsSummary(ctx)
}

// GetMetricsResource is /metrics/resource for metrics-server (stats.go).
func (p *VMs) GetMetricsResource(ctx context.Context) ([]*dto.MetricFamily, error) {
	return p.metricsResource(ctx)
}

var (
	_ nodeutil.Provider = (*VMs)(nil)
	_ node.PodNotifier  = (*VMs)(nil)
)
