package controller

import (
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
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
	// DeleteExporters lists the set's pod Exporters whose pod is gone
	// (Jumpstarter mode). A paused set deletes them too: they belong to no
	// pod, and the garbage collector would delete them as well.
	DeleteExporters []ExporterDeletion
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
