package controller

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Reasons a pod is deleted, as found in Deletion.Reason and in events.
const (
	ReasonFailed    = "Failed"    // the pod ended (phase Failed or Succeeded)
	ReasonReleased  = "Released"  // Replace policy: the pod's lease ended
	ReasonOutdated  = "Outdated"  // the pod's template hash is not the set's
	ReasonScaleDown = "ScaleDown" // more pods than the target
	// ReasonLeaseExpired: Replace policy: the pod's lease reached its
	// expiry (v1alpha1.LeaseExpiresAnnotation).
	ReasonLeaseExpired = "LeaseExpired"
	ReasonRemoved      = "Removed" // marked with v1alpha1.RemoveAnnotation
	// ReasonFailingToStart: autohealing replaces a pod whose VM keeps
	// failing to start.
	ReasonFailingToStart = "FailingToStart"
)

// Backoff of replacements for failed pods: the first replacement is
// immediate, then failureBackoffBase doubling up to failureBackoffMax.
const (
	failureBackoffBase = 10 * time.Second
	failureBackoffMax  = 5 * time.Minute
	// failureThreshold consecutive failed pods make ReplicaFailure True.
	failureThreshold = 3
	// stableReady is how long a pod created after the last failure must
	// have been Ready for starts to count as working again (the failure
	// count resets). A VM pod without a readiness probe is Ready while its
	// QEMU runs, so a guest that crashes during boot is Ready for its boot
	// time, which under TCG on a busy host is tens of seconds: that must
	// not reset the backoff. (A kubelet waits 10 min before it forgets a
	// container's crash loop; a minute suits VMs that are recycled often.)
	stableReady = time.Minute
)

// startFailureReasons are container waiting reasons that mean the pod cannot
// start on its own soon; they surface as ReplicaFailure. The pod is left to
// its node's retry (no delete/recreate churn).
// autohealReasons are the container waiting reasons under which autohealing
// may replace a pod: the VM itself fails to start (a fresh pod gets a fresh
// disk, maybe another node). Image pull and config errors are not among
// them: a fresh pod would pull the same image and miss the same Secret.
var autohealReasons = map[string]bool{
	"CrashLoopBackOff":     true,
	"CreateContainerError": true,
	"RunContainerError":    true,
	"StartError":           true,
}

var startFailureReasons = map[string]bool{
	"ErrImagePull":               true,
	"ImagePullBackOff":           true,
	"InvalidImageName":           true,
	"ErrImageNeverPull":          true,
	"CrashLoopBackOff":           true,
	"CreateContainerConfigError": true,
	"CreateContainerError":       true,
	"RunContainerError":          true,
	"StartError":                 true,
}

// PodState is what the planner knows about one pod the set owns.
type PodState struct {
	Name            string
	UID             types.UID
	ResourceVersion string
	Created         time.Time
	Phase           corev1.PodPhase
	Ready           bool
	// ReadySince is when the pod's Ready condition last changed (zero if
	// unknown: then a Ready pod counts as stably Ready).
	ReadySince  time.Time
	Terminating bool // deletionTimestamp is set
	Leased      bool
	Used        bool // has been leased since it was last recycled
	// LeaseExpires, when not zero, is when the pod's lease ends: from then
	// on the pod counts as released.
	LeaseExpires time.Time
	TemplateHash string
	// WaitingReason/WaitingMessage: the first container waiting reason, if any.
	WaitingReason  string
	WaitingMessage string
	// FailedReason/FailedMessage: why a Failed pod ended, if known.
	FailedReason  string
	FailedMessage string
	// RestartCount is the VM container's restart count.
	RestartCount int32
	// NotReadySince is when the pod's Ready condition last turned False
	// (zero if it has none: then its creation time counts).
	NotReadySince time.Time
	// RemoveRequested: the pod carries v1alpha1.RemoveAnnotation=true.
	RemoveRequested bool

	// Jumpstarter mode only.
	//
	// Exporter is the state of the pod's Exporter.
	Exporter ExporterState
	// GateReason, when set, says why the pod is still held by the
	// v1alpha1.JumpstarterGate scheduling gate.
	GateReason string
}

