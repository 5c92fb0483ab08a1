package provider

import (
	"context"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/probe"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
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
	// OverlayFileName is the VM's writable disk (qcow2 over the image;
	// package poddisk).
	OverlayFileName = poddisk.OverlayFileName
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
	// Telemetry receives start/exit metrics and spans (optional; telemetry/tracing.go).
	Telemetry *telemetry.Telemetry
	// Exporters runs the Jumpstarter exporters of pods that name an
	// exporter Secret (package exporter); nil: such pods show the exporter
	// condition Failed (their VMs still run).
	Exporters exporter.Runner
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
	// (podspec/cgroup.go) derives from the pod; nil: the agent's cgroup.
	VMCgroup *qemu.Cgroup
	// VMUser, when set, is the uid and gid every QEMU starts as (vmUser in
	// the node configuration; qemu.Spec.RunAs); nil: the agent's own. VMs
	// found running are adopted as they run, whatever their user.
	VMUser *qemu.User
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
	// pump delivers statuses to notify, per pod, newest only (podstatus/statuspump.go).
	pump podstatus.StatusPump
	// snaps: who creates which memory snapshot (package snapshot).
	snaps snapshot.Store
}

// podVM is one pod's record, shared by the goroutines that serve the pod:
// its worker (worker.go), which alone starts, stops and replaces the VM;
// the kubelet-API entry points (CreatePod, UpdatePod, DeletePod, GetPod...);
// the status pump; the probes; the exporter supervisor; the status resync.
// Each group below says who writes it and which lock guards it. The
// worker's own state (the request it serves, the request waiting for the
// next start, the back-off timer) is on worker (worker.go), off this record.
type podVM struct {
	// Identity: set by newPodVM, never changed (no lock).
	uid types.UID
	dir string

	// vm is the running VM, the one copy of it (no lock): set by the
	// worker alone (recovery sets an adopted one before the worker
	// starts); the worker, console, port-forward, exec, stats and the
	// exporter read it.
	vm runningVM

	// Signals: made by newPodVM, never replaced (no lock).
	//
	// ctl carries power and flash requests (package exporter) to the worker.
	ctl       chan vmRequest
	deleteReq chan struct{} // closed by DeletePod
	confirmed chan struct{} // closed (through confirm) once the pod is known to still exist
	confirm   sync.Once
	done      chan struct{} // closed when the worker ends

	// mu guards the record and every group below but statusFile.mu. It is
	// taken after VMs.mu and after statusFile.mu, never before them
	// (docs/architecture.md).
	mu sync.Mutex
	// The record, read by every owner under mu.
	//
	// pod is the pod as bound, with its current metadata: replaced under
	// mu (UpdatePod, DeletePod), never changed in place, so a pointer read
	// under mu stays valid.
	pod *corev1.Pod
	// plan is the pod's VM plan (podspec), set when the pod is admitted.
	plan podspec.Plan
	// state is the pod's VMState: written by its worker, by recovery
	// before the worker starts, and by the exporter (a VM size); persisted
	// to status.json (persist.go).
	state podstatus.VMState
	// release gives up the pod's hold on its image (nil: none): the worker's.
	release func()
	// probes is the readiness of the current run (probes.go); nil: no
	// readiness probe. Replaced by the worker at each start.
	probes *probe.State

	// exp is the pod's Jumpstarter exporter (nil: none started): set once
	// by the worker (startExporter, exporter.go); it lives with the pod and
	// owns its own state (the condition it shows).
	exp *exporter.Supervisor

	handoff workerHandoff
	del     podDeletion
	snap    snapshotRun
	resync  statusResync
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
// alone after (run reads and clears pendingExit under podVM.mu).
type workerHandoff struct {
	// pendingExit: recovered with a VM that ended while nobody watched;
	// the restart policy still has to be applied.
	pendingExit bool
	// unrecorded: the intent record (pod.json) is not written yet: the
	// worker writes it before anything of the VM exists (record).
	unrecorded bool
}

// podDeletion is the pod's deletion (lifecycle.go, delete.go), under
// podVM.mu: DeletePod sets deleting and grace; the worker's finishDelete
// sets removed once the state dir is gone.
type podDeletion struct {
	deleting bool
	grace    time.Duration
	removed  bool
}

// snapshotRun is the current run's memory snapshot (snapshots.go, package
// snapshot), under
// podVM.mu: written by the worker when it starts the VM; the claim is
// taken by saveSnapshot (at readiness) or dropped by the worker.
type snapshotRun struct {
	// claim is the snapshot this run saves at readiness.
	claim *snapshot.Claim
	// used is the snapshot the run was restored from.
	used *snapshot.Use
	// restoreFailed makes the next decision boot.
	restoreFailed bool
}

// statusResync is the status resync's (statusresync.go), under podVM.mu.
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
	// failing: the last write failed (an event was sent); under podVM.mu,
	// written by whoever persists.
	failing bool
}

// newPodVM is the record of a new pod (CreatePod) or a recovered one
// (recovery.go), before its worker starts.
func newPodVM(uid types.UID, dir string, pod *corev1.Pod) *podVM {
	return &podVM{uid: uid, dir: dir, pod: pod, ctl: make(chan vmRequest),
		deleteReq: make(chan struct{}), confirmed: make(chan struct{}), done: make(chan struct{})}
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

// findLocked returns the live record for namespace/name: the one not being
// deleted, else any.
func (p *VMs) findLocked(namespace, name string) *podVM {
	var any *podVM
	for _, r := range p.pods {
		r.mu.Lock()
		match := r.pod.Namespace == namespace && r.pod.Name == name && !r.del.removed
		deleting := r.del.deleting
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
		if !r.del.deleting && !r.state.Final && r.state.Rejection == nil {
			out = append(out, podspec.WithMemoryClaim(r.pod, r.state.Size.MemoryOrZero())) // exporter/vmsize.go
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
	if rec.resync.apiResourceVersion != "" {
		pod.ResourceVersion = rec.resync.apiResourceVersion // statusresync.go
	}
	pod.Status = podstatus.PodStatus(rec.pod, rec.state, p.cfg.NodeIP, p.now())
	probe.Apply(&pod.Status, rec.pod, rec.probes)      // probes.go: readiness probe result
	rec.exp.Apply(&pod.Status)                         // package exporter: the Jumpstarter exporter condition
	podstatus.ApplyVMSize(&pod.Status, rec.state.Size) // exporter/vmsize.go: a size set through the exporter
	return pod
}

// push has the pod's current status sent to the library: asynchronously,
// coalesced per pod and in order (podstatus/statuspump.go).
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
		p.cfg.Telemetry.StatusDelivered(p.log, pod, sent, time.Now()) // telemetry/timeline.go
	})
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
