package controller

import (
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// The scaling steps of Plan: the live pods counted (step 3), creates
// (step 5), the rollout of outdated pods (step 6) and scale-down (step 7).

// countInput is what countPods looks at.
type countInput struct {
	Live         []PodState
	TemplateHash string
	// Exporters (Jumpstarter mode): a pod is available only while its
	// Exporter is enabled.
	Exporters bool
}

// podCounts is what countPods found.
type podCounts struct {
	Leased, Ready int32
	// Available counts Ready pods that are neither leased nor used (and
	// whose Exporter is enabled, in Jumpstarter mode).
	Available int32
	// Updated are the pods at the current template; NewReadyUnleased
	// counts those Ready, unleased and unused.
	Updated          []PodState
	NewReadyUnleased int32
	// OldLeased and OldUnleased are the outdated pods.
	OldLeased, OldUnleased []PodState
}

// countPods counts the live pods by readiness, lease and template.
func countPods(in countInput) podCounts {
	var c podCounts
	for _, p := range in.Live {
		if p.Leased {
			c.Leased++
		}
		if p.Ready {
			c.Ready++
			if !p.Leased && !p.Used && (!in.Exporters || p.Exporter.Enabled) {
				c.Available++
			}
		}
		switch {
		case p.TemplateHash == in.TemplateHash:
			c.Updated = append(c.Updated, p)
			if p.Ready && !p.Leased && !p.Used {
				c.NewReadyUnleased++
			}
		case p.Leased:
			c.OldLeased = append(c.OldLeased, p)
		default:
			c.OldUnleased = append(c.OldUnleased, p)
		}
	}
	return c
}

// Target is the effective number of pods the set wants:
// max(replicas, leased + demand + minAvailable), capped by maxReplicas.
// Demand (leases waiting for an exporter) counts like leased pods: once a
// waiting lease lands on a pod, leased grows by what demand shrinks, so the
// target does not move and nothing is created twice; a lease landing on a
// warm pod is replaced by a new warm pod before it lands.
func Target(replicas, minAvailable, leased, demand int32, maxReplicas *int32) int32 {
	t := max(replicas, leased+demand+minAvailable)
	if maxReplicas != nil {
		t = min(t, *maxReplicas)
	}
	return max(t, 0)
}

// createInput is what planCreates looks at.
type createInput struct {
	// Target is the number of pods wanted; Have the current and outdated
	// leased pods plus PendingCreates (created, not yet seen).
	Target, Have   int32
	PendingCreates int32
	// Live counts every live pod (what maxReplicas caps).
	Live        int32
	MaxReplicas *int32
	// BackoffWait, when positive, holds creates back (backoffDecision.Wait).
	BackoffWait time.Duration
}

// createDecision is what planCreates decided.
type createDecision struct {
	Create int32
	// CappedByMax: maxReplicas left less room than needed.
	CappedByMax bool
	// BackingOff: creates were needed but wait for the failure backoff.
	BackingOff bool
	Requeue    time.Duration
}

// planCreates creates everything missing at once, within maxReplicas, unless
// the failure backoff holds creates back.
func planCreates(in createInput) createDecision {
	var out createDecision
	out.Create = max(in.Target-in.Have, 0)
	if in.MaxReplicas != nil {
		room := max(*in.MaxReplicas-in.Live-in.PendingCreates, 0)
		if out.Create > room {
			out.Create, out.CappedByMax = room, true
		}
	}
	if out.Create > 0 && in.BackoffWait > 0 {
		out.BackingOff, out.Create, out.Requeue = true, 0, in.BackoffWait
	}
	return out
}

// rolloutInput is what planRollout looks at.
type rolloutInput struct {
	// OldUnleased are the outdated unleased pods.
	OldUnleased []PodState
	// WantUnleased is how many unleased pods the target wants;
	// NewReadyUnleased how many current ones are Ready and unused.
	WantUnleased, NewReadyUnleased int32
	// CappedByMax: maxReplicas leaves no room to create replacements first.
	CappedByMax bool
}

// planRollout deletes outdated unleased pods: not-Ready ones at once, Ready
// ones only while enough Ready unleased pods remain (one at a time when
// maxReplicas leaves no room to surge). Newest go first.
func planRollout(in rolloutInput) []Deletion {
	old := sortedForScaleIn(in.OldUnleased, false)
	var dels []Deletion
	var readyOld []PodState
	for _, p := range old {
		if p.Ready {
			readyOld = append(readyOld, p)
		} else {
			dels = append(dels, Deletion{PodRef: p.ref(), Reason: ReasonOutdated})
		}
	}
	allowed := max(in.NewReadyUnleased+int32(len(readyOld))-in.WantUnleased, 0)
	if allowed == 0 && in.CappedByMax && len(readyOld) > 0 && len(readyOld) == len(old) {
		allowed = 1 // maxReplicas leaves no room to surge: replace one at a time
	}
	for _, p := range readyOld[:min(int(allowed), len(readyOld))] {
		dels = append(dels, Deletion{PodRef: p.ref(), Reason: ReasonOutdated})
	}
	return dels
}

// scaleDownInput is what planScaleDown looks at.
type scaleDownInput struct {
	// Updated are the pods at the current template (leased ones never go).
	Updated []PodState
	// Excess is how many pods are above the target.
	Excess int32
	// OldestFirst: scale-in takes the oldest pods first (the newest
	// otherwise). Explicit: only pods marked for removal go, which the
	// removal step handles.
	OldestFirst, Explicit bool
	// Exporters (Jumpstarter mode): pods whose Exporter was disabled for
	// a scale-down go first and at once (they waited the cooldown before).
	Exporters bool
	// PendingSince is when the set first had an excess (from the status);
	// Cooldown how long an excess must last before pods go.
	PendingSince *time.Time
	Cooldown     time.Duration
	Now          time.Time
}

// scaleDownDecision is what planScaleDown decided.
type scaleDownDecision struct {
	Delete []Deletion
	// PendingSince, when set, is when the running cooldown began; Waiting
	// says the cooldown runs.
	PendingSince *time.Time
	Waiting      bool
	// ExplicitExcess is the excess the Explicit policy leaves alone.
	ExplicitExcess int32
	// Excess and Candidates are the excess and the pods that may go left
	// after draining pods went.
	Excess     int32
	Candidates int
	Requeue    time.Duration
}

// planScaleDown removes current unleased pods above the target after the
// cooldown, best-to-delete first.
func planScaleDown(in scaleDownInput) scaleDownDecision {
	out := scaleDownDecision{Excess: in.Excess}
	var candidates []PodState
	for _, p := range in.Updated {
		if !p.Leased {
			candidates = append(candidates, p)
		}
	}
	if in.Explicit && out.Excess > 0 {
		out.ExplicitExcess, candidates = out.Excess, nil // only marked pods go (planRemovals)
	}
	if out.Excess > 0 && len(candidates) > 0 && in.Exporters {
		// Exporters already disabled for a scale-down waited the cooldown
		// before: they go first and at once, or they would be re-enabled
		// while a new cooldown runs.
		candidates = sortedForScaleIn(candidates, in.OldestFirst)
		n := 0
		for n < len(candidates) && int32(n) < out.Excess && candidates[n].Exporter.draining() {
			out.Delete = append(out.Delete, Deletion{PodRef: candidates[n].ref(), Reason: ReasonScaleDown})
			n++
		}
		candidates, out.Excess = candidates[n:], out.Excess-int32(n)
	}
	out.Candidates = len(candidates)
	if out.Excess > 0 && len(candidates) > 0 {
		since := in.Now
		if in.PendingSince != nil {
			since = *in.PendingSince
		}
		if wait := since.Add(in.Cooldown).Sub(in.Now); wait > 0 {
			out.PendingSince, out.Waiting, out.Requeue = &since, true, wait
		} else {
			candidates = sortedForScaleIn(candidates, in.OldestFirst)
			for _, p := range candidates[:min(int(out.Excess), len(candidates))] {
				out.Delete = append(out.Delete, Deletion{PodRef: p.ref(), Reason: ReasonScaleDown})
			}
		}
	}
	return out
}

// sortedForScaleIn returns a copy of pods ordered best-to-delete first:
// draining (Jumpstarter mode: Exporter already disabled) first, then not
// Ready before Ready, not yet running before running, then by age: newest
// first (the least invested), or oldest first with oldestFirst. Ties of
// the same second go by name.
func sortedForScaleIn(pods []PodState, oldestFirst bool) []PodState {
	out := append([]PodState(nil), pods...)
	sort.SliceStable(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if k, l := deletionClass(a), deletionClass(b); k != l {
			return k < l // already disabled for this: keep the choice stable
		}
		if !a.Created.Equal(b.Created) {
			return a.Created.After(b.Created) != oldestFirst
		}
		return (a.Name > b.Name) != oldestFirst
	})
	return out
}

// deletionClass ranks a pod for deletion before its age counts: draining
// (0), not Ready and not running (1), not Ready (2), Ready and not running
// (3), Ready (4).
func deletionClass(p PodState) int {
	running := p.Phase == corev1.PodRunning
	switch {
	case p.Exporter.draining():
		return 0
	case !p.Ready && !running:
		return 1
	case !p.Ready:
		return 2
	case !running:
		return 3
	}
	return 4
}