// ExporterState is what the planner knows about one Jumpstarter Exporter.
type ExporterState struct {
	Found           bool
	Enabled         bool
	ResourceVersion string
	// DisabledAt is when this controller disabled the Exporter (its
	// v1alpha1.ExporterDisabledAtAnnotation); zero if it did not.
	DisabledAt time.Time
	// Leased is set for the cold exporter only (a pod's lease state is
	// PodState.Leased).
	Leased bool
}

// draining reports whether the exporter was disabled by this controller to
// let its pod go.
func (e ExporterState) draining() bool { return e.Found && !e.Enabled && !e.DisabledAt.IsZero() }

// JumpstarterInput is the planner input of a Jumpstarter-mode set.
type JumpstarterInput struct {
	// DrainDelay is how long an Exporter must have been disabled before its
	// pod and Exporter are deleted: Jumpstarter's lease controller may
	// still assign a lease from a read made before the disable reached it.
	DrainDelay time.Duration
	// Cold is the set's cold exporter (v1alpha1.ExporterPodCold).
	Cold ExporterState
}

// ExporterRef names one Exporter version (the pod's name for a pod's
// Exporter); enable/disable patches carry the resourceVersion as a
// precondition, so an Exporter that changed since the decision (e.g. got a
// lease) is left alone.
type ExporterRef struct {
	Name            string
	ResourceVersion string
}

// ColdAction is what to do with the cold exporter.
type ColdAction string

// Cold exporter actions.
const (
	ColdKeep   ColdAction = ""
	ColdCreate ColdAction = "Create"
	ColdEnable ColdAction = "Enable"
	ColdDelete ColdAction = "Delete"
)

// Input is everything a reconcile decision depends on.
type Input struct {
	Replicas     int32
	MinAvailable int32
	MaxReplicas  *int32
	Recycle      v1alpha1.RecyclePolicy
	Cooldown     time.Duration
	TemplateHash string
	// WaitForFirstConsumer (a class's bindingMode) makes Replicas and
	// MinAvailable count as 0 towards the target: pods only for leased
	// pods and pending leases. Replicas is still what removals lower.
	WaitForFirstConsumer bool
	// ScaleIn chooses the pods that go on scale-down ("" means Newest).
	ScaleIn v1alpha1.ScaleInPolicy
	// Paused stops every create, delete and exporter change; the plan
	// still says what it would do (Progressing Unknown, reason Paused).
	Paused bool
	// Autohealing, when set, replaces pods whose VM keeps failing to start.
	Autohealing *Autohealing
	// Removing are the UIDs whose removal (RemoveRequested) is already
	// counted in Replicas (v1alpha1.RemovingAnnotation), sorted.
	Removing []types.UID

	// Pods are the owned pods as the cache shows them, minus pods whose
	// deletion this controller issued and is still waiting to observe.
	Pods []PodState
	// PendingCreates counts pods created but not yet seen in the cache
	// (expectations): they exist, so they are never created again.
	PendingCreates int32
	// Demand counts leases waiting for a pod (from the lease source); they
	// count like leased pods towards the target.
	Demand int32

	// Jumpstarter, when set, plans a Jumpstarter-mode set: a pod goes only
	// after its Exporter was disabled and stayed unleased for the drain
	// delay, and the set keeps one enabled cold exporter.
	Jumpstarter *JumpstarterInput

	// State carried in the status from the previous reconcile.
	ScaleDownPendingSince *time.Time
	ConsecutiveFailures   int32
	LastFailureTime       *time.Time
	// LastFailure is the ReplicaFailure condition of the last status when
	// it reported repeated pod failures (see IsRepeatedFailure): its reason
	// and last-pod detail are kept while no newer failure is seen.
	LastFailure *Condition

	Now time.Time
}

// Autohealing is when a pod counts as failing to start and is replaced.
type Autohealing struct {
	// StartUpFailureThreshold is the restart count from which a pod waiting
	// in an autoheal reason may count as failing.
	StartUpFailureThreshold int32
	// MinFailingToStartDuration is how long it must have been not Ready.
	MinFailingToStartDuration time.Duration
}

// SetPatch is a write to the set itself: spec.replicas lowered for pods
// marked for removal, and the v1alpha1.RemovingAnnotation bookkeeping that
// makes each removal lower it once. Both go in one patch with the set's
// resourceVersion as precondition.
type SetPatch struct {
	// Replicas, when set, is the new spec.replicas.
	Replicas *int32
	// Removing is the new RemovingAnnotation (UIDs, sorted).
	Removing []types.UID
	// Counted names the pods whose removal this patch counts.
	Counted []string
}

