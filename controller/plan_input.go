package controller

import (
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

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
	// Set is the set's name (its Exporters' set label); Exporters the
	// Exporters labelled with it, the cold one aside (for sweepExporters).
	Set       string
	Exporters []PodExporter
	// Creating names the pods created and not yet seen in the cache;
	// Deleting are the UIDs of pods deleted and still seen there (left out
	// of Pods): the expectations.
	Creating []string
	Deleting []types.UID
}

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

func (p PodState) ref() PodRef {
	return PodRef{Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion}
}

// notReadySince is when p last stopped being Ready (its creation if it
// never had a Ready condition).
func (p PodState) notReadySince() time.Time {
	if p.NotReadySince.IsZero() {
		return p.Created
	}
	return p.NotReadySince
}
