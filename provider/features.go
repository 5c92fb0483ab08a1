package provider

import (
	"context"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// ReasonFeatureDisabled is the waiting reason (and event reason) of a pod
// held because it needs a feature the node's configuration disables.
const ReasonFeatureDisabled = "FeatureDisabled"

// SetFeatures swaps in the features in force (a configuration reload) and
// wakes the pods held for features, which start if nothing holds them any
// more. Running VMs are not touched; console log sizes apply to VMs started
// from now on. The caller owns reloads; f is never changed after this.
func (p *VMs) SetFeatures(f *config.FeatureConfig) {
	p.features.Store(f)
	ch := make(chan struct{})
	close(*p.featuresChanged.Swap(&ch))
}

// Features returns the features in force.
func (p *nodeWide) Features() *config.FeatureConfig {
	if f := p.features.Load(); f != nil {
		return f
	}
	return config.DefaultFeatures()
}

// featureWatch returns the channel closed by the next SetFeatures and the
// features in force, in that order, so no change is missed.
func (p *nodeWide) featureWatch() (<-chan struct{}, *config.FeatureConfig) {
	ch := *p.featuresChanged.Load()
	return ch, p.Features()
}

// holdForFeatures keeps a pod that needs a disabled feature waiting
// (Waiting/FeatureDisabled, a warning event) until the features it needs
// are enabled. It returns true when the pod may start, false when it was
// deleted or the provider stops (the worker checks which).
func (r *podRun) holdForFeatures(ctx context.Context) bool {
	p, rec := r.node, r.rec
	held := ""
	for {
		ch, features := p.featureWatch()
		pod, st := rec.read()
		h := podspec.DecideHold(pod, rec.plan, features, p.cfg.NodeName, st.Started)
		if h == nil {
			if held != "" {
				klog.FromContext(ctx).Info("Features enabled; starting the pod", "features", held)
				p.event(pod, corev1.EventTypeNormal, "FeatureEnabled", "feature(s) "+held+" enabled on node "+p.cfg.NodeName+"; starting the VM")
				r.update(func(st *podstatus.VMState) { st.SetWaiting(podstatus.ReasonContainerCreating, "") })
			}
			return true
		}
		if names := strings.Join(h.Features, ", "); names != held {
			held = names
			klog.FromContext(ctx).Info("Pod held: it needs a disabled feature", "features", held)
			p.event(pod, corev1.EventTypeWarning, ReasonFeatureDisabled, h.Message)
			r.update(func(st *podstatus.VMState) { st.SetWaiting(ReasonFeatureDisabled, h.Message) })
		}
		select {
		case <-ch:
		case <-rec.deleteReq:
			return false
		case <-ctx.Done():
			return false
		}
	}
}