// PodRef names one pod version: actions on it carry the UID and
// resourceVersion as preconditions, so a pod changed since the decision
// (e.g. claimed by a client) is left alone.
type PodRef struct {
	Name            string
	UID             types.UID
	ResourceVersion string
}

// Deletion is one pod to delete and why.
type Deletion struct {
	PodRef
	Reason string
}

// Condition is a status condition without its timestamps.
type Condition struct {
	Type    string
	Status  metav1.ConditionStatus
	Reason  string
	Message string
}

// Status is the planned status of the set.
type Status struct {
	Replicas, Desired, Ready, Available, Leased, Updated int32
	PendingLeases                                        int32
	ScaleDownPendingSince                                *time.Time
	ConsecutiveFailures                                  int32
	LastFailureTime                                      *time.Time
	Conditions                                           []Condition
}

// Actions is the outcome of Plan.
type Actions struct {
	// Create is the number of pods to create from the current template.
	Create int32
	// Delete lists pods to delete, each with preconditions. In Jumpstarter
	// mode only pods whose Exporter is missing or disabled and drained are
	// listed; their Exporter is deleted with them.
	Delete []Deletion
	// Disable lists Exporters (Jumpstarter mode) to disable because their
	// pod is to go: no new lease lands on them, and the pod is deleted
	// once the drain delay passed with no lease.
	Disable []ExporterRef
	// Enable lists Exporters this controller disabled whose pod is wanted
	// again (e.g. demand came back during the drain).
	Enable []ExporterRef
	// Cold is what to do with the set's cold exporter.
	Cold ColdAction
	// ClearUsed lists released pods (Reuse policy) whose used mark must be
	// removed so that they can be claimed again (with the lease
	// annotations, so that an old expiry never applies to a new lease).
	ClearUsed []PodRef
	// ExpireLease lists pods (Reuse policy) whose lease expired: their
	// lease label and annotations are removed; the used mark stays until
	// the next plan clears it, as for any release. (Replace: such pods are
	// deleted with ReasonLeaseExpired.)
	ExpireLease []PodRef
	// MarkUsed lists leased pods without the used mark (Replace policy): the
	// controller adds it, so that the pod is retired on release even when
	// the client's claim did not set it.
	MarkUsed []PodRef
	// Set, when set, must be written before any pod action of the plan:
	// the plan's removals are counted in it. If the write fails nothing
	// of the plan may be applied.
	Set    *SetPatch
	Status Status
	// RequeueAfter, when non-zero, is when the plan should be made again
	// even without events (cooldown, backoff or lease expiry).
	RequeueAfter time.Duration
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

// Plan decides what to create and delete and what the status is. It is pure:
// the same input always gives the same actions.
func Plan(in Input) Actions {
	var acts Actions
	var requeue []time.Duration

	// 0. Leases past their expiry end now: such a pod counts as released
	//    (and used); the next expiry is when to look again.
	expired := map[string]bool{}
	pods := make([]PodState, len(in.Pods))
	copy(pods, in.Pods)
	for i := range pods {
		p := &pods[i]
		if !p.Leased || p.LeaseExpires.IsZero() || p.Terminating {
			continue
		}
		if in.Now.Before(p.LeaseExpires) {
			requeue = append(requeue, p.LeaseExpires.Sub(in.Now))
			continue
		}
		p.Leased, p.Used = false, true
		expired[p.Name] = true
	}
	in.Pods = pods
	// 0b. Pods marked for removal go once unleased, and spec.replicas drops
	//    by one for each (once: Removing remembers the counted ones).
	counted := make(map[types.UID]bool, len(in.Removing))
	for _, uid := range in.Removing {
		counted[uid] = true
	}
	var removingKept []types.UID
	var newRemovals, removals, removalsWaiting, pausedRemovals int32
	removed := map[string]bool{}
	var newlyCounted []string
	for _, p := range in.Pods {
		if p.Terminating || (!p.RemoveRequested && !counted[p.UID]) {
			continue
		}
		if in.Paused {
			if !p.Leased {
				pausedRemovals++ // would go now
			}
			continue
		}
		if counted[p.UID] {
			removingKept = append(removingKept, p.UID)
		}
		if p.Leased {
			if !counted[p.UID] {
				removalsWaiting++ // counted and removed after release
			}
			continue
		}
		if !counted[p.UID] {
			newRemovals++
			removingKept = append(removingKept, p.UID)
			newlyCounted = append(newlyCounted, p.Name)
		}
		removals++
		removed[p.Name] = true
		acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonRemoved})
	}
	replicas := in.Replicas
	if newRemovals > 0 {
		replicas = max(replicas-newRemovals, 0)
	}
	sort.Slice(removingKept, func(i, j int) bool { return removingKept[i] < removingKept[j] })
	if newRemovals > 0 || !slices.Equal(removingKept, in.Removing) {
		acts.Set = &SetPatch{Removing: removingKept, Counted: newlyCounted}
		if newRemovals > 0 {
			acts.Set.Replicas = &replicas
		}
	}
	// What counts towards the target (bindingMode WaitForFirstConsumer:
	// only leases).
	targetReplicas, minAvailable := replicas, in.MinAvailable
	if in.WaitForFirstConsumer {
		targetReplicas, minAvailable = 0, 0
	}

	// 1. Finished pods go (unless leased: the holder sees the failure and
	//    releases it); with autohealing, so do pods whose VM keeps failing
	//    to start; live pods are the rest.
	var live []PodState
	var newFailures int32
	var lastFailed *PodState
	for i := range in.Pods {
		p := in.Pods[i]
		var healAt time.Time
		if !in.Paused {
			healAt = in.autohealAt(p)
		}
		switch {
		case p.Terminating, removed[p.Name]:
		case !healAt.IsZero() && !in.Now.Before(healAt):
			acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonFailingToStart})
			newFailures++
			f := p
			f.FailedReason, f.FailedMessage = p.WaitingReason, fmt.Sprintf("restarted %d times, not Ready since %s: %s",
				p.RestartCount, p.notReadySince().UTC().Format(time.RFC3339), p.WaitingMessage)
			lastFailed = &f
		case p.Phase == corev1.PodFailed || p.Phase == corev1.PodSucceeded:
			if p.Leased {
				continue
			}
			acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonFailed})
			if p.Phase == corev1.PodFailed {
				newFailures++
				lastFailed = &in.Pods[i]
			}
		default:
			if !healAt.IsZero() {
				requeue = append(requeue, healAt.Sub(in.Now)) // look again when it may count
			}
			live = append(live, p)
		}
	}

	// 2. Released pods: Replace deletes them, Reuse clears the used mark
	//    (an expired lease first loses its lease label).
	kept := live[:0:0]
	var retiring int
	for _, p := range live {
		if p.Leased && !p.Used && in.Recycle != v1alpha1.RecyclePolicyReuse {
			acts.MarkUsed = append(acts.MarkUsed, p.ref())
		}
		if p.Used && !p.Leased {
			switch {
			case in.Recycle == v1alpha1.RecyclePolicyReuse && expired[p.Name]:
				acts.ExpireLease = append(acts.ExpireLease, p.ref())
			case in.Recycle == v1alpha1.RecyclePolicyReuse:
				acts.ClearUsed = append(acts.ClearUsed, p.ref())
			default:
				reason := ReasonReleased
				if expired[p.Name] {
					reason = ReasonLeaseExpired
				}
				acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: reason})
				retiring++
				continue
			}
		}
		kept = append(kept, p)
	}
	live = kept

	// 3. Counts and target.
	var leased, ready, available int32
	var updated, oldLeased, oldUnleased []PodState
	var newReadyUnleased int32
	for _, p := range live {
		if p.Leased {
			leased++
		}
		if p.Ready {
			ready++
			if !p.Leased && !p.Used && (in.Jumpstarter == nil || p.Exporter.Enabled) {
				available++
			}
		}
		switch {
		case p.TemplateHash == in.TemplateHash:
			updated = append(updated, p)
			if p.Ready && !p.Leased && !p.Used {
				newReadyUnleased++
			}
		case p.Leased:
			oldLeased = append(oldLeased, p)
		default:
			oldUnleased = append(oldUnleased, p)
		}
	}
	target := Target(targetReplicas, minAvailable, leased, in.Demand, in.MaxReplicas)

	// 4. Failure bookkeeping and backoff.
	failures, lastFailure := in.ConsecutiveFailures, in.LastFailureTime
	if newFailures > 0 && !in.Paused { // paused: the failed pods stay and are counted once unpaused
		failures += newFailures
		now := in.Now
		lastFailure = &now
	} else if failures > 0 && lastFailure != nil {
		for _, p := range live {
			if !p.Ready || !p.Created.After(*lastFailure) {
				continue
			}
			if stableAt := p.ReadySince.Add(stableReady); !p.ReadySince.IsZero() && in.Now.Before(stableAt) {
				requeue = append(requeue, stableAt.Sub(in.Now)) // look again once it may count
				continue
			}
			failures = 0 // a pod started after the last failure and stayed Ready: starts work
			break
		}
	}
	var backoffWait time.Duration
	if failures > 1 && lastFailure != nil {
		d := failureBackoffBase << min(failures-2, 16)
		d = min(d, failureBackoffMax)
		backoffWait = lastFailure.Add(d).Sub(in.Now)
	}

	// 5. Creates: everything missing at once, within maxReplicas.
	have := int32(len(updated)+len(oldLeased)) + in.PendingCreates
	need := max(target-have, 0)
	create := need
	cappedByMax := false
	if in.MaxReplicas != nil {
		room := max(*in.MaxReplicas-int32(len(live))-in.PendingCreates, 0)
		if create > room {
			create, cappedByMax = room, true
		}
	}
	backingOff := false
	if create > 0 && backoffWait > 0 {
		backingOff = true
		create = 0
		requeue = append(requeue, backoffWait)
	}
	acts.Create = create

	// 6. Rollout: outdated unleased pods go, not-ready ones at once, Ready
	//    ones only while enough Ready unleased pods remain.
	sortForDeletion(oldUnleased)
	wantUnleased := max(target-leased, 0)
	var readyOld []PodState
	for _, p := range oldUnleased {
		if p.Ready {
			readyOld = append(readyOld, p)
		} else {
			acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonOutdated})
		}
	}
	allowed := max(newReadyUnleased+int32(len(readyOld))-wantUnleased, 0)
	if allowed == 0 && cappedByMax && len(readyOld) > 0 && len(readyOld) == len(oldUnleased) {
		allowed = 1 // maxReplicas leaves no room to surge: replace one at a time
	}
	for _, p := range readyOld[:min(int(allowed), len(readyOld))] {
		acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonOutdated})
	}

	// 7. Scale-down of current pods, never leased ones, after the cooldown.
	excess := have - target
	var candidates []PodState
	for _, p := range updated {
		if !p.Leased {
			candidates = append(candidates, p)
		}
	}
	var pendingSince *time.Time
	scaleDownWaiting := false
	explicitExcess := int32(0)
	if in.ScaleIn == v1alpha1.ScaleInExplicit && excess > 0 {
		explicitExcess, candidates = excess, nil // only marked pods go (step 0)
	}
	if excess > 0 && len(candidates) > 0 && in.Jumpstarter != nil {
		// Exporters already disabled for a scale-down waited the cooldown
		// before: they go first and at once, or they would be re-enabled
		// while a new cooldown runs.
		sortForScaleIn(candidates, in.ScaleIn)
		n := 0
		for n < len(candidates) && int32(n) < excess && candidates[n].Exporter.draining() {
			acts.Delete = append(acts.Delete, Deletion{PodRef: candidates[n].ref(), Reason: ReasonScaleDown})
			n++
		}
		candidates, excess = candidates[n:], excess-int32(n)
	}
	if excess > 0 && len(candidates) > 0 {
		since := in.Now
		if in.ScaleDownPendingSince != nil {
			since = *in.ScaleDownPendingSince
		}
		if wait := since.Add(in.Cooldown).Sub(in.Now); wait > 0 {
			pendingSince = &since
			scaleDownWaiting = true
			requeue = append(requeue, wait)
		} else {
			sortForScaleIn(candidates, in.ScaleIn)
			for _, p := range candidates[:min(int(excess), len(candidates))] {
				acts.Delete = append(acts.Delete, Deletion{PodRef: p.ref(), Reason: ReasonScaleDown})
			}
		}
	}

	// 8. Jumpstarter: disable before delete, re-enable what is wanted again,
	//    keep the cold exporter.
	var draining int
	if in.Jumpstarter != nil {
		var wait time.Duration
		acts, draining, wait = planExporters(in, acts)
		if wait > 0 {
			requeue = append(requeue, wait)
		}
	}

	// Paused: say what would be done, do none of it.
	var wouldCreate, wouldDelete, wouldExporters int
	if in.Paused {
		wouldCreate, wouldDelete = int(acts.Create), len(acts.Delete)
		wouldExporters = len(acts.Disable) + len(acts.Enable)
		acts.Create, acts.Delete, acts.Disable, acts.Enable, acts.Cold, acts.Set = 0, nil, nil, nil, ColdKeep, nil
	}

	// 9. Status.
	st := Status{
		Replicas:              int32(len(live)),
		Desired:               target,
		Ready:                 ready,
		Available:             available,
		Leased:                leased,
		Updated:               int32(len(updated)),
		ScaleDownPendingSince: pendingSince,
		ConsecutiveFailures:   failures,
		LastFailureTime:       lastFailure,
	}
	if in.Jumpstarter != nil {
		st.PendingLeases = in.Demand
	}
	wantAvailable := min(minAvailable, wantUnleased)
	if ready >= target && available >= wantAvailable {
		st.Conditions = append(st.Conditions, Condition{v1alpha1.ConditionAvailable, metav1.ConditionTrue,
			"MinimumReplicasAvailable", fmt.Sprintf("%d/%d pods ready, %d/%d available", ready, target, available, wantAvailable)})
	} else {
		st.Conditions = append(st.Conditions, Condition{v1alpha1.ConditionAvailable, metav1.ConditionFalse,
			"MinimumReplicasUnavailable", fmt.Sprintf("%d/%d pods ready, %d/%d available", ready, target, available, wantAvailable)})
	}

	prog := Condition{Type: v1alpha1.ConditionProgressing, Status: metav1.ConditionTrue}
	switch {
	case in.Paused:
		prog.Status, prog.Reason = metav1.ConditionUnknown, "Paused"
		prog.Message = fmt.Sprintf("spec.paused: scaling stopped; would create %d and delete %d pods", wouldCreate, wouldDelete)
		if wouldExporters > 0 {
			prog.Message += fmt.Sprintf(" and change %d exporters", wouldExporters)
		}
		if pausedRemovals > 0 {
			prog.Message += fmt.Sprintf("; %d pods marked %s=true wait", pausedRemovals, v1alpha1.RemoveAnnotation)
		}
	case removals > 0:
		prog.Reason, prog.Message = "Removing", fmt.Sprintf("removing %d pods marked %s=true; spec.replicas %d", removals, v1alpha1.RemoveAnnotation, replicas)
	case backingOff:
		prog.Reason, prog.Message = "FailureBackoff", fmt.Sprintf("%d pods failed in a row; next create in %s", failures, backoffWait.Round(time.Second))
	case create > 0 || in.PendingCreates > 0:
		prog.Reason, prog.Message = "ScalingUp", fmt.Sprintf("creating %d pods (%d in flight) towards %d", create, in.PendingCreates, target)
	case draining > 0:
		prog.Reason, prog.Message = "DrainingExporters", fmt.Sprintf("%d exporters disabled; their pods go once unleased for %s", draining, in.Jumpstarter.DrainDelay)
	case retiring > 0:
		prog.Reason, prog.Message = "Recycling", fmt.Sprintf("deleting %d released pods", retiring)
	case len(oldUnleased) > 0 || len(oldLeased) > 0:
		prog.Reason, prog.Message = "RollingOut", fmt.Sprintf("%d pods outdated (%d leased, replaced after release)", len(oldUnleased)+len(oldLeased), len(oldLeased))
	case scaleDownWaiting:
		prog.Reason, prog.Message = "ScaleDownCooldown", fmt.Sprintf("%d pods above target %d; waiting for the cooldown", excess, target)
	case explicitExcess > 0:
		prog.Status, prog.Reason = metav1.ConditionFalse, "ExplicitScaleIn"
		prog.Message = fmt.Sprintf("%d pods above target %d; scaleInPolicy Explicit removes only pods annotated %s=true", explicitExcess, target, v1alpha1.RemoveAnnotation)
	case removalsWaiting > 0:
		prog.Status, prog.Reason = metav1.ConditionFalse, "RemovalWaitsForRelease"
		prog.Message = fmt.Sprintf("%d pods marked %s=true are leased; they go once released", removalsWaiting, v1alpha1.RemoveAnnotation)
	case excess > 0 && len(candidates) > 0:
		prog.Reason, prog.Message = "ScalingDown", fmt.Sprintf("deleting %d pods towards %d", min(int(excess), len(candidates)), target)
	default:
		prog.Status, prog.Reason, prog.Message = metav1.ConditionFalse, "Complete", fmt.Sprintf("%d pods at the current template", len(updated))
	}
	st.Conditions = append(st.Conditions, prog)

	st.Conditions = append(st.Conditions, replicaFailure(live, failures, lastFailed, in.LastFailure))
	if in.Jumpstarter != nil {
		c := exportersReady(live)
		st.Conditions = append(st.Conditions, c)
		if c.Status == metav1.ConditionFalse {
			// What a gated pod waits for may be no watched object (the
			// guest login Secret): look again.
			requeue = append(requeue, GatedRecheck)
		}
	}
	acts.Status = st

	for _, d := range requeue {
		if d > 0 && (acts.RequeueAfter == 0 || d < acts.RequeueAfter) {
			acts.RequeueAfter = d
		}
	}
	return acts
}

