package controller

import "time"

// The lease steps of Plan: leases past their expiry end (step 0), and
// released pods are retired or recycled (step 2).

// leaseExpiryInput is what expireLeases looks at.
type leaseExpiryInput struct {
	Pods []PodState
	Now  time.Time
}

// leaseExpiry is what expireLeases decided.
type leaseExpiry struct {
	// Pods is a copy of the input's pods where each lease past its expiry
	// has ended: the pod counts as released (Leased false) and used.
	Pods []PodState
	// Expired names the pods whose lease ended here.
	Expired map[string]bool
	// Requeue is when the next lease expires (zero: none will).
	Requeue time.Duration
}

// expireLeases ends the leases past their expiry (v1alpha1.LeaseExpiresAnnotation).
// Terminating pods and leases without an expiry are left as they are.
func expireLeases(in leaseExpiryInput) leaseExpiry {
	out := leaseExpiry{Pods: make([]PodState, len(in.Pods)), Expired: map[string]bool{}}
	copy(out.Pods, in.Pods)
	for i := range out.Pods {
		p := &out.Pods[i]
		if !p.Leased || p.LeaseExpires.IsZero() || p.Terminating {
			continue
		}
		if in.Now.Before(p.LeaseExpires) {
			out.Requeue = soonest(out.Requeue, p.LeaseExpires.Sub(in.Now))
			continue
		}
		p.Leased, p.Used = false, true
		out.Expired[p.Name] = true
	}
	return out
}

// recycleInput is what recycleReleased looks at.
type recycleInput struct {
	// Live are the pods that neither finished nor are going for another
	// reason.
	Live []PodState
	// Reuse: a released pod goes back to the buffer (Reuse policy) rather
	// than being deleted (Replace).
	Reuse bool
	// Expired names the pods whose lease expiry ended their lease in this
	// plan (leaseExpiry.Expired).
	Expired map[string]bool
}

// recycleDecision is what recycleReleased decided.
type recycleDecision struct {
	// Delete: released pods retired (Replace policy).
	Delete []Deletion
	// MarkUsed, ExpireLease, ClearUsed: as in Actions.
	MarkUsed, ExpireLease, ClearUsed []PodRef
	// Live are the input's live pods minus the deleted ones.
	Live []PodState
	// Retiring counts Delete.
	Retiring int
}

// recycleReleased handles pods whose lease ended: Replace deletes them
// (ReasonReleased, or ReasonLeaseExpired when their expiry ended the lease),
// Reuse clears their used mark (an expired lease first loses its lease
// label). Under Replace, leased pods without the used mark get it.
func recycleReleased(in recycleInput) recycleDecision {
	var out recycleDecision
	out.Live = in.Live[:0:0]
	for _, p := range in.Live {
		if p.Leased && !p.Used && !in.Reuse {
			out.MarkUsed = append(out.MarkUsed, p.ref())
		}
		if p.Used && !p.Leased {
			switch {
			case in.Reuse && in.Expired[p.Name]:
				out.ExpireLease = append(out.ExpireLease, p.ref())
			case in.Reuse:
				out.ClearUsed = append(out.ClearUsed, p.ref())
			default:
				reason := ReasonReleased
				if in.Expired[p.Name] {
					reason = ReasonLeaseExpired
				}
				out.Delete = append(out.Delete, Deletion{PodRef: p.ref(), Reason: reason})
				out.Retiring++
				continue
			}
		}
		out.Live = append(out.Live, p)
	}
	return out
}
