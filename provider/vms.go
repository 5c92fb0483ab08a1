package provider

import (
	"context"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/telemetry"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
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

// VMs is the pod side of the provider: every pod bound to the node becomes
// one QEMU VM. It implements the virtual-kubelet PodLifecycleHandler and
// PodNotifier: status is pushed on every transition (pull results, VM start,
// VM exit events), never polled. It holds what the node's pods share
// (nodeWide, node.go), the pod map and admission's lock; each pod's work is
// its run (podRun, podrun.go).
type VMs struct {
	nodeWide

	// mu guards pods; admission holds it while it counts the active pods
	// and inserts the new one.
	mu   sync.Mutex
	pods map[types.UID]*podRun
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
	p := &VMs{pods: map[types.UID]*podRun{}}
	p.init(ctx, cfg)
	return p
}

// findLocked returns the run of the live record for namespace/name: the
// one not being deleted, else any.
func (p *VMs) findLocked(namespace, name string) *podRun {
	var any *podRun
	for _, r := range p.pods {
		match, deleting := r.rec.matches(namespace, name)
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
		if pod := r.rec.admissionClaim(); pod != nil {
			out = append(out, pod)
		}
	}
	return out
}

// admitting calls f with the active pods' claims under admission's lock
// (podSet).
func (p *VMs) admitting(f func(active []*corev1.Pod) error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return f(p.activePodsLocked())
}

// forget removes r from the pod map if it still holds r (podSet).
func (p *VMs) forget(r *podRun) {
	p.mu.Lock()
	if p.pods[r.rec.uid] == r {
		delete(p.pods, r.rec.uid)
	}
	p.mu.Unlock()
}

// records are the records of the pods known now.
func (p *VMs) records() []*podVM {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]*podVM, 0, len(p.pods))
	for _, r := range p.pods {
		out = append(out, r.rec)
	}
	return out
}

// SetRecorder sets the recorder of pod events (e.g. once the pod
// controller's event broadcaster exists).
func (p *VMs) SetRecorder(r record.EventRecorder) { p.setRecorder(r) }
