package podstatus

import (
	"sync"

	"k8s.io/apimachinery/pkg/types"
)

// StatusPump delivers pod statuses to the library's notify callback, per
// pod: at most one delivery of a pod is in flight, and each delivery sends
// the pod's state as it is when it is sent (not when it was pushed). So:
//   - status writes are coalesced per pod: pushes made while a delivery is
//     in flight collapse into one more delivery of the newest state;
//   - a pod's status never goes backwards: deliveries of one pod are
//     sequential and each snapshot is taken after the previous one was
//     handed over (before, two pushes racing on different goroutines
//     could hand the callback the newer snapshot first, issue #13);
//   - a pusher never waits for the callback (which can block: the library
//     polls up to seconds for a pod it does not know yet), and a slow
//     delivery of one pod never delays another pod's.
//
// The pump owns its slots; a slot exists while its pod has a delivery in
// flight or pending, and its goroutine ends when nothing is pending.
type StatusPump struct {
	mu    sync.Mutex
	slots map[types.UID]*pumpSlot
}

// pumpSlot is one pod's delivery state, guarded by statusPump.mu.
type pumpSlot struct {
	// deliver sends the pod's current status (the latest push's).
	deliver func()
	// dirty: pushed again while a delivery was in flight.
	dirty bool
	// idle is closed when the slot's goroutine ends (for flush).
	idle chan struct{}
}

// Push asks for uid's status to be delivered by deliver, soon, on the
// pod's own goroutine. Never blocks on a delivery.
func (s *StatusPump) Push(uid types.UID, deliver func()) {
	s.mu.Lock()
	if s.slots == nil {
		s.slots = map[types.UID]*pumpSlot{}
	}
	if sl := s.slots[uid]; sl != nil {
		sl.deliver, sl.dirty = deliver, true
		s.mu.Unlock()
		return
	}
	sl := &pumpSlot{deliver: deliver, idle: make(chan struct{})}
	s.slots[uid] = sl
	s.mu.Unlock()
	go s.drain(uid, sl)
}

// drain is the slot's goroutine: deliver until no push is pending.
func (s *StatusPump) drain(uid types.UID, sl *pumpSlot) {
	s.mu.Lock()
	for {
		deliver := sl.deliver
		sl.dirty = false
		s.mu.Unlock()
		deliver()
		s.mu.Lock()
		if !sl.dirty {
			delete(s.slots, uid)
			close(sl.idle)
			s.mu.Unlock()
			return
		}
	}
}

// Flush waits until uid has no delivery in flight or pending: everything
// pushed before the call has been delivered.
func (s *StatusPump) Flush(uid types.UID) {
	s.mu.Lock()
	sl := s.slots[uid]
	s.mu.Unlock()
	if sl != nil {
		<-sl.idle
	}
}
