package controller

import (
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// plannerMemory is the planner state one pass hands to the next: what our
// own ExporterSet carries in its status (scaleDownPendingSince,
// consecutiveFailures, lastFailureTime and the repeated-failure
// ReplicaFailure condition) and plannerInput reads back from it.
type plannerMemory struct {
	ScaleDownPendingSince *time.Time
	ConsecutiveFailures   int32
	LastFailureTime       *time.Time
	// LastFailure is the last planned ReplicaFailure condition when it
	// reported repeated pod failures (IsRepeatedFailure), else nil.
	LastFailure *Condition
}

// memoryOf is what a pass that planned st leaves to the next one: the
// status fields plannerInput reads, and the last ReplicaFailure condition
// of st (a later condition of a type overrides an earlier one, as in the
// status write) when it is a repeated failure. Pure.
func memoryOf(st Status) plannerMemory {
	m := plannerMemory{
		ScaleDownPendingSince: copyTime(st.ScaleDownPendingSince),
		ConsecutiveFailures:   st.ConsecutiveFailures,
		LastFailureTime:       copyTime(st.LastFailureTime),
	}
	for i := range st.Conditions {
		if c := st.Conditions[i]; c.Type == v1alpha1.ConditionReplicaFailure {
			m.LastFailure = nil
			if IsRepeatedFailure(&c) {
				m.LastFailure = &c
			}
		}
	}
	return m
}

// into sets in's carried-over state from m, as plannerInput does from a
// set's status.
func (m plannerMemory) into(in *Input) {
	in.ScaleDownPendingSince = copyTime(m.ScaleDownPendingSince)
	in.ConsecutiveFailures = m.ConsecutiveFailures
	in.LastFailureTime = copyTime(m.LastFailureTime)
	in.LastFailure = nil
	if m.LastFailure != nil {
		c := *m.LastFailure
		in.LastFailure = &c
	}
}

func copyTime(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	c := *t
	return &c
}

// upstreamMemory keeps the plannerMemory of each upstream set in process:
// upstream's ExporterSet status has no fields for it, and upstream's
// operator Role grants no update on the sets themselves (so no
// annotations). Entries are keyed by the set's UID, so a set deleted and
// created again under the same name starts afresh; the name index lets
// Forget drop an entry when only the name of the gone set is known.
//
// Owned by the UpstreamReconciler that made it; its mutex makes it safe
// for the reconciler's workers (controller-runtime plans one set in one
// worker at a time, different sets in parallel). It is lost on restart:
// the cooldown then starts again and the failure count from zero.
type upstreamMemory struct {
	mu   sync.Mutex
	sets map[types.UID]plannerMemory
	uids map[types.NamespacedName]types.UID
}

func newUpstreamMemory() *upstreamMemory {
	return &upstreamMemory{sets: map[types.UID]plannerMemory{}, uids: map[types.NamespacedName]types.UID{}}
}

// Get returns the memory of set key with uid (zero if none).
func (u *upstreamMemory) Get(key types.NamespacedName, uid types.UID) plannerMemory {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.uids[key] != uid {
		return plannerMemory{}
	}
	return u.sets[uid]
}

// Put stores m for set key with uid, dropping what a former set of that
// name left.
func (u *upstreamMemory) Put(key types.NamespacedName, uid types.UID, m plannerMemory) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if old, ok := u.uids[key]; ok && old != uid {
		delete(u.sets, old)
	}
	u.uids[key] = uid
	u.sets[uid] = m
}

// Forget drops the memory of set key (the set is gone or no longer ours).
func (u *upstreamMemory) Forget(key types.NamespacedName) {
	u.mu.Lock()
	defer u.mu.Unlock()
	if uid, ok := u.uids[key]; ok {
		delete(u.sets, uid)
		delete(u.uids, key)
	}
}

// Len is the number of sets remembered.
func (u *upstreamMemory) Len() int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return len(u.sets)
}
