package controller

import (
	"fmt"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The status step of Plan (step 9): the Available and Progressing
// conditions from what the steps before decided.

// availableInput is what availableCondition looks at.
type availableInput struct {
	Ready, Target int32
	// Available counts the Ready unleased unused pods; WantAvailable is
	// how many the set wants (minAvailable, at most the unleased target).
	Available, WantAvailable int32
}

// reasonComplete is Progressing False: every pod at the current template,
// nothing to create or delete.
const reasonComplete = "Complete"

// availableCondition is True when the target's pods are Ready and enough
// of them are available.
func availableCondition(in availableInput) Condition {
	msg := fmt.Sprintf("%d/%d pods ready, %d/%d available", in.Ready, in.Target, in.Available, in.WantAvailable)
	if in.Ready >= in.Target && in.Available >= in.WantAvailable {
		return Condition{v1alpha1.ConditionAvailable, metav1.ConditionTrue, "MinimumReplicasAvailable", msg}
	}
	return Condition{v1alpha1.ConditionAvailable, metav1.ConditionFalse, "MinimumReplicasUnavailable", msg}
}

// pausedWork is what a paused set would do (Plan withholds it).
type pausedWork struct {
	Create, Delete, Exporters int
	// Removals counts the unleased pods marked for removal.
	Removals int32
}

// progressInput is what progressing looks at: each field is a decision of
// an earlier step.
type progressInput struct {
	Paused bool
	Would  pausedWork
	// Removals (now) and RemovalsWaiting (leased) from planRemovals;
	// Replicas is spec.replicas after them.
	Removals, RemovalsWaiting, Replicas int32
	// BackingOff, Failures and BackoffWait from backoff and planCreates.
	BackingOff  bool
	Failures    int32
	BackoffWait time.Duration
	// Create and PendingCreates: pods created now and still in flight.
	Create, PendingCreates, Target int32
	// Draining exporters and their DrainDelay (planExporters).
	Draining   int
	DrainDelay time.Duration
	// Retiring released pods (recycleReleased).
	Retiring int
	// Outdated pods and how many of them are leased (countPods).
	Outdated, OutdatedLeased int
	// Scale-down (planScaleDown).
	ScaleDown scaleDownDecision
	// Updated counts the pods at the current template.
	Updated int
}

// progressing is the Progressing condition: the first of the reasons, in
// this order, that the set is not yet where its spec wants it.
func progressing(in progressInput) Condition {
	prog := Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionTrue}
	sd := in.ScaleDown
	switch {
	case in.Paused:
		prog.Status, prog.Reason = metav1.ConditionUnknown, "Paused"
		prog.Message = fmt.Sprintf("spec.paused: scaling stopped; would create %d and delete %d pods", in.Would.Create, in.Would.Delete)
		if in.Would.Exporters > 0 {
			prog.Message += fmt.Sprintf(" and change %d exporters", in.Would.Exporters)
		}
		if in.Would.Removals > 0 {
			prog.Message += fmt.Sprintf("; %d pods marked %s=true wait", in.Would.Removals, v1alpha1.RemoveAnnotation)
		}
	case in.Removals > 0:
		prog.Reason, prog.Message = "Removing", fmt.Sprintf("removing %d pods marked %s=true; spec.replicas %d", in.Removals, v1alpha1.RemoveAnnotation, in.Replicas)
	case in.BackingOff:
		prog.Reason, prog.Message = "FailureBackoff", fmt.Sprintf("%d pods failed in a row; next create in %s", in.Failures, in.BackoffWait.Round(time.Second))
	case in.Create > 0 || in.PendingCreates > 0:
		prog.Reason, prog.Message = "ScalingUp", fmt.Sprintf("creating %d pods (%d in flight) towards %d", in.Create, in.PendingCreates, in.Target)
	case in.Draining > 0:
		prog.Reason, prog.Message = "DrainingExporters", fmt.Sprintf("%d exporters disabled; their pods go once unleased for %s", in.Draining, in.DrainDelay)
	case in.Retiring > 0:
		prog.Reason, prog.Message = "Recycling", fmt.Sprintf("deleting %d released pods", in.Retiring)
	case in.Outdated > 0:
		prog.Reason, prog.Message = "RollingOut", fmt.Sprintf("%d pods outdated (%d leased, replaced after release)", in.Outdated, in.OutdatedLeased)
	case sd.Waiting:
		prog.Reason, prog.Message = "ScaleDownCooldown", fmt.Sprintf("%d pods above target %d; waiting for the cooldown", sd.Excess, in.Target)
	case sd.ExplicitExcess > 0:
		prog.Status, prog.Reason = metav1.ConditionFalse, "ExplicitScaleIn"
		prog.Message = fmt.Sprintf("%d pods above target %d; scaleInPolicy Explicit removes only pods annotated %s=true", sd.ExplicitExcess, in.Target, v1alpha1.RemoveAnnotation)
	case in.RemovalsWaiting > 0:
		prog.Status, prog.Reason = metav1.ConditionFalse, "RemovalWaitsForRelease"
		prog.Message = fmt.Sprintf("%d pods marked %s=true are leased; they go once released", in.RemovalsWaiting, v1alpha1.RemoveAnnotation)
	case sd.Excess > 0 && sd.Candidates > 0:
		prog.Reason, prog.Message = "ScalingDown", fmt.Sprintf("deleting %d pods towards %d", min(int(sd.Excess), sd.Candidates), in.Target)
	default:
		prog.Status, prog.Reason, prog.Message = metav1.ConditionFalse, reasonComplete, fmt.Sprintf("%d pods at the current template", in.Updated)
	}
	return prog
}
