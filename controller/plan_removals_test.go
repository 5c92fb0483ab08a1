package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

func TestPlanRemovals(t *testing.T) {
	marked := func(p *PodState) { p.RemoveRequested = true }
	cases := []struct {
		name         string
		pods         []PodState
		counted      []types.UID
		replicas     int32
		paused       bool
		wantDelete   []string
		wantReplicas int32
		// wantSet: nil for no patch; else the patch's Removing, Counted and
		// whether it lowers replicas.
		wantSet                        *SetPatch
		wantWaiting, wantPausedRemoval int32
	}{
		{name: "nothing marked: no patch", pods: []PodState{pod("a", time.Minute)}, replicas: 2, wantReplicas: 2},
		{name: "marked unleased pod goes and lowers replicas once",
			pods: []PodState{pod("a", time.Minute, marked), pod("b", time.Minute)}, replicas: 2,
			wantDelete: []string{"a:" + ReasonRemoved}, wantReplicas: 1,
			wantSet: &SetPatch{Replicas: ptr.To[int32](1), Removing: []types.UID{"uid-a"}, Counted: []string{"a"}}},
		{name: "already counted pod goes without lowering again",
			pods: []PodState{pod("a", time.Minute, marked)}, counted: []types.UID{"uid-a"}, replicas: 1,
			wantDelete: []string{"a:" + ReasonRemoved}, wantReplicas: 1},
		{name: "marked leased pod waits, not counted",
			pods: []PodState{pod("a", time.Minute, marked, leased)}, replicas: 1, wantReplicas: 1, wantWaiting: 1},
		{name: "counted pod leased again stays counted, not waiting",
			pods: []PodState{pod("a", time.Minute, leased)}, counted: []types.UID{"uid-a"}, replicas: 1, wantReplicas: 1},
		{name: "counted UIDs that are gone leave the bookkeeping",
			pods: []PodState{pod("a", time.Minute)}, counted: []types.UID{"uid-gone"}, replicas: 1, wantReplicas: 1,
			wantSet: &SetPatch{}},
		{name: "terminating marked pod is ignored",
			pods: []PodState{pod("a", time.Minute, marked, term)}, replicas: 1, wantReplicas: 1},
		{name: "replicas never below zero",
			pods: []PodState{pod("a", time.Minute, marked), pod("b", time.Minute, marked)}, replicas: 1,
			wantDelete: []string{"a:" + ReasonRemoved, "b:" + ReasonRemoved}, wantReplicas: 0,
			wantSet: &SetPatch{Replicas: ptr.To[int32](0), Removing: []types.UID{"uid-a", "uid-b"}, Counted: []string{"a", "b"}}},
		{name: "paused: nothing goes, unleased marked pods are counted as waiting",
			pods:   []PodState{pod("a", time.Minute, marked), pod("b", time.Minute, marked, leased)},
			paused: true, replicas: 2, wantReplicas: 2, wantPausedRemoval: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out := planRemovals(removalInput{Pods: tc.pods, Counted: tc.counted, Replicas: tc.replicas, Paused: tc.paused})
			assert.Equal(t, tc.wantDelete, deletions(Actions{Delete: out.Delete}), "delete")
			assert.Equal(t, int32(len(tc.wantDelete)), out.Removals, "removals")
			for _, d := range tc.wantDelete {
				assert.True(t, out.Removed[d[:1]], "removed %s", d)
			}
			assert.Equal(t, tc.wantReplicas, out.Replicas, "replicas")
			assert.Equal(t, tc.wantWaiting, out.Waiting, "waiting")
			assert.Equal(t, tc.wantPausedRemoval, out.PausedRemovals, "paused removals")
			if tc.wantSet == nil {
				assert.Nil(t, out.Set, "set patch")
				return
			}
			if assert.NotNil(t, out.Set, "set patch") {
				assert.Equal(t, tc.wantSet.Replicas, out.Set.Replicas, "patched replicas")
				assert.ElementsMatch(t, tc.wantSet.Removing, out.Set.Removing, "removing")
				assert.Equal(t, tc.wantSet.Counted, out.Set.Counted, "counted")
			}
		})
	}
}
