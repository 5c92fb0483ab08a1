package controller

import (
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// expectationTTL bounds how long an unobserved create or delete is trusted
// (as in the ReplicaSet controller): after it, the cache is believed again.
const expectationTTL = 5 * time.Minute

// expectations remembers, per set, the pods this controller created or
// deleted that its informer cache has not shown yet, so that a lagging cache
// never leads to creating (or deleting) the same pods twice. The reconcile
// of a set owns its entries' settling (Pending); the executor adds them
// (ExpectCreate, ExpectDelete) and the pod delete events drop created pods
// that are gone (Gone).
type expectations struct {
	mu   sync.Mutex
	sets map[types.NamespacedName]*setExpectations
}

type setExpectations struct {
	creates map[string]time.Time    // pod name -> when created
	deletes map[types.UID]time.Time // pod UID -> when deleted
}

func newExpectations() *expectations {
	return &expectations{sets: map[types.NamespacedName]*setExpectations{}}
}

func (e *expectations) get(key types.NamespacedName) *setExpectations {
	s := e.sets[key]
	if s == nil {
		s = &setExpectations{creates: map[string]time.Time{}, deletes: map[types.UID]time.Time{}}
		e.sets[key] = s
	}
	return s
}

// ExpectCreate records a pod created for the set.
func (e *expectations) ExpectCreate(key types.NamespacedName, pod string, now time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.get(key).creates[pod] = now
}

// ExpectDelete records a pod deleted for the set.
func (e *expectations) ExpectDelete(key types.NamespacedName, uid types.UID, now time.Time) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.get(key).deletes[uid] = now
}

// Gone is called from informer delete events: a created pod that is gone
// is no longer awaited, whether or not a list showed it.
//
// Add and update events settle nothing: a reconcile reads its pod list
// before it settles the expectations (Pending), and an add event that
// lands between the two would settle a create the list does not show,
// leaving the pod neither listed nor pending, so the plan would create it
// again. Only the list a plan is made from settles what it shows. A pod
// gone between the list and Pending is rightly not counted as created; a
// delete expectation stays until a list no longer shows the pod live.
func (e *expectations) Gone(key types.NamespacedName, pod string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if s := e.sets[key]; s != nil {
		delete(s.creates, pod)
	}
}

// Forget drops everything about a set (it was deleted).
func (e *expectations) Forget(key types.NamespacedName) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.sets, key)
}

// Pending settles the expectations against cached, the pod list a plan is
// made from, and returns the names of created pods still missing from it
// (sorted) and the UIDs of deleted pods it still shows as live (to be left
// out of the plan). A create is settled once a list shows the pod (or a
// delete event says it is gone, Gone), a delete once a list shows the pod
// terminating or no more: never by an event the list may predate.
func (e *expectations) Pending(key types.NamespacedName, cached []corev1.Pod, now time.Time) ([]string, map[types.UID]bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.sets[key]
	if s == nil {
		return nil, nil
	}
	byName := make(map[string]bool, len(cached))
	live := make(map[types.UID]bool, len(cached))
	for i := range cached {
		byName[cached[i].Name] = true
		if cached[i].DeletionTimestamp == nil {
			live[cached[i].UID] = true
		}
	}
	var creating []string
	for name, at := range s.creates {
		if byName[name] || now.Sub(at) > expectationTTL {
			delete(s.creates, name)
			continue
		}
		creating = append(creating, name)
	}
	sort.Strings(creating)
	deleting := map[types.UID]bool{}
	for uid, at := range s.deletes {
		if !live[uid] || now.Sub(at) > expectationTTL {
			delete(s.deletes, uid)
			continue
		}
		deleting[uid] = true
	}
	return creating, deleting
}
