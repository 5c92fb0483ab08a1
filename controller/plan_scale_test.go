package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/utils/ptr"
)

func TestCountPods(t *testing.T) {
	enabled := func(p *PodState) { p.Exporter = ExporterState{Found: true, Enabled: true} }
	cases := []struct {
		name                                  string
		live                                  []PodState
		exporters                             bool
		wantLeased, wantReady, wantAvailable  int32
		wantNewReadyUnleased                  int32
		wantUpdated, wantOldLeased, wantOldUn []string
	}{
		{name: "none"},
		{name: "ready free current pod is available",
			live: []PodState{pod("a", time.Minute)}, wantReady: 1, wantAvailable: 1, wantNewReadyUnleased: 1,
			wantUpdated: []string{"a"}},
		{name: "leased and used pods are ready but not available",
			live:       []PodState{pod("a", time.Minute, leased), pod("b", time.Minute, used)},
			wantLeased: 1, wantReady: 2, wantUpdated: []string{"a", "b"}},
		{name: "not ready pod counts nowhere but updated",
			live: []PodState{pod("a", time.Minute, notReady)}, wantUpdated: []string{"a"}},
		{name: "outdated pods split by lease",
			live:       []PodState{pod("a", time.Minute, old, leased), pod("b", time.Minute, old)},
			wantLeased: 1, wantReady: 2, wantAvailable: 1, wantOldLeased: []string{"a"}, wantOldUn: []string{"b"}},
		{name: "jumpstarter: available only with an enabled exporter",
			live:      []PodState{pod("a", time.Minute, enabled), pod("b", time.Minute)},
			exporters: true, wantReady: 2, wantAvailable: 1, wantNewReadyUnleased: 2, wantUpdated: []string{"a", "b"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := countPods(countInput{Live: tc.live, TemplateHash: curHash, Exporters: tc.exporters})
			assert.Equal(t, tc.wantLeased, c.Leased, "leased")
			assert.Equal(t, tc.wantReady, c.Ready, "ready")
			assert.Equal(t, tc.wantAvailable, c.Available, "available")
			assert.Equal(t, tc.wantNewReadyUnleased, c.NewReadyUnleased, "new ready unleased")
			assert.Equal(t, tc.wantUpdated, names(c.Updated), "updated")
			assert.Equal(t, tc.wantOldLeased, names(c.OldLeased), "old leased")
			assert.Equal(t, tc.wantOldUn, names(c.OldUnleased), "old unleased")
		})
	}
}

func TestTarget(t *testing.T) {
	cases := []struct {
		name                                   string
		replicas, minAvailable, leased, demand int32
		max                                    *int32
		want                                   int32
	}{
		{name: "replicas", replicas: 3, want: 3},
		{name: "warm buffer above replicas", replicas: 1, minAvailable: 2, leased: 2, want: 4},
		{name: "demand counts like leases", replicas: 0, demand: 2, leased: 1, want: 3},
		{name: "capped by maxReplicas", replicas: 5, max: ptr.To[int32](3), want: 3},
		{name: "never negative", replicas: -1, want: 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Target(tc.replicas, tc.minAvailable, tc.leased, tc.demand, tc.max))
		})
	}
}

func TestPlanCreates(t *testing.T) {
	cases := []struct {
		name        string
		in          createInput
		wantCreate  int32
		wantCapped  bool
		wantBackoff bool
		wantRequeue time.Duration
	}{
		{name: "everything missing at once", in: createInput{Target: 5, Have: 1, Live: 1}, wantCreate: 4},
		{name: "nothing missing", in: createInput{Target: 2, Have: 3, Live: 3}},
		{name: "pending creates count as had", in: createInput{Target: 5, Have: 4, PendingCreates: 3, Live: 1}, wantCreate: 1},
		{name: "capped by the room maxReplicas leaves",
			in:         createInput{Target: 5, Have: 2, Live: 3, PendingCreates: 1, MaxReplicas: ptr.To[int32](5)},
			wantCreate: 1, wantCapped: true},
		{name: "no room at all",
			in:         createInput{Target: 5, Have: 2, Live: 6, MaxReplicas: ptr.To[int32](5)},
			wantCreate: 0, wantCapped: true},
		{name: "backoff holds creates and requeues",
			in:          createInput{Target: 3, Have: 1, Live: 1, BackoffWait: 7 * time.Second},
			wantBackoff: true, wantRequeue: 7 * time.Second},
		{name: "backoff with nothing to create is no backoff",
			in: createInput{Target: 1, Have: 1, Live: 1, BackoffWait: 7 * time.Second}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := planCreates(tc.in)
			assert.Equal(t, tc.wantCreate, out.Create, "create")
			assert.Equal(t, tc.wantCapped, out.CappedByMax, "capped")
			assert.Equal(t, tc.wantBackoff, out.BackingOff, "backing off")
			assert.Equal(t, tc.wantRequeue, out.Requeue, "requeue")
		})
	}
}

