package provider

import (
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/cache"
)

// Status resync: the kubelet's status manager checks every pod's status in
// the API server against its own and rewrites it when they differ
// (syncBatch). The virtual-kubelet library does not: it sends a status only
// when the provider's changes, and skips one equal to the last it sent. So
// a status someone else overwrote (the node lifecycle controller marks every
// pod Ready=False when the node's lease lapses; a client patching the status
// subresource) stayed wrong until the VM's state next changed, which for an
// idle, healthy VM is never (issue #20).
//
// ResyncStatus is the check: cmd calls it for every update the pod informer
// sees (including its periodic resync), with the pod as the API server has
// it. When the status there differs in substance from the node's, the node's
// is pushed again, carrying the API object's resourceVersion so the library
// does not take it for the status it already sent.

// StatusResyncHandler is the pod informer handler cmd registers (beside the
// library's): every update of a pod, and the informer's periodic resync,
// checks its status with ResyncStatus.
func (p *VMs) StatusResyncHandler() cache.ResourceEventHandler {
	return cache.ResourceEventHandlerFuncs{
		UpdateFunc: func(_, obj any) {
			if pod, ok := obj.(*corev1.Pod); ok {
				p.ResyncStatus(pod)
			}
		},
	}
}

// ResyncStatus re-sends pod's status when the API server's copy (apiPod)
// disagrees with the node's. Unknown pods are ignored. Never blocks on the
// API server (the push is asynchronous, podstatus/statuspump.go).
func (p *VMs) ResyncStatus(apiPod *corev1.Pod) {
	if apiPod == nil {
		return
	}
	p.mu.Lock()
	run := p.pods[apiPod.UID]
	p.mu.Unlock()
	if run == nil {
		return
	}
	rec := run.rec
	if rec.deletion().removed {
		return
	}
	want := p.withStatus(rec)
	if !StatusDiverged(apiPod.Status, want.Status) {
		return
	}
	p.log.V(2).Info("Pod status in the API server differs from the node's; sending it again",
		"pod", apiPod.Namespace+"/"+apiPod.Name, "apiPhase", apiPod.Status.Phase, "phase", want.Status.Phase)
	rec.markResync(apiPod.ResourceVersion)
	p.push(rec)
}

// StatusDiverged reports whether the status in the API server (api) differs
// from the node's (want) in what the node owns and a reader acts on: the
// phase, reason, pod IP, the conditions' status and reason, and each
// container's readiness, state and restart count. Timestamps are left out
// (the API server keeps them at second precision, so comparing them would
// resend every status forever), as are fields others own (nominated node,
// resize, the scheduler's PodScheduled condition and any condition type
// the node does not write).
func StatusDiverged(api, want corev1.PodStatus) bool {
	if api.Phase != want.Phase || api.Reason != want.Reason || api.PodIP != want.PodIP {
		return true
	}
	for _, w := range want.Conditions {
		if w.Type == corev1.PodScheduled {
			continue
		}
		a := findCondition(api.Conditions, w.Type)
		if a == nil || a.Status != w.Status || a.Reason != w.Reason {
			return true
		}
	}
	if len(api.ContainerStatuses) != len(want.ContainerStatuses) {
		return true
	}
	for i, w := range want.ContainerStatuses {
		a := api.ContainerStatuses[i]
		if a.Name != w.Name || a.Ready != w.Ready || a.RestartCount != w.RestartCount ||
			boolValue(a.Started) != boolValue(w.Started) || stateKind(a.State) != stateKind(w.State) {
			return true
		}
	}
	return false
}

func findCondition(cs []corev1.PodCondition, t corev1.PodConditionType) *corev1.PodCondition {
	for i := range cs {
		if cs[i].Type == t {
			return &cs[i]
		}
	}
	return nil
}

func boolValue(b *bool) bool { return b != nil && *b }

// stateKind names a container state with its reason, e.g. "waiting:ImagePullBackOff".
func stateKind(s corev1.ContainerState) string {
	switch {
	case s.Running != nil:
		return "running"
	case s.Terminated != nil:
		return "terminated:" + s.Terminated.Reason
	case s.Waiting != nil:
		return "waiting:" + s.Waiting.Reason
	}
	return ""
}
