package provider

import (
	"context"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
)

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

// newRun is the run of a new pod (CreatePod) or a recovered one
// (recovery.go) and its record, before its worker starts.
func (p *VMs) newRun(pod *corev1.Pod) *podRun {
	return &podRun{node: &p.nodeWide, pods: p, rec: newPodVM(pod.UID, p.podDir(pod.UID), pod)}
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
