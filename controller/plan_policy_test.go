package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func marked(p *PodState) { p.RemoveRequested = true }
func crashLoop(restarts int32, notReadyFor time.Duration) func(*PodState) {
	return func(p *PodState) {
		p.Phase, p.Ready, p.WaitingReason, p.WaitingMessage = corev1.PodRunning, false, "CrashLoopBackOff", "back-off 40s restarting failed container vm"
		p.RestartCount, p.NotReadySince = restarts, t0.Add(-notReadyFor)
	}
}

// TestPlanScaleInPolicy: which pods go on scale-in, and removals of marked
// pods (spec.replicas lowered once per pod), under each policy.
func TestPlanScaleInPolicy(t *testing.T) {
	// Four Ready pods, p1 oldest; scale to 2 after the cooldown.
	four := func(policy v1alpha1.ScaleInPolicy, mods ...func(*PodState)) Input {
		m := func(i int) []func(*PodState) {
			if i < len(mods) && mods[i] != nil {
				return []func(*PodState){mods[i]}
			}
			return nil
		}
		return with(base(2, 0, pod("p1", 4*time.Minute, m(0)...), pod("p2", 3*time.Minute, m(1)...),
			pod("p3", 2*time.Minute, m(2)...), pod("p4", time.Minute, m(3)...)), func(i *Input) {
			i.Cooldown, i.ScaleIn = 0, policy
		})
	}
	cases := []struct {
		name       string
		in         Input
		wantCreate int32
		wantDelete []string
		wantSet    *SetPatch
		check      func(t *testing.T, a Actions)
	}{
		{name: "Newest (default, empty) removes the newest", in: four(""), wantDelete: []string{"p4:ScaleDown", "p3:ScaleDown"}},
		{name: "Newest removes the newest", in: four(v1alpha1.ScaleInNewest), wantDelete: []string{"p4:ScaleDown", "p3:ScaleDown"}},
		{name: "Oldest removes the oldest", in: four(v1alpha1.ScaleInOldest), wantDelete: []string{"p1:ScaleDown", "p2:ScaleDown"}},
		{
			name:       "Oldest never picks a leased pod: the next oldest go",
			in:         four(v1alpha1.ScaleInOldest, leased),
			wantDelete: []string{"p2:ScaleDown", "p3:ScaleDown"},
		},
		{
			name:       "Oldest still removes not-Ready pods first",
			in:         four(v1alpha1.ScaleInOldest, nil, nil, nil, notReady),
			wantDelete: []string{"p4:ScaleDown", "p1:ScaleDown"},
		},
		{
			name: "Oldest breaks a same-second tie by name",
			in: with(base(1, 0, pod("b", time.Minute), pod("a", time.Minute), pod("c", time.Minute)), func(i *Input) {
				i.Cooldown, i.ScaleIn = 0, v1alpha1.ScaleInOldest
			}),
			wantDelete: []string{"a:ScaleDown", "b:ScaleDown"},
		},
		{
			name: "Explicit removes nothing unmarked, even after the cooldown",
			in:   four(v1alpha1.ScaleInExplicit),
			check: func(t *testing.T, a Actions) {
				c := cond(a, "Progressing")
				assert.Equal(t, metav1.ConditionFalse, c.Status)
				assert.Equal(t, "ExplicitScaleIn", c.Reason)
				assert.Contains(t, c.Message, "2 pods above target 2")
				assert.Nil(t, a.Status.ScaleDownPendingSince, "no cooldown runs for nothing")
			},
		},
		{
			name:       "Explicit: a marked pod goes and replicas drop by one",
			in:         with(four(v1alpha1.ScaleInExplicit, nil, marked), func(i *Input) { i.Replicas = 4 }),
			wantDelete: []string{"p2:Removed"},
			wantSet:    &SetPatch{Replicas: ptr.To[int32](3), Removing: []types.UID{"uid-p2"}, Counted: []string{"p2"}},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(3), a.Status.Desired)
				assert.Equal(t, int32(3), a.Status.Replicas, "the removed pod no longer counts")
				assert.Equal(t, "Removing", cond(a, "Progressing").Reason)
			},
		},
		{
			name:       "a removal already counted is not counted again (its pod still shows)",
			in:         with(four(v1alpha1.ScaleInExplicit, nil, marked), func(i *Input) { i.Replicas, i.Removing = 3, []types.UID{"uid-p2"} }),
			wantDelete: []string{"p2:Removed"},
			check: func(t *testing.T, a Actions) {
				assert.Nil(t, a.Set, "nothing to write: replicas stay 3")
				assert.Equal(t, int32(3), a.Status.Desired)
			},
		},
		{
			name:       "a counted removal stays counted when the mark is gone (pod being deleted by the controller)",
			in:         with(four(v1alpha1.ScaleInOldest), func(i *Input) { i.Replicas, i.Removing = 3, []types.UID{"uid-p2"} }),
			wantDelete: []string{"p2:Removed"},
			check:      func(t *testing.T, a Actions) { assert.Nil(t, a.Set) },
		},
		{
			name:    "the bookkeeping forgets pods that are gone or terminating",
			in:      with(base(1, 0, pod("a", time.Minute), pod("t", time.Minute, term, marked)), func(i *Input) { i.Removing = []types.UID{"uid-gone", "uid-t"} }),
			wantSet: &SetPatch{},
		},
		{
			name: "a leased marked pod waits for its release: not counted, not deleted",
			in:   with(four(v1alpha1.ScaleInExplicit, leased, nil), func(i *Input) { i.Replicas = 4; i.Pods[0].RemoveRequested = true }),
			check: func(t *testing.T, a Actions) {
				assert.Nil(t, a.Set)
				assert.Equal(t, int32(4), a.Status.Desired)
				c := cond(a, "Progressing")
				assert.Equal(t, "RemovalWaitsForRelease", c.Reason)
			},
		},
		{
			name: "a released marked pod (Replace) goes as a removal, not a recycle",
			in: with(base(2, 0, pod("r", time.Minute, used, marked), pod("a", time.Minute)), func(i *Input) {
				i.ScaleIn = v1alpha1.ScaleInExplicit
			}),
			wantDelete: []string{"r:Removed"},
			wantSet:    &SetPatch{Replicas: ptr.To[int32](1), Removing: []types.UID{"uid-r"}, Counted: []string{"r"}},
		},
		{
			name:       "addressed removal under Newest: the named pod goes, not the newest, and no replacement",
			in:         with(four(v1alpha1.ScaleInNewest, marked), func(i *Input) { i.Replicas = 4 }),
			wantDelete: []string{"p1:Removed"},
			wantSet:    &SetPatch{Replicas: ptr.To[int32](3), Removing: []types.UID{"uid-p1"}, Counted: []string{"p1"}},
		},
		{
			name:       "addressed removal under Oldest of two pods at once",
			in:         with(four(v1alpha1.ScaleInOldest, nil, nil, marked, marked), func(i *Input) { i.Replicas = 4 }),
			wantDelete: []string{"p3:Removed", "p4:Removed"},
			wantSet:    &SetPatch{Replicas: ptr.To[int32](2), Removing: []types.UID{"uid-p3", "uid-p4"}, Counted: []string{"p3", "p4"}},
		},
		{
			name: "replicas never drop below zero; the buffer (minAvailable) refills",
			in: with(base(0, 1, pod("a", time.Minute, marked)), func(i *Input) {
				i.ScaleIn = v1alpha1.ScaleInExplicit
			}),
			wantCreate: 1, wantDelete: []string{"a:Removed"},
			wantSet: &SetPatch{Replicas: ptr.To[int32](0), Removing: []types.UID{"uid-a"}, Counted: []string{"a"}},
		},
		{
			name:       "a marked failed pod goes as a removal and is no failure",
			in:         with(base(2, 0, pod("f", time.Minute, failed("Error"), marked), pod("a", time.Minute)), func(i *Input) {}),
			wantDelete: []string{"f:Removed"},
			wantSet:    &SetPatch{Replicas: ptr.To[int32](1), Removing: []types.UID{"uid-f"}, Counted: []string{"f"}},
			check:      func(t *testing.T, a Actions) { assert.Zero(t, a.Status.ConsecutiveFailures) },
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Plan(tc.in)
			assert.Equal(t, tc.wantCreate, a.Create, "create")
			assert.Equal(t, tc.wantDelete, deletions(a), "delete")
			if tc.wantSet != nil {
				require.NotNil(t, a.Set)
				assert.Equal(t, tc.wantSet.Replicas, a.Set.Replicas, "replicas")
				assert.Equal(t, tc.wantSet.Removing, a.Set.Removing, "removing")
				assert.Equal(t, tc.wantSet.Counted, a.Set.Counted, "counted")
			} else if tc.check == nil {
				assert.Nil(t, a.Set)
			}
			for _, d := range a.Delete {
				for _, p := range tc.in.Pods {
					if p.Name == d.Name {
						assert.False(t, p.Leased, "leased pod %s chosen", p.Name)
					}
				}
			}
			if tc.check != nil {
				tc.check(t, a)
			}
		})
	}
}