// failedInARow is in the message of a ReplicaFailure condition that reports
// repeated pod failures; lastDetail introduces the last failed pod's detail.
const failedInARow, lastDetail = " pods failed in a row", "; last: "

// IsRepeatedFailure reports whether c is a ReplicaFailure condition that
// Plan made for repeated pod failures (the one to pass as
// Input.LastFailure).
func IsRepeatedFailure(c *Condition) bool {
	return c != nil && c.Type == v1alpha1.ConditionReplicaFailure && c.Status == metav1.ConditionTrue &&
		strings.Contains(c.Message, failedInARow)
}

func replicaFailure(live []PodState, failures int32, lastFailed *PodState, prev *Condition) Condition {
	var stuck []PodState
	for _, p := range live {
		if startFailureReasons[p.WaitingReason] {
			stuck = append(stuck, p)
		}
	}
	if len(stuck) > 0 {
		sort.Slice(stuck, func(i, j int) bool { return stuck[i].Name < stuck[j].Name })
		p := stuck[0]
		return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, p.WaitingReason,
			fmt.Sprintf("%d pods cannot start; pod %s: %s", len(stuck), p.Name, p.WaitingMessage)}
	}
	if failures >= failureThreshold {
		reason, msg := "PodFailed", ""
		switch {
		case lastFailed != nil:
			if lastFailed.FailedReason != "" {
				reason = lastFailed.FailedReason
			}
			msg = fmt.Sprintf("%spod %s: %s", lastDetail, lastFailed.Name, lastFailed.FailedMessage)
		case IsRepeatedFailure(prev):
			// No new failure in this pass (the failed pod is gone): keep the
			// last one's reason and detail rather than a generic one.
			reason = prev.Reason
			if i := strings.Index(prev.Message, lastDetail); i >= 0 {
				msg = prev.Message[i:]
			}
		}
		return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, reason,
			fmt.Sprintf("%d%s%s", failures, failedInARow, msg)}
	}
	return Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionFalse, "NoFailures", "pods start"}
}

