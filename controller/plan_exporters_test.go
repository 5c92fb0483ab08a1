package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestPlanExporters(t *testing.T) {
	exp := func(e ExporterState) func(*PodState) {
		return func(p *PodState) { e.ResourceVersion = "e-" + p.Name; p.Exporter = e }
	}
	enabled := exp(ExporterState{Found: true, Enabled: true})
	disabledFor := func(d time.Duration) func(*PodState) {
		return exp(ExporterState{Found: true, DisabledAt: t0.Add(-d)})
	}
	del := func(names ...string) []Deletion {
		var out []Deletion
		for _, n := range names {
			out = append(out, Deletion{PodRef: PodRef{Name: n}, Reason: ReasonScaleDown})
		}
		return out
	}
	coldOK := ExporterState{Found: true, Enabled: true}
	cases := []struct {
		name         string
		in           exporterInput
		wantDelete   []string
		wantDisable  []string
		wantEnable   []string
		wantCold     ColdAction
		wantDraining int
		wantRequeue  time.Duration
	}{
		{name: "enabled exporter is disabled, its pod stays",
			in:          exporterInput{Pods: []PodState{pod("a", time.Minute, enabled)}, Delete: del("a"), Cold: coldOK, WantCold: true},
			wantDisable: []string{"a"}, wantDraining: 1},
		{name: "pod without exporter goes at once",
			in:         exporterInput{Pods: []PodState{pod("a", time.Minute)}, Delete: del("a"), Cold: coldOK, WantCold: true},
			wantDelete: []string{"a:" + ReasonScaleDown}},
		{name: "disabled within the drain delay waits; requeue at its end",
			in: exporterInput{Pods: []PodState{pod("a", time.Minute, disabledFor(time.Minute))}, Delete: del("a"),
				DrainDelay: 3 * time.Minute, Cold: coldOK, WantCold: true},
			wantDraining: 1, wantRequeue: 2 * time.Minute},
		{name: "drained exporter's pod goes",
			in: exporterInput{Pods: []PodState{pod("a", time.Minute, disabledFor(time.Hour))}, Delete: del("a"),
				DrainDelay: 3 * time.Minute, Cold: coldOK, WantCold: true},
			wantDelete: []string{"a:" + ReasonScaleDown}},
		{name: "exporter disabled by someone else is disabled by us first",
			in:          exporterInput{Pods: []PodState{pod("a", time.Minute, exp(ExporterState{Found: true}))}, Delete: del("a"), Cold: coldOK, WantCold: true},
			wantDisable: []string{"a"}, wantDraining: 1},
		{name: "leased pod is neither disabled nor deleted",
			in:       exporterInput{Pods: []PodState{pod("a", time.Minute, leased, enabled)}, Delete: del("a"), Cold: coldOK, WantCold: true},
			wantCold: ColdKeep},
		{name: "drained pod no longer going is enabled again",
			in:         exporterInput{Pods: []PodState{pod("a", time.Minute, disabledFor(time.Minute))}, Cold: coldOK, WantCold: true},
			wantEnable: []string{"a"}},
		{name: "terminating or leased draining pods are not enabled",
			in: exporterInput{Pods: []PodState{pod("a", time.Minute, disabledFor(time.Minute), term),
				pod("b", time.Minute, disabledFor(time.Minute), leased)}, Cold: coldOK, WantCold: true}},
		{name: "missing cold exporter is created",
			in: exporterInput{WantCold: true}, wantCold: ColdCreate},
		{name: "disabled cold exporter is enabled",
			in: exporterInput{WantCold: true, Cold: ExporterState{Found: true}}, wantCold: ColdEnable},
		{name: "maxReplicas 0: unleased cold exporter is deleted",
			in: exporterInput{Cold: coldOK}, wantCold: ColdDelete},
		{name: "maxReplicas 0: leased cold exporter stays",
			in: exporterInput{Cold: ExporterState{Found: true, Enabled: true, Leased: true}}, wantCold: ColdKeep},
	}
	refs := func(rs []ExporterRef) []string {
		var out []string
		for _, r := range rs {
			out = append(out, r.Name)
			assert.Equal(t, "e-"+r.Name, r.ResourceVersion, "exporter ref without its resourceVersion")
		}
		return out
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.Now = t0
			out := planExporters(tc.in)
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: out.Delete}), "delete")
			assert.Equal(t, tc.wantDisable, refs(out.Disable), "disable")
			assert.Equal(t, tc.wantEnable, refs(out.Enable), "enable")
			assert.Equal(t, tc.wantCold, out.Cold, "cold")
			assert.Equal(t, tc.wantDraining, out.Draining, "draining")
			assert.Equal(t, tc.wantRequeue, out.Requeue, "requeue")
		})
	}
}

func TestExportersReady(t *testing.T) {
	gate := func(why string) func(*PodState) { return func(p *PodState) { p.GateReason = why } }
	cases := []struct {
		name        string
		live        []PodState
		wantStatus  metav1.ConditionStatus
		wantMessage string
	}{
		{name: "none gated", live: []PodState{pod("a", time.Minute)}, wantStatus: metav1.ConditionTrue,
			wantMessage: "1 pods have their exporter credential"},
		{name: "gated pods name the first by name",
			live:       []PodState{pod("b", time.Minute, gate("no token")), pod("a", time.Minute, gate("no secret")), pod("c", time.Minute)},
			wantStatus: metav1.ConditionFalse, wantMessage: "2 pods held by scheduling gate qemu-kubelet.io/jumpstarter-credential; pod a: no secret"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := exportersReady(tc.live)
			assert.Equal(t, tc.wantStatus, c.Status)
			assert.Equal(t, tc.wantMessage, c.Message)
		})
	}
}
