package controller

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Writing the planned status to the set.

// writeStatus merges the planned status into the set's status and writes it
// when it changed.
func (r *Reconciler) writeStatus(ctx context.Context, set *v1alpha1.ExporterSet, st Status, selector string, res *Resolved, now time.Time) error {
	ns := set.Status.DeepCopy()
	if res != nil { // nil: the class could not be applied; keep what was shown
		ns.Class = res.Class
		switch {
		case res.Parameters == nil:
			ns.Parameters = nil
		case ns.Parameters == nil || !jsonEqual(ns.Parameters.Raw, res.Parameters):
			// (the API server may write the same object differently)
			ns.Parameters = &runtime.RawExtension{Raw: res.Parameters}
		}
	}
	ns.Replicas, ns.DesiredReplicas, ns.ReadyReplicas = st.Replicas, st.Desired, st.Ready
	ns.AvailableReplicas, ns.LeasedReplicas, ns.UpdatedReplicas = st.Available, st.Leased, st.Updated
	ns.PendingLeases = st.PendingLeases
	ns.ConsecutiveFailures = st.ConsecutiveFailures
	ns.ScaleDownPendingSince = metaTime(st.ScaleDownPendingSince)
	ns.LastFailureTime = metaTime(st.LastFailureTime)
	if selector != "" {
		ns.Selector = selector
	}
	ns.ObservedGeneration = set.Generation
	last := map[string]int{} // a later condition of a type overrides an earlier one
	for i, c := range st.Conditions {
		last[c.Type] = i
	}
	for i, c := range st.Conditions {
		if last[c.Type] != i {
			continue
		}
		meta.SetStatusCondition(&ns.Conditions, metav1.Condition{Type: c.Type, Status: c.Status, Reason: c.Reason,
			Message: c.Message, ObservedGeneration: set.Generation, LastTransitionTime: metav1.NewTime(now.Truncate(time.Second))})
	}
	// Equal to the cached status is not enough while the cache has not seen
	// our last write: the stored status may differ from the cached one (e.g.
	// leased 2 -> 1 written, 1 -> 2 planned from a cache still at 2). Then
	// the update is sent; it conflicts on the stale version and the set is
	// planned again once the cache caught up.
	key := client.ObjectKeyFromObject(set)
	if equality.Semantic.DeepEqual(&set.Status, ns) && !r.writePending(key, set.ResourceVersion) {
		return nil
	}
	// A full update (not a merge patch) so that zero counts are written too:
	// the printer columns and the scale subresource read them.
	set.Status = *ns
	if err := r.Client.Status().Update(ctx, set); err != nil {
		return fmt.Errorf("update status of exporterset %s/%s: %w", set.Namespace, set.Name, err)
	}
	r.written.Store(key, set.ResourceVersion)
	return nil
}

// writePending reports whether this controller wrote set key at a
// resourceVersion other than rv (the cached one) and the cache has not been
// seen to catch up.
func (r *Reconciler) writePending(key types.NamespacedName, rv string) bool {
	w, ok := r.written.Load(key)
	return ok && w != rv
}

// jsonEqual reports whether a and b are the same JSON value.
func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	return equality.Semantic.DeepEqual(x, y)
}

// statusOf converts a stored status back to a planned one.
func statusOf(s v1alpha1.ExporterSetStatus) Status {
	st := Status{Replicas: s.Replicas, Desired: s.DesiredReplicas, Ready: s.ReadyReplicas, Available: s.AvailableReplicas,
		Leased: s.LeasedReplicas, Updated: s.UpdatedReplicas, PendingLeases: s.PendingLeases, ConsecutiveFailures: s.ConsecutiveFailures}
	if s.ScaleDownPendingSince != nil {
		st.ScaleDownPendingSince = &s.ScaleDownPendingSince.Time
	}
	if s.LastFailureTime != nil {
		st.LastFailureTime = &s.LastFailureTime.Time
	}
	return st
}

func metaTime(t *time.Time) *metav1.Time {
	if t == nil {
		return nil
	}
	mt := metav1.NewTime(t.Truncate(time.Second))
	return &mt
}