// TestPlanRemovalIdempotent replays a removal as the controller sees it:
// the plan counts it, the set patch lands (replicas lowered, UID recorded),
// the next plans (pod still there, then terminating, then gone) never count
// it again and never create a replacement.
func TestPlanRemovalIdempotent(t *testing.T) {
	in := with(base(3, 0, pod("a", 3*time.Minute), pod("b", 2*time.Minute, marked), pod("c", time.Minute)), func(i *Input) {
		i.ScaleIn = v1alpha1.ScaleInOldest
	})
	a := Plan(in)
	require.NotNil(t, a.Set)
	require.Equal(t, int32(2), *a.Set.Replicas)
	assert.Equal(t, []string{"b:Removed"}, deletions(a))
	// The patch landed; the delete too, but the cache still shows b.
	in.Replicas, in.Removing = *a.Set.Replicas, a.Set.Removing
	a = Plan(in)
	assert.Nil(t, a.Set)
	assert.Zero(t, a.Create)
	assert.Equal(t, []string{"b:Removed"}, deletions(a), "delete retried with its precondition")
	// b terminating: the bookkeeping drops it, nothing else changes.
	in.Pods[1].Terminating = true
	a = Plan(in)
	require.NotNil(t, a.Set)
	assert.Nil(t, a.Set.Replicas)
	assert.Empty(t, a.Set.Removing)
	assert.Zero(t, a.Create)
	assert.Empty(t, a.Delete)
	// b gone.
	in.Pods, in.Removing = in.Pods[:1:1], nil
	in.Pods = append(in.Pods, pod("c", time.Minute))
	a = Plan(in)
	assert.Nil(t, a.Set)
	assert.Zero(t, a.Create)
	assert.Empty(t, a.Delete)
	assert.Equal(t, int32(2), a.Status.Desired)
}

