package controller

import (
	"sort"

	"k8s.io/apimachinery/pkg/types"
)

// The orphan step of Plan (Jumpstarter mode, after planExporters): the
// set's pod Exporters whose pod is gone are deleted. The executor deletes
// a pod's Exporter right after the pod, but only when its cache listed the
// Exporter then, and a pass whose pod cache still shows a pod deleted
// since (the Exporter and pod caches lag independently) may create its
// Exporter again; the garbage collector, which would delete such an
// Exporter through its owner reference, is not relied on.

// PodExporter is what the planner knows of one Exporter labelled with
// the set (the cold exporter aside).
type PodExporter struct {
	Name string
	UID  types.UID
	// Set and Pod are its v1alpha1.ExporterSetLabel (or the upstream set
	// label) and v1alpha1.ExporterPodLabel values.
	Set, Pod string
	// PodUID is the UID its controller owner reference of kind Pod names
	// ("" without one: not a pod's Exporter of this controller).
	PodUID types.UID
}

// ExporterDeletion is one Exporter whose pod is gone. The executor reads
// the pod named Pod from the API server first and keeps the Exporter if
// it exists with PodUID; it deletes with the Exporter's UID as
// precondition (a new Exporter of the same name is not touched).
type ExporterDeletion struct {
	Name   string
	UID    types.UID
	PodUID types.UID
}

// orphanInput is what sweepExporters looks at.
type orphanInput struct {
	// Set is the set's name; Exporters the Exporters labelled with it.
	Set       string
	Exporters []PodExporter
	// Pods are the set's pods (Input.Pods); Deleting the UIDs of pods
	// deleted and still shown by the cache; Creating the names of pods
	// created and not yet shown (expectations): each such pod exists.
	Pods     []PodState
	Deleting []types.UID
	Creating []string
}

// sweepExporters returns the set's pod Exporters whose pod no longer
// exists, by name. Only this controller's pod Exporters are candidates:
// labelled with this set and with their own name as pod, owned by a pod.
// An Exporter whose pod the cache shows (by UID; leased or not, going or
// not) stays, and so does one whose pod was created and is not shown yet
// (the Exporter is created after its pod, and its cache may be ahead).
func sweepExporters(in orphanInput) []ExporterDeletion {
	exists := make(map[types.UID]bool, len(in.Pods)+len(in.Deleting))
	for _, p := range in.Pods {
		exists[p.UID] = true
	}
	for _, uid := range in.Deleting {
		exists[uid] = true
	}
	creating := make(map[string]bool, len(in.Creating))
	for _, n := range in.Creating {
		creating[n] = true
	}
	var out []ExporterDeletion
	for _, e := range in.Exporters {
		if e.Set != in.Set || e.Pod != e.Name || e.PodUID == "" || exists[e.PodUID] || creating[e.Name] {
			continue
		}
		out = append(out, ExporterDeletion{Name: e.Name, UID: e.UID, PodUID: e.PodUID})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}
