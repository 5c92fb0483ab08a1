package provider

import (
	"context"
	"path/filepath"
	"sync/atomic"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
)

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
