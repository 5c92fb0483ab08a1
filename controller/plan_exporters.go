package controller

import (
	"fmt"
	"sort"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// The Jumpstarter step of Plan (step 8): disable an Exporter before its pod
// goes, enable again what is wanted again, keep the cold exporter; and the
// ExportersReady condition.

// exporterInput is what planExporters looks at.
type exporterInput struct {
	// Pods are all the set's pods (after lease expiry); Delete the
	// deletions the steps before decided.
	Pods   []PodState
	Delete []Deletion
	// DrainDelay is JumpstarterInput.DrainDelay.
	DrainDelay time.Duration
	// Cold is the cold exporter; WantCold says whether the set keeps one
	// (not with maxReplicas 0: no pod could ever serve a lease).
	Cold     ExporterState
	WantCold bool
	Now      time.Time
}

// exporterDecision is what planExporters decided.
type exporterDecision struct {
	// Delete are the deletions that may go now; Disable, Enable and Cold
	// as in Actions.
	Delete          []Deletion
	Disable, Enable []ExporterRef
	Cold            ColdAction
	// Draining counts the Exporters disabled (now or before) whose pod
	// waits for the drain delay; Requeue is when the next drain ends.
	Draining int
	Requeue  time.Duration
}

// planExporters turns the pod deletions of a Jumpstarter-mode plan into
// the disable-then-delete protocol: a pod whose Exporter is enabled gets
// its Exporter disabled instead; a pod whose Exporter has been disabled by
// this controller for the drain delay is deleted (the executor checks,
// uncached, that no lease landed meanwhile); a leased pod is never
// disabled nor deleted. Exporters this controller disabled whose pod is
// no longer to go are enabled again.
func planExporters(in exporterInput) exporterDecision {
	var out exporterDecision
	byName := make(map[string]PodState, len(in.Pods))
	for _, p := range in.Pods {
		byName[p.Name] = p
	}
	going := map[string]bool{}
	out.Delete = in.Delete[:0:0]
	for _, d := range in.Delete {
		p := byName[d.Name]
		if p.Leased {
			continue // never (the rules above do not ask for it)
		}
		going[d.Name] = true
		e := p.Exporter
		switch {
		case !e.Found:
			out.Delete = append(out.Delete, d) // nothing can be leased through it
		case e.Enabled || e.DisabledAt.IsZero():
			out.Disable = append(out.Disable, ExporterRef{Name: p.Name, ResourceVersion: e.ResourceVersion})
			out.Draining++
		default:
			if w := e.DisabledAt.Add(in.DrainDelay).Sub(in.Now); w > 0 {
				out.Draining++
				out.Requeue = soonest(out.Requeue, w)
				continue
			}
			out.Delete = append(out.Delete, d)
		}
	}
	for _, p := range in.Pods {
		if p.Terminating || going[p.Name] || p.Leased || !p.Exporter.draining() {
			continue
		}
		out.Enable = append(out.Enable, ExporterRef{Name: p.Name, ResourceVersion: p.Exporter.ResourceVersion})
	}
	switch c := in.Cold; {
	case in.WantCold && !c.Found:
		out.Cold = ColdCreate
	case in.WantCold && !c.Enabled:
		out.Cold = ColdEnable
	case !in.WantCold && c.Found && !c.Leased:
		out.Cold = ColdDelete // no pod can ever serve a lease: let it be Unsatisfiable
	}
	return out
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