// planExporters turns the pod deletions of a Jumpstarter-mode plan into
// the disable-then-delete protocol: a pod whose Exporter is enabled gets
// its Exporter disabled instead; a pod whose Exporter has been disabled by
// this controller for the drain delay is deleted (the executor checks,
// uncached, that no lease landed meanwhile); a leased pod is never
// disabled nor deleted. Exporters this controller disabled whose pod is
// no longer to go are enabled again. It returns the new actions, the
// number of exporters draining and when the next drain ends.
func planExporters(in Input, acts Actions) (Actions, int, time.Duration) {
	js := in.Jumpstarter
	byName := make(map[string]PodState, len(in.Pods))
	for _, p := range in.Pods {
		byName[p.Name] = p
	}
	var wait time.Duration
	var draining int
	going := map[string]bool{}
	deletes := acts.Delete[:0:0]
	for _, d := range acts.Delete {
		p := byName[d.Name]
		if p.Leased {
			continue // never (the rules above do not ask for it)
		}
		going[d.Name] = true
		e := p.Exporter
		switch {
		case !e.Found:
			deletes = append(deletes, d) // nothing can be leased through it
		case e.Enabled || e.DisabledAt.IsZero():
			acts.Disable = append(acts.Disable, ExporterRef{Name: p.Name, ResourceVersion: e.ResourceVersion})
			draining++
		default:
			if w := e.DisabledAt.Add(js.DrainDelay).Sub(in.Now); w > 0 {
				draining++
				if wait == 0 || w < wait {
					wait = w
				}
				continue
			}
			deletes = append(deletes, d)
		}
	}
	acts.Delete = deletes
	for _, p := range in.Pods {
		if p.Terminating || going[p.Name] || p.Leased || !p.Exporter.draining() {
			continue
		}
		acts.Enable = append(acts.Enable, ExporterRef{Name: p.Name, ResourceVersion: p.Exporter.ResourceVersion})
	}
	wantCold := in.MaxReplicas == nil || *in.MaxReplicas > 0
	switch c := js.Cold; {
	case wantCold && !c.Found:
		acts.Cold = ColdCreate
	case wantCold && !c.Enabled:
		acts.Cold = ColdEnable
	case !wantCold && c.Found && !c.Leased:
		acts.Cold = ColdDelete // no pod can ever serve a lease: let it be Unsatisfiable
	}
	return acts, draining, wait
}