func TestPlanPaused(t *testing.T) {
	cases := []struct {
		name    string
		in      Input
		message string
	}{
		{"no creates", base(3, 0, pod("a", time.Minute)), "would create 2 and delete 0 pods"},
		{"no scale-down", with(base(1, 0, pod("a", 2*time.Minute), pod("b", time.Minute)), func(i *Input) { i.Cooldown = 0 }), "would create 0 and delete 1 pods"},
		{"no recycling", base(1, 0, pod("r", time.Minute, used)), "would create 1 and delete 1 pods"},
		{"no rollout", base(1, 0, pod("o", time.Minute, old, notReady)), "would create 1 and delete 1 pods"},
		{"no removal, no replicas change", with(base(2, 0, pod("a", time.Minute, marked), pod("b", time.Minute)), func(i *Input) {}),
			"would create 0 and delete 0 pods; 1 pods marked qemu-kubelet.io/remove=true wait"},
		{"no autohealing", with(base(1, 0, pod("c", time.Hour, crashLoop(5, time.Hour))), func(i *Input) {
			i.Autohealing = &Autohealing{StartUpFailureThreshold: 3}
		}), "would create 0 and delete 0 pods"},
		{"no exporter changes", with(base(0, 0, pod("a", time.Minute)), func(i *Input) {
			i.Cooldown, i.Jumpstarter = 0, &JumpstarterInput{DrainDelay: time.Second}
			i.Pods[0].Exporter = ExporterState{Found: true, Enabled: true}
		}), "would create 0 and delete 0 pods and change 1 exporters"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			tc.in.Paused = true
			a := Plan(tc.in)
			assert.Zero(t, a.Create)
			assert.Empty(t, a.Delete)
			assert.Empty(t, a.Disable)
			assert.Empty(t, a.Enable)
			assert.Equal(t, ColdKeep, a.Cold)
			assert.Nil(t, a.Set)
			c := cond(a, "Progressing")
			assert.Equal(t, metav1.ConditionUnknown, c.Status)
			assert.Equal(t, "Paused", c.Reason)
			assert.Contains(t, c.Message, tc.message)
			// Unpaused, the same input acts.
			tc.in.Paused = false
			u := Plan(tc.in)
			assert.True(t, u.Create > 0 || len(u.Delete) > 0 || len(u.Disable) > 0, "unpaused plan acts: %+v", u)
		})
	}
	// Failed pods left while paused are not counted again and again.
	in := with(base(1, 0, pod("f", time.Minute, failed("Error"))), func(i *Input) { i.Paused, i.ConsecutiveFailures = true, 1 })
	a := Plan(in)
	assert.Equal(t, int32(1), a.Status.ConsecutiveFailures)
	// Used marks are still kept: a pod leased while paused is retired later.
	a = Plan(with(base(1, 0, pod("l", time.Minute, func(p *PodState) { p.Leased = true })), func(i *Input) { i.Paused = true }))
	assert.Len(t, a.MarkUsed, 1)
}

