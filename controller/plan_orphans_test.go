package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/types"
)

// podExp is the Exporter this controller makes for the pod named name of
// set "s" whose UID is uid-<name>.
func podExp(name string, opts ...func(*PodExporter)) PodExporter {
	e := PodExporter{Name: name, UID: types.UID("euid-" + name), Set: "s", Pod: name, PodUID: types.UID("uid-" + name)}
	for _, o := range opts {
		o(&e)
	}
	return e
}

func TestSweepExporters(t *testing.T) {
	gone := func(name string) ExporterDeletion {
		return ExporterDeletion{Name: name, UID: types.UID("euid-" + name), PodUID: types.UID("uid-" + name)}
	}
	cases := []struct {
		name string
		in   orphanInput
		want []ExporterDeletion
	}{
		{name: "orphan deleted: its pod is gone",
			in:   orphanInput{Set: "s", Exporters: []PodExporter{podExp("a"), podExp("b")}, Pods: []PodState{pod("a", time.Minute)}},
			want: []ExporterDeletion{gone("b")}},
		{name: "exporter whose pod is created and not yet cached is kept",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a")}, Creating: []string{"a"}}},
		{name: "leased exporter is never deleted while its pod exists",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a")}, Pods: []PodState{pod("a", time.Minute, leased, exp)}}},
		{name: "exporter of a terminating pod is kept until the pod is gone",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a")}, Pods: []PodState{pod("a", time.Minute, term)}}},
		{name: "exporter of a pod deleted and still cached is kept",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a")}, Deleting: []types.UID{"uid-a"}}},
		{name: "exporter of another set is untouched",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a", func(e *PodExporter) { e.Set = "other" })}}},
		{name: "exporter not owned by a pod is untouched",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a", func(e *PodExporter) { e.PodUID = "" })}}},
		{name: "exporter whose pod label is not its own name is untouched",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a", func(e *PodExporter) { e.Pod = "b" })}}},
		{name: "exporter of an earlier pod of the same name is deleted",
			in: orphanInput{Set: "s", Exporters: []PodExporter{podExp("a", func(e *PodExporter) { e.PodUID = "uid-old" })},
				Pods: []PodState{pod("a", time.Minute)}},
			want: []ExporterDeletion{{Name: "a", UID: "euid-a", PodUID: "uid-old"}}},
		{name: "several orphans, sorted by name",
			in:   orphanInput{Set: "s", Exporters: []PodExporter{podExp("c"), podExp("a")}},
			want: []ExporterDeletion{gone("a"), gone("c")}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, sweepExporters(tc.in))
		})
	}
}

// TestPlanSweepsOrphanExporters: Plan lists the orphans in Jumpstarter
// mode, paused or not, from the pods left after the expectations.
func TestPlanSweepsOrphanExporters(t *testing.T) {
	in := js(base(1, 0))
	in.Pods = []PodState{pod("a", time.Minute, exp)}
	in.Jumpstarter.Set = "s"
	in.Jumpstarter.Exporters = []PodExporter{podExp("a"), podExp("b"), podExp("c"), podExp("d")}
	in.Jumpstarter.Creating = []string{"c"}
	in.Jumpstarter.Deleting = []types.UID{"uid-d"}
	want := []ExporterDeletion{{Name: "b", UID: "euid-b", PodUID: "uid-b"}}
	assert.Equal(t, want, Plan(in).DeleteExporters)

	in.Paused = true
	acts := Plan(in)
	assert.Equal(t, want, acts.DeleteExporters, "a paused set still deletes Exporters whose pod is gone")
	assert.Empty(t, acts.Delete)
}
