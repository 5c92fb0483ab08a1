package controller

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

const drain = 2 * time.Second

// js makes an input a Jumpstarter-mode one with an enabled cold exporter.
func js(in Input) Input {
	in.Jumpstarter = &JumpstarterInput{DrainDelay: drain, Cold: ExporterState{Found: true, Enabled: true, ResourceVersion: "rv-cold"}}
	return in
}

// exp gives the pod an enabled Exporter.
func exp(p *PodState) {
	p.Exporter = ExporterState{Found: true, Enabled: true, ResourceVersion: "erv-" + p.Name}
}

// disabledFor gives the pod an Exporter this controller disabled d ago.
func disabledFor(d time.Duration) func(*PodState) {
	return func(p *PodState) {
		p.Exporter = ExporterState{Found: true, ResourceVersion: "erv-" + p.Name, DisabledAt: t0.Add(-d)}
	}
}

func gated(reason string) func(*PodState) {
	return func(p *PodState) { p.GateReason, p.Ready, p.Phase = reason, false, "Pending" }
}

func refs(rs []ExporterRef) []string {
	var out []string
	for _, r := range rs {
		out = append(out, r.Name)
	}
	return out
}

func TestPlanJumpstarter(t *testing.T) {
	cases := []struct {
		name        string
		in          Input
		wantCreate  int32
		wantDelete  []string
		wantDisable []string
		wantEnable  []string
		wantCold    ColdAction
		check       func(t *testing.T, a Actions)
	}{
		{
			name: "from zero: a pending lease makes one pod and the cold exporter is created",
			in: with(js(base(0, 0)), func(i *Input) {
				i.Demand = 1
				i.Jumpstarter.Cold = ExporterState{}
			}),
			wantCreate: 1, wantCold: ColdCreate,
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(1), a.Status.Desired)
				assert.Equal(t, int32(1), a.Status.PendingLeases)
				assert.Equal(t, "ScalingUp", cond(a, "Progressing").Reason)
			},
		},
		{
			name:     "no lease, no pod: only the cold exporter exists",
			in:       with(js(base(0, 0)), func(i *Input) { i.Jumpstarter.Cold = ExporterState{} }),
			wantCold: ColdCreate,
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(0), a.Status.Desired)
				assert.Equal(t, metav1.ConditionTrue, cond(a, v1alpha1.ConditionExportersReady).Status)
			},
		},
		{
			name:       "a burst of 10 pending leases makes 10 pods in one pass",
			in:         with(js(base(0, 0)), func(i *Input) { i.Demand = 10 }),
			wantCreate: 10,
		},
		{
			name:       "burst: pods created but not yet seen (expectations) are not created again",
			in:         with(js(base(0, 0, pod("a", time.Second, exp, gated("x")))), func(i *Input) { i.Demand = 10; i.PendingCreates = 9 }),
			wantCreate: 0,
		},
		{
			name:       "demand is capped by maxReplicas",
			in:         with(js(base(0, 0)), func(i *Input) { i.Demand = 10; i.MaxReplicas = ptr.To(int32(3)) }),
			wantCreate: 3,
		},
		{
			name: "a lease waiting while a warm pod is free: the warm pod takes it, a new one refills the buffer",
			in:   with(js(base(0, 1, pod("w", time.Minute, exp))), func(i *Input) { i.Demand = 1 }),
			// target = leased 0 + demand 1 + minAvailable 1 = 2: the same as after the lease lands (1 + 0 + 1)
			wantCreate: 1,
		},
		{
			name:       "leased and pending leases add up",
			in:         with(js(base(0, 0, pod("l", time.Minute, exp, leased))), func(i *Input) { i.Demand = 2 }),
			wantCreate: 2,
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(1), a.Status.Leased)
				assert.Equal(t, int32(3), a.Status.Desired)
			},
		},
		{
			name:       "demand within replicas creates nothing",
			in:         with(js(base(2, 0, pod("a", time.Minute, exp), pod("b", time.Minute, exp))), func(i *Input) { i.Demand = 2 }),
			wantCreate: 0,
		},
		{
			name:     "a disabled cold exporter is enabled again",
			in:       with(js(base(0, 0)), func(i *Input) { i.Jumpstarter.Cold.Enabled = false }),
			wantCold: ColdEnable,
		},
		{
			name:     "maxReplicas 0: no cold exporter (a lease is Unsatisfiable rather than waiting forever)",
			in:       with(js(base(0, 0)), func(i *Input) { i.MaxReplicas = ptr.To(int32(0)) }),
			wantCold: ColdDelete,
		},
		{
			name: "maxReplicas 0: a leased cold exporter is kept",
			in: with(js(base(0, 0)), func(i *Input) {
				i.MaxReplicas = ptr.To(int32(0))
				i.Jumpstarter.Cold.Leased = true
			}),
			wantCold: ColdKeep,
		},
		{
			name: "scale-down disables first, deletes nothing",
			in: with(js(base(1, 0, pod("old", time.Hour, exp), pod("new", time.Minute, exp))), func(i *Input) {
				i.Cooldown = 0
			}),
			wantDisable: []string{"new"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, "DrainingExporters", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "scale-down within the drain delay waits and requeues at its end",
			in: with(js(base(1, 0, pod("old", time.Hour, exp), pod("new", time.Minute, disabledFor(500*time.Millisecond)))), func(i *Input) {
				i.Cooldown = 0
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, 1500*time.Millisecond, a.RequeueAfter)
				assert.Equal(t, int32(1), a.Status.Available, "a disabled exporter is not available")
				assert.Equal(t, "DrainingExporters", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "scale-down after the drain delay deletes the disabled, unleased pod",
			in: with(js(base(1, 0, pod("old", time.Hour, exp), pod("new", time.Minute, disabledFor(drain)))), func(i *Input) {
				i.Cooldown = 0
			}),
			wantDelete: []string{"new:ScaleDown"},
		},
		{
			name: "a drained pod goes at once although a new cooldown would start (no re-enable flapping)",
			in:   js(base(1, 0, pod("old", time.Hour, exp), pod("new", time.Minute, disabledFor(time.Minute)))),
			// Cooldown 30s and no ScaleDownPendingSince: an undrained pod would wait.
			wantDelete: []string{"new:ScaleDown"},
		},
		{
			name: "scale-down prefers the pod already draining over a newer one",
			in: with(js(base(1, 0, pod("drainee", time.Hour, disabledFor(time.Second)), pod("newest", time.Second, exp))), func(i *Input) {
				i.Cooldown = 0
			}),
			check: func(t *testing.T, a Actions) {
				assert.Empty(t, a.Disable, "the newest pod is not disabled while another drains")
				assert.Empty(t, a.Enable)
			},
		},
		{
			name: "a lease that slipped in during the drain keeps the pod: not deleted, not enabled, not disabled",
			in: with(js(base(0, 0, pod("x", time.Minute, disabledFor(time.Minute), leased))), func(i *Input) {
				i.Cooldown = 0
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(1), a.Status.Leased)
				assert.Equal(t, int32(1), a.Status.Desired)
			},
		},
		{
			name: "demand came back during the drain: the exporter is enabled again",
			in: with(js(base(0, 0, pod("x", time.Minute, disabledFor(time.Second)))), func(i *Input) {
				i.Cooldown = 0
				i.Demand = 1
			}),
			wantEnable: []string{"x"},
		},
		{
			name:        "Replace: a released pod is disabled first and its replacement created at once",
			in:          js(base(1, 0, pod("r", time.Minute, exp, used))),
			wantCreate:  1,
			wantDisable: []string{"r"},
		},
		{
			name:       "Replace: a released, drained pod is deleted",
			in:         js(base(1, 0, pod("r", time.Minute, disabledFor(drain), used))),
			wantCreate: 1,
			wantDelete: []string{"r:Released"},
		},
		{
			name:       "a pod without an Exporter goes at once (nothing can be leased through it)",
			in:         js(base(1, 0, pod("f", time.Minute, failed("E")))),
			wantCreate: 1,
			wantDelete: []string{"f:Failed"},
		},
		{
			name:        "a failed pod's enabled Exporter is disabled first (it may look Online for a minute)",
			in:          js(base(0, 0, pod("f", time.Minute, exp, failed("E")))),
			wantDisable: []string{"f"},
		},
		{
			name: "an Exporter disabled by someone else (no disabled-at mark) is disabled again to start the drain",
			in: with(js(base(0, 0, pod("x", time.Minute, func(p *PodState) { p.Exporter = ExporterState{Found: true, ResourceVersion: "e"} }))), func(i *Input) {
				i.Cooldown = 0
			}),
			wantDisable: []string{"x"},
		},
		{
			name: "an outdated, Ready pod is disabled before it goes",
			in: with(js(base(1, 0, pod("o", time.Hour, exp, old), pod("n", time.Minute, exp))), func(i *Input) {
				i.Cooldown = 0
			}),
			wantDisable: []string{"o"},
		},
		{
			name: "gated pods are reported in ExportersReady",
			in:   js(base(2, 0, pod("b", time.Second, exp, gated("Exporter b has no status.credential yet")), pod("a", time.Second, gated("Exporter a not created yet")))),
			check: func(t *testing.T, a Actions) {
				c := cond(a, v1alpha1.ConditionExportersReady)
				assert.Equal(t, metav1.ConditionFalse, c.Status)
				assert.Equal(t, "WaitingForCredential", c.Reason)
				assert.Equal(t, "2 pods held by scheduling gate qemu-kubelet.io/jumpstarter-credential; pod a: Exporter a not created yet", c.Message)
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Plan(tc.in)
			assert.Equal(t, tc.wantCreate, a.Create, "create")
			assert.Equal(t, tc.wantDelete, deletions(a), "delete")
			assert.Equal(t, tc.wantDisable, refs(a.Disable), "disable")
			assert.Equal(t, tc.wantEnable, refs(a.Enable), "enable")
			assert.Equal(t, tc.wantCold, a.Cold, "cold exporter")
			for _, d := range a.Disable {
				assert.NotEmpty(t, d.ResourceVersion, "disable without resourceVersion precondition")
			}
			if tc.check != nil {
				tc.check(t, a)
			}
		})
	}
}

func TestPlanStandaloneHasNoExporterActions(t *testing.T) {
	a := Plan(with(base(0, 0, pod("r", time.Minute, used), pod("x", time.Minute)), func(i *Input) { i.Cooldown = 0; i.Demand = 0 }))
	assert.Equal(t, []string{"r:Released", "x:ScaleDown"}, deletions(a))
	assert.Empty(t, a.Disable)
	assert.Empty(t, a.Enable)
	assert.Equal(t, ColdKeep, a.Cold)
	assert.Empty(t, cond(a, v1alpha1.ConditionExportersReady).Type)
}

// TestPlanJumpstarterNeverLosesALease checks, over many random inputs, the
// rules that keep leases: a leased pod is never disabled, deleted or
// re-enabled behind its holder's back... and no pod goes while its Exporter
// is enabled or was disabled less than the drain delay ago.
func TestPlanJumpstarterNeverLosesALease(t *testing.T) {
	for seed := 0; seed < 3000; seed++ {
		r := seed
		next := func(n int) int { r = (r*1103515245 + 12345) & 0x7fffffff; return r % n }
		opts := []func(*PodState){notReady, pending, leased, used, old, term, failed("E"), exp,
			disabledFor(time.Duration(next(4)) * time.Second), gated("g")}
		var pods []PodState
		for i := 0; i < next(8); i++ {
			var o []func(*PodState)
			for _, f := range opts {
				if next(3) == 0 {
					o = append(o, f)
				}
			}
			pods = append(pods, pod(fmt.Sprintf("p%d", i), time.Duration(next(600))*time.Second, o...))
		}
		in := js(base(int32(next(5)), int32(next(3)), pods...))
		in.Demand = int32(next(4))
		if next(2) == 0 {
			in.Cooldown = 0
		}
		if next(2) == 0 {
			in.MaxReplicas = ptr.To(int32(next(6)))
		}
		if next(3) == 0 {
			in.Recycle = v1alpha1.RecyclePolicyReuse
		}
		a := Plan(in)
		byName := map[string]PodState{}
		for _, p := range pods {
			byName[p.Name] = p
		}
		for _, d := range a.Delete {
			p := byName[d.Name]
			if p.Leased {
				t.Fatalf("seed %d: leased pod %s deleted", seed, d.Name)
			}
			if e := p.Exporter; e.Found && (e.Enabled || e.DisabledAt.IsZero() || in.Now.Sub(e.DisabledAt) < drain) {
				t.Fatalf("seed %d: pod %s deleted with exporter %+v (not drained)", seed, d.Name, e)
			}
		}
		for _, d := range a.Disable {
			if byName[d.Name].Leased {
				t.Fatalf("seed %d: leased pod %s disabled", seed, d.Name)
			}
		}
		for _, e := range a.Enable {
			for _, d := range a.Disable {
				if d.Name == e.Name {
					t.Fatalf("seed %d: %s both enabled and disabled", seed, e.Name)
				}
			}
		}
	}
}
