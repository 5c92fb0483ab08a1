package controller

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Plan decides what to create and delete and what the status is. It is pure:
// the same input always gives the same actions.
//
// It runs named steps in order, each a pure function over plain data (pod
// facts, counts, lease facts) that sees only the input and what the steps
// before it decided: leases expire (expireLeases), marked pods are removed
// (planRemovals), finished and failing pods go (finishPods), released pods
// are recycled (recycleReleased), the live pods are counted against the
// Target, the failure backoff is kept (backoff), then creates
// (planCreates), the rollout (planRollout), scale-down (planScaleDown) and,
// in Jumpstarter mode, the Exporters (planExporters); a paused set does
// none of it; in Jumpstarter mode, paused or not, the Exporters whose pod
// is gone are deleted (sweepExporters); last the status.
func Plan(in Input) Actions {
	var acts Actions
	exp := expireLeases(leaseExpiryInput{Pods: in.Pods, Now: in.Now})
	pods := exp.Pods

	rm := planRemovals(removalInput{Pods: pods, Counted: in.Removing, Replicas: in.Replicas, Paused: in.Paused})
	acts.Delete, acts.Set = append(acts.Delete, rm.Delete...), rm.Set
	// What counts towards the target (bindingMode WaitForFirstConsumer:
	// only leases).
	targetReplicas, minAvailable := rm.Replicas, in.MinAvailable
	if in.WaitForFirstConsumer {
		targetReplicas, minAvailable = 0, 0
	}

	heal := in.Autohealing
	if in.Paused {
		heal = nil
	}
	fin := finishPods(finishInput{Pods: pods, Removed: rm.Removed, Autohealing: heal, Now: in.Now})
	acts.Delete = append(acts.Delete, fin.Delete...)

	rec := recycleReleased(recycleInput{Live: fin.Live, Reuse: in.Recycle == v1alpha1.RecyclePolicyReuse, Expired: exp.Expired})
	acts.Delete = append(acts.Delete, rec.Delete...)
	acts.MarkUsed, acts.ExpireLease, acts.ClearUsed = rec.MarkUsed, rec.ExpireLease, rec.ClearUsed
	live := rec.Live

	n := countPods(countInput{Live: live, TemplateHash: in.TemplateHash, Exporters: in.Jumpstarter != nil})
	target := Target(targetReplicas, minAvailable, n.Leased, in.Demand, in.MaxReplicas)

	bo := backoff(backoffInput{Failures: in.ConsecutiveFailures, LastFailure: in.LastFailureTime,
		NewFailures: fin.NewFailures, Paused: in.Paused, Live: live, Now: in.Now})

	have := int32(len(n.Updated)+len(n.OldLeased)) + in.PendingCreates
	cr := planCreates(createInput{Target: target, Have: have, PendingCreates: in.PendingCreates,
		Live: int32(len(live)), MaxReplicas: in.MaxReplicas, BackoffWait: bo.Wait})
	acts.Create = cr.Create

	wantUnleased := max(target-n.Leased, 0)
	acts.Delete = append(acts.Delete, planRollout(rolloutInput{OldUnleased: n.OldUnleased,
		WantUnleased: wantUnleased, NewReadyUnleased: n.NewReadyUnleased, CappedByMax: cr.CappedByMax})...)

	sd := planScaleDown(scaleDownInput{Updated: n.Updated, Excess: have - target,
		OldestFirst: in.ScaleIn == v1alpha1.ScaleInOldest, Explicit: in.ScaleIn == v1alpha1.ScaleInExplicit,
		Exporters: in.Jumpstarter != nil, PendingSince: in.ScaleDownPendingSince, Cooldown: in.Cooldown, Now: in.Now})
	acts.Delete = append(acts.Delete, sd.Delete...)

	var ex exporterDecision
	var drainDelay time.Duration
	if js := in.Jumpstarter; js != nil {
		drainDelay = js.DrainDelay
		ex = planExporters(exporterInput{Pods: pods, Delete: acts.Delete, DrainDelay: js.DrainDelay,
			Cold: js.Cold, WantCold: in.MaxReplicas == nil || *in.MaxReplicas > 0, Now: in.Now})
		acts.Delete, acts.Disable, acts.Enable, acts.Cold = ex.Delete, ex.Disable, ex.Enable, ex.Cold
		acts.DeleteExporters = sweepExporters(orphanInput{Set: js.Set, Exporters: js.Exporters, Pods: in.Pods,
			Deleting: js.Deleting, Creating: js.Creating})
	}

	var would pausedWork
	if in.Paused {
		acts, would = withheld(acts)
		would.Removals = rm.PausedRemovals
	}

	st := Status{
		Replicas:              int32(len(live)),
		Desired:               target,
		Ready:                 n.Ready,
		Available:             n.Available,
		Leased:                n.Leased,
		Updated:               int32(len(n.Updated)),
		ScaleDownPendingSince: sd.PendingSince,
		ConsecutiveFailures:   bo.Failures,
		LastFailureTime:       bo.LastFailure,
	}
	if in.Jumpstarter != nil {
		st.PendingLeases = in.Demand
	}
	st.Conditions = append(st.Conditions, availableCondition(availableInput{Ready: n.Ready, Target: target,
		Available: n.Available, WantAvailable: min(minAvailable, wantUnleased)}))
	st.Conditions = append(st.Conditions, progressing(progressInput{
		Paused: in.Paused, Would: would,
		Removals: rm.Removals, RemovalsWaiting: rm.Waiting, Replicas: rm.Replicas,
		BackingOff: cr.BackingOff, Failures: bo.Failures, BackoffWait: bo.Wait,
		Create: cr.Create, PendingCreates: in.PendingCreates, Target: target,
		Draining: ex.Draining, DrainDelay: drainDelay,
		Retiring: rec.Retiring,
		Outdated: len(n.OldUnleased) + len(n.OldLeased), OutdatedLeased: len(n.OldLeased),
		ScaleDown: sd, Updated: len(n.Updated),
	}))
	st.Conditions = append(st.Conditions, replicaFailure(replicaFailureInput{Live: live, Failures: bo.Failures,
		LastFailed: fin.LastFailed, Prev: in.LastFailure}))
	var gated time.Duration
	if in.Jumpstarter != nil {
		c := exportersReady(live)
		st.Conditions = append(st.Conditions, c)
		if c.Status == metav1.ConditionFalse {
			// What a gated pod waits for may be no watched object (the
			// guest login Secret): look again.
			gated = GatedRecheck
		}
	}
	acts.Status = st
	acts.RequeueAfter = soonest(exp.Requeue, fin.Requeue, bo.Requeue, cr.Requeue, sd.Requeue, ex.Requeue, gated)
	return acts
}

// withheld takes every create, delete, exporter and set change out of a
// paused set's actions and counts what it would have done.
func withheld(acts Actions) (Actions, pausedWork) {
	would := pausedWork{Create: int(acts.Create), Delete: len(acts.Delete), Exporters: len(acts.Disable) + len(acts.Enable)}
	acts.Create, acts.Delete, acts.Disable, acts.Enable, acts.Cold, acts.Set = 0, nil, nil, nil, ColdKeep, nil
	return acts, would
}

// soonest is the shortest positive duration of ds (zero if none is
// positive): when to plan again.
func soonest(ds ...time.Duration) time.Duration {
	var out time.Duration
	for _, d := range ds {
		if d > 0 && (out == 0 || d < out) {
			out = d
		}
	}
	return out
}
