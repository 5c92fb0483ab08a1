package controller

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// The status of an upstream set, in upstream's fields and condition types,
// from the planner's Status.

// upstreamStatusInput is what upstreamStatus looks at.
type upstreamStatusInput struct {
	// Plan is the planner's status; nil when the set could not be planned
	// (Failure says why): the counts then stay as last written.
	Plan    *Status
	Failure *ClassError
	// Pods are the set's live pods (for the phase counts); Exporters
	// their Exporters by pod name (for the exporter counts).
	Pods      []corev1.Pod
	Exporters map[string]*jsv1.Exporter
	// Knobs are the mapped spec (MaxReplicas for ScalingLimited).
	Knobs Input
	// Selector is status.selector (upstreamSelector); "" keeps the last.
	Selector string
}

// upstreamSelector is an upstream set's status.selector, the scale
// subresource's labelSelectorPath: spec.selector serialized, as upstream's
// controller writes it. It selects the set's Exporters and, as they carry
// the template's labels, its pods (HPA). "" when spec.selector is empty or
// invalid: a scale subresource reads "" as every pod of the namespace.
func upstreamSelector(set *vtv1.ExporterSet) string {
	sel, err := metav1.LabelSelectorAsSelector(&set.Spec.Selector)
	if err != nil {
		return ""
	}
	return sel.String()
}

// upstreamConditions are an upstream set's four conditions, in order.
type upstreamConditions [4]Condition

// The reasons upstream's reconciler gives an upstream set's conditions in
// their steady states (jumpstarter-dev/jumpstarter b1f2bb41,
// controller/internal/exporterset): an upstream set shows them as a set
// of upstream's own provisioner does. Work in progress keeps the
// planner's reasons, which say more (ScalingDown, ScaleDownCooldown, ...).
const (
	// ReasonNoReplicasRequired: Available, minReplicas 0 and no instance.
	ReasonNoReplicasRequired = "NoReplicasRequired"
	// ReasonAllReplicasReady: Progressing False, nothing left to do.
	ReasonAllReplicasReady = "AllReplicasReady"
	// ReasonAllReplicasHealthy: Degraded False.
	ReasonAllReplicasHealthy = "AllReplicasHealthy"
	// ReasonWithinLimits: ScalingLimited False.
	ReasonWithinLimits = "WithinLimits"
	// ReasonAtMaxReplicas: ScalingLimited True, maxReplicas caps the set.
	ReasonAtMaxReplicas = "AtMaxReplicas"
)

// upstreamStatus is the status an upstream set shows: the counts and the
// conditions Available, Progressing, Degraded and ScalingLimited. Pure.
// Exporter counts are those of the pods' Exporters (exporterCounts).
func upstreamStatus(prev vtv1.ExporterSetStatus, in upstreamStatusInput) (vtv1.ExporterSetStatus, upstreamConditions) {
	st := prev
	st.Conditions = nil
	if in.Selector != "" {
		st.Selector = in.Selector
	}
	if in.Failure != nil {
		return st, upstreamConditions{
			{vtv1.ExporterSetConditionAvailable, metav1.ConditionFalse, in.Failure.Reason, "the set cannot be planned: see Degraded"},
			{vtv1.ExporterSetConditionProgressing, metav1.ConditionFalse, in.Failure.Reason, "nothing is created or deleted until the set is fixed"},
			{vtv1.ExporterSetConditionDegraded, metav1.ConditionTrue, in.Failure.Reason, in.Failure.Message},
			{vtv1.ExporterSetConditionScalingLimited, metav1.ConditionFalse, ReasonWithinLimits, "not planned"},
		}
	}
	p := in.Plan
	st.Replicas, st.ReadyReplicas, st.AvailableReplicas, st.LeasedReplicas = p.Replicas, p.Ready, p.Available, p.Leased
	st.UnavailableReplicas = max(p.Replicas-p.Ready, 0)
	st.PodsPending, st.PodsRunning, st.PodsFailed, st.PodsUnknown = 0, 0, 0, 0
	for i := range in.Pods {
		switch in.Pods[i].Status.Phase {
		case corev1.PodPending, "":
			st.PodsPending++
		case corev1.PodRunning:
			st.PodsRunning++
		case corev1.PodFailed:
			st.PodsFailed++
		default:
			st.PodsUnknown++
		}
	}
	st.ExportersActive, st.ExportersIdle, st.ExportersDisabled, st.ExportersOffline = exporterCounts(in.Pods, in.Exporters)

	var out upstreamConditions
	out[0] = conditionOf(p.Conditions, v1alpha1.ConditionAvailable, vtv1.ExporterSetConditionAvailable)
	if out[0].Status == metav1.ConditionTrue && in.Knobs.Replicas == 0 && p.Replicas == 0 {
		out[0].Reason = ReasonNoReplicasRequired
	}
	out[1] = conditionOf(p.Conditions, v1alpha1.ConditionProgressing, vtv1.ExporterSetConditionProgressing)
	if out[1].Status == metav1.ConditionFalse && out[1].Reason == reasonComplete {
		out[1].Reason = ReasonAllReplicasReady
	}
	out[2] = Condition{vtv1.ExporterSetConditionDegraded, metav1.ConditionFalse, ReasonAllReplicasHealthy, "no instance fails"}
	if f := conditionOf(p.Conditions, v1alpha1.ConditionReplicaFailure, ""); f.Status == metav1.ConditionTrue {
		out[2] = Condition{vtv1.ExporterSetConditionDegraded, metav1.ConditionTrue, f.Reason, f.Message}
	}
	out[3] = Condition{vtv1.ExporterSetConditionScalingLimited, metav1.ConditionFalse, ReasonWithinLimits, "maxReplicas holds nothing back"}
	if m := in.Knobs.MaxReplicas; m != nil {
		if want := Target(in.Knobs.Replicas, in.Knobs.MinAvailable, p.Leased, p.PendingLeases, nil); want > *m {
			out[3] = Condition{vtv1.ExporterSetConditionScalingLimited, metav1.ConditionTrue, ReasonAtMaxReplicas,
				fmt.Sprintf("%d instances wanted (minReplicas %d, minAvailableReplicas %d, %d leased, %d pending leases), maxReplicas %d",
					want, in.Knobs.Replicas, in.Knobs.MinAvailable, p.Leased, p.PendingLeases, *m)}
		}
	}
	return st, out
}

// conditionOf is the condition of type from in the planned conditions
// (the last one of that type), renamed to as; Unknown when absent.
func conditionOf(cs []Condition, from, as string) Condition {
	out := Condition{as, metav1.ConditionUnknown, "NotPlanned", "the planner said nothing"}
	for _, c := range cs {
		if c.Type == from {
			out = Condition{as, c.Status, c.Reason, c.Message}
		}
	}
	if as == "" {
		out.Type = from
	}
	return out
}
