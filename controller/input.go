package controller

import (
	"fmt"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/types"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The planner's input made from the set and its pods as read.

// plannerInput makes the planner's input from the set, its resolved
// (effective) spec and what was observed of its pods.
func plannerInput(set *v1alpha1.ExporterSet, res *Resolved, obs observed, drainDelay time.Duration, now time.Time) Input {
	eff := res.Set
	in := Input{
		Replicas:             derefOr(eff.Spec.Replicas, 1),
		MinAvailable:         derefOr(eff.Spec.MinAvailable, 0),
		MaxReplicas:          eff.Spec.MaxReplicas,
		Recycle:              eff.Spec.RecyclePolicy,
		Cooldown:             30 * time.Second,
		TemplateHash:         obs.hash,
		WaitForFirstConsumer: res.BindingMode == v1alpha1.BindingModeWaitForFirstConsumer,
		ScaleIn:              eff.Spec.ScaleInPolicy,
		Paused:               eff.Spec.Paused,
		Removing:             parseRemoving(set.Annotations[v1alpha1.RemovingAnnotation]),
		PendingCreates:       int32(len(obs.creating)),
		Demand:               obs.demand,
		Now:                  now,

		ConsecutiveFailures: set.Status.ConsecutiveFailures,
	}
	if a := eff.Spec.Autohealing; a != nil {
		in.Autohealing = &Autohealing{StartUpFailureThreshold: derefOr(a.StartUpFailureThreshold, 3), MinFailingToStartDuration: 5 * time.Minute}
		if a.MinFailingToStartDuration != nil {
			in.Autohealing.MinFailingToStartDuration = a.MinFailingToStartDuration.Duration
		}
	}
	if c := meta.FindStatusCondition(set.Status.Conditions, v1alpha1.ConditionReplicaFailure); c != nil {
		if prev := (Condition{c.Type, c.Status, c.Reason, c.Message}); IsRepeatedFailure(&prev) {
			in.LastFailure = &prev
		}
	}
	if in.Recycle == "" {
		in.Recycle = v1alpha1.RecyclePolicyReplace
	}
	if eff.Spec.ScaleDownCooldown != nil {
		in.Cooldown = eff.Spec.ScaleDownCooldown.Duration
	}
	if t := set.Status.ScaleDownPendingSince; t != nil {
		in.ScaleDownPendingSince = &t.Time
	}
	if t := set.Status.LastFailureTime; t != nil {
		in.LastFailureTime = &t.Time
	}
	for i := range obs.owned {
		if !obs.deleting[obs.owned[i].UID] {
			ps := podState(&obs.owned[i], obs.leases[obs.owned[i].Name])
			if obs.js != nil {
				ps.Exporter = exporterState(obs.js.exporters[ps.Name])
				ps.GateReason = obs.gated[ps.Name]
			}
			in.Pods = append(in.Pods, ps)
		}
	}
	if obs.js != nil {
		in.Jumpstarter = &JumpstarterInput{DrainDelay: drainDelay, Cold: exporterState(obs.js.cold)}
		in.Jumpstarter.Cold.Leased = obs.js.coldLease != ""
		obs.js.sweepInput(in.Jumpstarter, set.Name, obs.creating, obs.deleting)
	}
	return in
}

// podState extracts what the planner needs from a pod.
func podState(p *corev1.Pod, l Lease) PodState {
	s := PodState{
		Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion, Created: p.CreationTimestamp.Time,
		Phase: p.Status.Phase, Terminating: p.DeletionTimestamp != nil,
		Leased: l.Leased, Used: l.Used, LeaseExpires: l.Expires, TemplateHash: p.Labels[v1alpha1.TemplateHashLabel],
		RemoveRequested: p.Annotations[v1alpha1.RemoveAnnotation] == "true",
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			s.Ready, s.ReadySince = true, c.LastTransitionTime.Time
		}
		if c.Type == corev1.PodReady && c.Status != corev1.ConditionTrue {
			s.NotReadySince = c.LastTransitionTime.Time
		}
	}
	if len(p.Status.ContainerStatuses) > 0 {
		s.RestartCount = p.Status.ContainerStatuses[0].RestartCount
	}
	statuses := append(append([]corev1.ContainerStatus{}, p.Status.InitContainerStatuses...), p.Status.ContainerStatuses...)
	for _, cs := range statuses {
		if w := cs.State.Waiting; w != nil && w.Reason != "" && s.WaitingReason == "" {
			s.WaitingReason, s.WaitingMessage = w.Reason, w.Message
		}
		if t := cs.State.Terminated; t != nil && s.FailedReason == "" && t.ExitCode != 0 {
			s.FailedReason, s.FailedMessage = t.Reason, fmt.Sprintf("container %s exited %d: %s", cs.Name, t.ExitCode, t.Message)
		}
	}
	if p.Status.Reason != "" {
		s.FailedReason, s.FailedMessage = p.Status.Reason, p.Status.Message
	}
	return s
}

// parseRemoving reads v1alpha1.RemovingAnnotation: sorted UIDs.
func parseRemoving(v string) []types.UID {
	if v == "" {
		return nil
	}
	var out []types.UID
	for _, s := range strings.Split(v, ",") {
		if s = strings.TrimSpace(s); s != "" {
			out = append(out, types.UID(s))
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}
func derefOr(p *int32, def int32) int32 {
	if p == nil {
		return def
	}
	return *p
}
