package controller

import (
	"slices"
	"sort"

	"k8s.io/apimachinery/pkg/types"
)

// The removal step of Plan (step 0b): pods marked for removal
// (PodState.RemoveRequested) go once unleased, and spec.replicas drops by
// one for each, once.

// removalInput is what planRemovals looks at.
type removalInput struct {
	Pods []PodState
	// Counted are the UIDs whose removal is already counted in Replicas
	// (Input.Removing), sorted.
	Counted []types.UID
	// Replicas is the set's spec.replicas.
	Replicas int32
	// Paused: nothing is removed; the pods that would go are counted.
	Paused bool
}

// removalDecision is what planRemovals decided.
type removalDecision struct {
	// Delete: marked pods that go now (ReasonRemoved).
	Delete []Deletion
	// Removed names the pods in Delete.
	Removed map[string]bool
	// Replicas is spec.replicas lowered by the removals counted now.
	Replicas int32
	// Set, when set, is the write to the set: the new Removing list and,
	// when removals were counted now, the lowered spec.replicas.
	Set *SetPatch
	// Removals counts Delete; Waiting counts marked pods that are leased
	// and not counted yet (they go after release); PausedRemovals counts
	// the unleased marked pods a paused set keeps.
	Removals, Waiting, PausedRemovals int32
}

// planRemovals decides which marked pods go and how spec.replicas follows.
// A marked pod's removal is counted (spec.replicas lowered by one) when it
// goes; a counted pod that is leased again stays counted and goes once
// released; counted UIDs no longer present drop out of the bookkeeping.
func planRemovals(in removalInput) removalDecision {
	out := removalDecision{Removed: map[string]bool{}, Replicas: in.Replicas}
	counted := make(map[types.UID]bool, len(in.Counted))
	for _, uid := range in.Counted {
		counted[uid] = true
	}
	var kept []types.UID
	var newRemovals int32
	var newlyCounted []string
	for _, p := range in.Pods {
		if p.Terminating || (!p.RemoveRequested && !counted[p.UID]) {
			continue
		}
		if in.Paused {
			if !p.Leased {
				out.PausedRemovals++ // would go now
			}
			continue
		}
		if counted[p.UID] {
			kept = append(kept, p.UID)
		}
		if p.Leased {
			if !counted[p.UID] {
				out.Waiting++ // counted and removed after release
			}
			continue
		}
		if !counted[p.UID] {
			newRemovals++
			kept = append(kept, p.UID)
			newlyCounted = append(newlyCounted, p.Name)
		}
		out.Removals++
		out.Removed[p.Name] = true
		out.Delete = append(out.Delete, Deletion{PodRef: p.ref(), Reason: ReasonRemoved})
	}
	if newRemovals > 0 {
		out.Replicas = max(out.Replicas-newRemovals, 0)
	}
	sort.Slice(kept, func(i, j int) bool { return kept[i] < kept[j] })
	if newRemovals > 0 || !slices.Equal(kept, in.Counted) {
		out.Set = &SetPatch{Removing: kept, Counted: newlyCounted}
		if newRemovals > 0 {
			replicas := out.Replicas
			out.Set.Replicas = &replicas
		}
	}
	return out
}