// GatedRecheck is how often a set with pods held at the Jumpstarter
// scheduling gate is planned again, for what no watch reports (a guest
// login Secret created after the set).
var GatedRecheck = 5 * time.Second

// exportersReady is the ExportersReady condition: which pods still wait at
// the scheduling gate, and why.
func exportersReady(live []PodState) Condition {
	var gated []PodState
	for _, p := range live {
		if p.GateReason != "" {
			gated = append(gated, p)
		}
	}
	if len(gated) == 0 {
		return Condition{v1alpha1.ConditionExportersReady, metav1.ConditionTrue, "CredentialsIssued",
			fmt.Sprintf("%d pods have their exporter credential", len(live))}
	}
	sort.Slice(gated, func(i, j int) bool { return gated[i].Name < gated[j].Name })
	return Condition{v1alpha1.ConditionExportersReady, metav1.ConditionFalse, "WaitingForCredential",
		fmt.Sprintf("%d pods held by scheduling gate %s; pod %s: %s", len(gated), v1alpha1.JumpstarterGate, gated[0].Name, gated[0].GateReason)}
}

func (p PodState) ref() PodRef {
	return PodRef{Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion}
}

// autohealAt is when p counts as failing to start (zero if it never will
// as it is now): autohealing on, p not leased, waiting in an autoheal
// reason with at least the threshold of restarts; then the minimum
// duration after it stopped being Ready.
func (in Input) autohealAt(p PodState) time.Time {
	a := in.Autohealing
	if a == nil || p.Leased || p.Ready || p.Terminating || !autohealReasons[p.WaitingReason] || p.RestartCount < a.StartUpFailureThreshold {
		return time.Time{}
	}
	return p.notReadySince().Add(a.MinFailingToStartDuration)
}

func (p PodState) notReadySince() time.Time {
	if p.NotReadySince.IsZero() {
		return p.Created
	}
	return p.NotReadySince
}

// sortForScaleIn orders pods best-to-delete first: draining (Jumpstarter
// mode: Exporter already disabled) first, then not Ready before Ready, not
// yet running before running, then by age: newest first (the least
// invested) under Newest (and for rollouts), oldest first under Oldest.
// Ties of the same second go by name.
func sortForScaleIn(pods []PodState, policy v1alpha1.ScaleInPolicy) {
	oldest := policy == v1alpha1.ScaleInOldest
	sort.SliceStable(pods, func(i, j int) bool {
		a, b := pods[i], pods[j]
		if k, l := deletionClass(a), deletionClass(b); k != l {
			return k < l // already disabled for this: keep the choice stable
		}
		if !a.Created.Equal(b.Created) {
			return a.Created.After(b.Created) != oldest
		}
		return (a.Name > b.Name) != oldest
	})
}

// sortForDeletion orders pods best-to-delete first, newest first.
func sortForDeletion(pods []PodState) { sortForScaleIn(pods, v1alpha1.ScaleInNewest) }

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