func TestPlanAutohealing(t *testing.T) {
	heal := func(threshold int32, d time.Duration) func(*Input) {
		return func(i *Input) {
			i.Autohealing = &Autohealing{StartUpFailureThreshold: threshold, MinFailingToStartDuration: d}
		}
	}
	cases := []struct {
		name        string
		in          Input
		wantCreate  int32
		wantDelete  []string
		wantRequeue time.Duration
	}{
		{"off: a crash-looping pod is left to its node", base(1, 0, pod("c", time.Hour, crashLoop(9, time.Hour))), 0, nil, 0},
		{"replaced once threshold and duration are reached", with(base(1, 0, pod("c", time.Hour, crashLoop(3, 5*time.Minute))), heal(3, 5*time.Minute)),
			1, []string{"c:FailingToStart"}, 0},
		{"below the restart threshold: kept", with(base(1, 0, pod("c", time.Hour, crashLoop(2, time.Hour))), heal(3, 0)), 0, nil, 0},
		{"not failing long enough: kept, looked at again when it may count", with(base(1, 0, pod("c", time.Hour, crashLoop(4, time.Minute))), heal(3, 5*time.Minute)),
			0, nil, 4 * time.Minute},
		{"never Ready: the duration runs from creation", with(base(1, 0, pod("c", 10*time.Minute, crashLoop(4, 0), func(p *PodState) { p.NotReadySince = time.Time{} })), heal(3, 5*time.Minute)),
			1, []string{"c:FailingToStart"}, 0},
		{"image pull errors are not healed (a new pod pulls the same image)", with(base(1, 0, pod("c", time.Hour, waiting("ImagePullBackOff"), func(p *PodState) { p.RestartCount = 9 })), heal(1, 0)),
			0, nil, 0},
		{"a leased pod is never replaced", with(base(0, 0, pod("c", time.Hour, crashLoop(9, time.Hour), leased)), heal(1, 0)), 0, nil, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Plan(tc.in)
			assert.Equal(t, tc.wantCreate, a.Create, "create")
			assert.Equal(t, tc.wantDelete, deletions(a), "delete")
			assert.Equal(t, tc.wantRequeue, a.RequeueAfter, "requeue")
		})
	}
	// A replacement counts as a failure: the third in a row reports
	// ReplicaFailure with the waiting reason, and the next create backs off.
	a := Plan(with(base(1, 0, pod("c", time.Hour, crashLoop(3, time.Hour))), func(i *Input) {
		heal(3, time.Minute)(i)
		i.ConsecutiveFailures, i.LastFailureTime = 2, ptr.To(t0.Add(-time.Second))
	}))
	assert.Equal(t, []string{"c:FailingToStart"}, deletions(a))
	assert.Zero(t, a.Create, "backing off")
	assert.Equal(t, int32(3), a.Status.ConsecutiveFailures)
	c := cond(a, "ReplicaFailure")
	assert.Equal(t, metav1.ConditionTrue, c.Status)
	assert.Equal(t, "CrashLoopBackOff", c.Reason)
	assert.Contains(t, c.Message, "pod c: restarted 3 times")
}

func TestPlanWaitForFirstConsumer(t *testing.T) {
	wffc := func(i *Input) { i.WaitForFirstConsumer = true }
	// replicas and minAvailable count as 0: pods for leases only.
	a := Plan(with(base(5, 2), wffc))
	assert.Zero(t, a.Create)
	assert.Equal(t, int32(0), a.Status.Desired)
	assert.Equal(t, metav1.ConditionTrue, cond(a, "Available").Status, "0 of 0 is available")

	a = Plan(with(base(5, 2), func(i *Input) { wffc(i); i.Demand = 3 }))
	assert.Equal(t, int32(3), a.Create, "one pod per pending lease")

	a = Plan(with(base(5, 2, pod("l", time.Minute, leased), pod("warm", time.Minute)), func(i *Input) { wffc(i); i.Cooldown = 0 }))
	assert.Equal(t, []string{"warm:ScaleDown"}, deletions(a), "no warm pod is kept")
	assert.Equal(t, int32(1), a.Status.Desired)

	a = Plan(with(base(5, 2), func(i *Input) { wffc(i); i.Demand = 3; i.MaxReplicas = ptr.To[int32](2) }))
	assert.Equal(t, int32(2), a.Create, "capped by maxReplicas")

	// Removals still lower the real spec.replicas.
	a = Plan(with(base(5, 0, pod("m", time.Minute, marked)), wffc))
	require.NotNil(t, a.Set)
	assert.Equal(t, int32(4), *a.Set.Replicas)
}