func TestPlanRollout(t *testing.T) {
	cases := []struct {
		name       string
		in         rolloutInput
		wantDelete []string
	}{
		{name: "nothing outdated", in: rolloutInput{WantUnleased: 2, NewReadyUnleased: 2}},
		{name: "not ready outdated pods go at once, newest first",
			in: rolloutInput{OldUnleased: []PodState{pod("a", 2*time.Minute, old, notReady), pod("b", time.Minute, old, notReady)},
				WantUnleased: 2},
			wantDelete: []string{"b:" + ReasonOutdated, "a:" + ReasonOutdated}},
		{name: "ready outdated pods go only above what is wanted",
			in: rolloutInput{OldUnleased: []PodState{pod("a", 2*time.Minute, old), pod("b", time.Minute, old)},
				WantUnleased: 2, NewReadyUnleased: 1},
			wantDelete: []string{"b:" + ReasonOutdated}},
		{name: "ready outdated pods stay while no replacement is ready",
			in: rolloutInput{OldUnleased: []PodState{pod("a", time.Minute, old)}, WantUnleased: 1}},
		{name: "capped by maxReplicas: one at a time",
			in:         rolloutInput{OldUnleased: []PodState{pod("a", 2*time.Minute, old), pod("b", time.Minute, old)}, WantUnleased: 2, CappedByMax: true},
			wantDelete: []string{"b:" + ReasonOutdated}},
		{name: "capped but a not-ready one already goes: no extra",
			in: rolloutInput{OldUnleased: []PodState{pod("a", 2*time.Minute, old), pod("b", time.Minute, old, notReady)},
				WantUnleased: 2, CappedByMax: true},
			wantDelete: []string{"b:" + ReasonOutdated}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := append([]PodState(nil), tc.in.OldUnleased...)
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: planRollout(tc.in)}))
			assert.Equal(t, before, tc.in.OldUnleased, "the input is not reordered")
		})
	}
}

func TestPlanScaleDown(t *testing.T) {
	draining := func(p *PodState) { p.Exporter = ExporterState{Found: true, DisabledAt: t0.Add(-time.Minute)} }
	three := []PodState{pod("a", 3*time.Minute), pod("b", 2*time.Minute), pod("c", time.Minute)}
	cases := []struct {
		name           string
		in             scaleDownInput
		wantDelete     []string
		wantWaiting    bool
		wantSince      *time.Time
		wantExplicit   int32
		wantExcess     int32
		wantCandidates int
		wantRequeue    time.Duration
	}{
		{name: "no excess", in: scaleDownInput{Updated: three}, wantCandidates: 3},
		{name: "cooldown starts now", in: scaleDownInput{Updated: three, Excess: 1, Cooldown: time.Minute},
			wantWaiting: true, wantSince: ptr.To(t0), wantExcess: 1, wantCandidates: 3, wantRequeue: time.Minute},
		{name: "cooldown running keeps its start",
			in:          scaleDownInput{Updated: three, Excess: 1, Cooldown: time.Minute, PendingSince: ptr.To(t0.Add(-20 * time.Second))},
			wantWaiting: true, wantSince: ptr.To(t0.Add(-20 * time.Second)), wantExcess: 1, wantCandidates: 3, wantRequeue: 40 * time.Second},
		{name: "after the cooldown the newest go",
			in:         scaleDownInput{Updated: three, Excess: 2, Cooldown: time.Minute, PendingSince: ptr.To(t0.Add(-time.Minute))},
			wantDelete: []string{"c:" + ReasonScaleDown, "b:" + ReasonScaleDown}, wantExcess: 2, wantCandidates: 3},
		{name: "oldest first",
			in:         scaleDownInput{Updated: three, Excess: 1, OldestFirst: true},
			wantDelete: []string{"a:" + ReasonScaleDown}, wantExcess: 1, wantCandidates: 3},
		{name: "not ready before ready whatever the age",
			in:         scaleDownInput{Updated: []PodState{pod("a", 3*time.Minute, notReady), pod("c", time.Minute)}, Excess: 1},
			wantDelete: []string{"a:" + ReasonScaleDown}, wantExcess: 1, wantCandidates: 2},
		{name: "leased pods never go",
			in:         scaleDownInput{Updated: []PodState{pod("a", time.Minute, leased), pod("b", 2*time.Minute)}, Excess: 2},
			wantDelete: []string{"b:" + ReasonScaleDown}, wantExcess: 2, wantCandidates: 1},
		{name: "explicit policy leaves the excess to marked pods",
			in:           scaleDownInput{Updated: three, Excess: 2, Explicit: true},
			wantExplicit: 2, wantExcess: 2},
		{name: "jumpstarter: draining exporters go at once, the rest waits the cooldown",
			in: scaleDownInput{Updated: []PodState{pod("a", 3*time.Minute, draining), pod("b", 2*time.Minute), pod("c", time.Minute)},
				Excess: 2, Exporters: true, Cooldown: time.Minute},
			wantDelete: []string{"a:" + ReasonScaleDown}, wantWaiting: true, wantSince: ptr.To(t0),
			wantExcess: 1, wantCandidates: 2, wantRequeue: time.Minute},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.Now = t0
			out := planScaleDown(tc.in)
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: out.Delete}), "delete")
			assert.Equal(t, tc.wantWaiting, out.Waiting, "waiting")
			assert.Equal(t, tc.wantSince, out.PendingSince, "pending since")
			assert.Equal(t, tc.wantExplicit, out.ExplicitExcess, "explicit excess")
			assert.Equal(t, tc.wantExcess, out.Excess, "excess left")
			assert.Equal(t, tc.wantCandidates, out.Candidates, "candidates left")
			assert.Equal(t, tc.wantRequeue, out.Requeue, "requeue")
		})
	}
}
