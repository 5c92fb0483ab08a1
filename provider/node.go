package provider

import (
	"context"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
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
	// CPUModels are the guest CPU models of pods that name none, by
	// accelerator (cpuModel in the node configuration; podspec.CPUModel).
	CPUModels map[qemu.Accelerator]string
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

// nodeWide is what the node's pods share: the node's configuration, the
// context that bounds the workers, the log, the features in force, the
// status pump and the library's status callback, the event recorder and
// the memory snapshots' store. VMs (vms.go) embeds it beside the pod map
// and admission's lock; each pod's run (podRun, podrun.go) holds it as its
// node.
//
// Who writes each field:
//
//	cfg, base, log   NewVMs; never changed after
//	now              NewVMs (tests set it before any pod exists)
//	features         SetFeatures (the reload's owner)           atomic
//	featuresChanged  SetFeatures: replaced, the old one closed  atomic
//	notify           NotifyPods (the library)                   atomic
//	recorder         NewVMs, SetRecorder                        atomic
//	pump, snaps      safe for concurrent use (their packages)
type nodeWide struct {
	cfg  VMsConfig
	base context.Context
	log  klog.Logger
	now  func() time.Time

	// features are the features in force, read anywhere (features.go).
	features atomic.Pointer[config.FeatureConfig]
	// featuresChanged is closed (and replaced) by SetFeatures: it wakes
	// the pods held for features.
	featuresChanged atomic.Pointer[chan struct{}]
	// notify is the library's status callback (nil: none yet).
	notify atomic.Pointer[func(*corev1.Pod)]
	// recorder receives the pods' events (nil: none).
	recorder atomic.Pointer[eventRecorder]
	// pump delivers statuses to notify, per pod, newest only (podstatus/statuspump.go).
	pump podstatus.StatusPump
	// snaps: who creates which memory snapshot (package snapshot).
	snaps snapshot.Store
}

// eventRecorder holds a record.EventRecorder for nodeWide.recorder.
type eventRecorder struct{ r record.EventRecorder }

// init sets up the node's side of a new VMs (cfg with its defaults).
func (p *nodeWide) init(ctx context.Context, cfg VMsConfig) {
	p.cfg, p.base, p.log, p.now = cfg, ctx, klog.FromContext(ctx).WithName("vms"), time.Now
	p.features.Store(cfg.Features)
	ch := make(chan struct{})
	p.featuresChanged.Store(&ch)
	p.setRecorder(cfg.Recorder)
}

func (p *nodeWide) vmsDir() string { return filepath.Join(p.cfg.StateDir, VMsDirName) }

func (p *nodeWide) podDir(uid types.UID) string { return filepath.Join(p.vmsDir(), string(uid)) }

// arch is the node's guest architecture.
func (p *nodeWide) arch() qemu.Arch {
	if p.cfg.Arch != "" {
		return p.cfg.Arch
	}
	return qemu.HostArch()
}

func (p *nodeWide) allocatable() corev1.ResourceList {
	if p.cfg.Allocatable == nil {
		return nil
	}
	return p.cfg.Allocatable()
}

// withStatus is the pod with its current status (not a memory snapshot:
// snapshots.go).
func (p *nodeWide) withStatus(rec *podVM) *corev1.Pod {
	return rec.withStatus(p.cfg.NodeIP, p.now())
}

// push has the pod's current status sent to the library: asynchronously,
// coalesced per pod and in order (podstatus/statuspump.go).
func (p *nodeWide) push(rec *podVM) {
	p.pump.Push(rec.uid, func() {
		cb := p.notify.Load()
		pod := p.withStatus(rec)
		sent := time.Now()
		if cb != nil {
			(*cb)(pod)
		}
		p.cfg.Telemetry.StatusDelivered(p.log, pod, sent, time.Now()) // telemetry/timeline.go
	})
}

// setNotify sets the library's status callback.
func (p *nodeWide) setNotify(cb func(*corev1.Pod)) { p.notify.Store(&cb) }

func (p *nodeWide) event(pod *corev1.Pod, typ, reason, msg string) {
	if r := p.recorder.Load(); r != nil && r.r != nil {
		r.r.Event(pod, typ, reason, msg)
	}
}

// setRecorder sets the recorder of pod events.
func (p *nodeWide) setRecorder(r record.EventRecorder) { p.recorder.Store(&eventRecorder{r: r}) }
