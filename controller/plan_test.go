package controller

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

var t0 = time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)

const curHash = "cur"

// pod builds a running, Ready, unleased pod at the current template created
// age ago; opts adjust it.
func pod(name string, age time.Duration, opts ...func(*PodState)) PodState {
	p := PodState{Name: name, UID: types.UID("uid-" + name), ResourceVersion: "rv-" + name,
		Created: t0.Add(-age), Phase: corev1.PodRunning, Ready: true, TemplateHash: curHash}
	for _, o := range opts {
		o(&p)
	}
	return p
}

func notReady(p *PodState) { p.Ready = false }
func readySince(t time.Time) func(*PodState) {
	return func(p *PodState) { p.ReadySince = t }
}
func pending(p *PodState) { p.Ready = false; p.Phase = corev1.PodPending }
func leased(p *PodState)  { p.Leased = true; p.Used = true }
func used(p *PodState)    { p.Used = true }
func expiresAt(t time.Time) func(*PodState) {
	return func(p *PodState) { p.LeaseExpires = t }
}
func old(p *PodState)  { p.TemplateHash = "old" }
func term(p *PodState) { p.Terminating = true }
func failed(reason string) func(*PodState) {
	return func(p *PodState) {
		p.Phase, p.Ready, p.FailedReason, p.FailedMessage = corev1.PodFailed, false, reason, "qemu exited 1"
	}
}
func waiting(reason string) func(*PodState) {
	return func(p *PodState) {
		p.Phase, p.Ready, p.WaitingReason, p.WaitingMessage = corev1.PodPending, false, reason, "pull oci://x: not found"
	}
}

func base(replicas, minAvailable int32, pods ...PodState) Input {
	return Input{Replicas: replicas, MinAvailable: minAvailable, Recycle: v1alpha1.RecyclePolicyReplace,
		Cooldown: 30 * time.Second, TemplateHash: curHash, Pods: pods, Now: t0}
}

func with(in Input, f func(*Input)) Input { f(&in); return in }

func deletions(a Actions) []string {
	var out []string
	for _, d := range a.Delete {
		out = append(out, d.Name+":"+d.Reason)
	}
	return out
}

func cond(a Actions, typ string) Condition {
	for _, c := range a.Status.Conditions {
		if c.Type == typ {
			return c
		}
	}
	return Condition{}
}

func TestPlan(t *testing.T) {
	cases := []struct {
		name       string
		in         Input
		wantCreate int32
		wantDelete []string
		wantClear  []string
		check      func(t *testing.T, a Actions)
	}{
		{
			name: "scale up from zero creates every missing pod in one pass",
			in:   base(100, 0), wantCreate: 100,
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(100), a.Status.Desired)
				assert.Equal(t, "ScalingUp", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "pending creates (expectations) are never created again",
			in:   with(base(5, 0, pod("a", time.Minute), pod("b", time.Minute)), func(i *Input) { i.PendingCreates = 3 }),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, "ScalingUp", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "pending creates count against scale-down too",
			in: with(base(2, 0, pod("a", time.Minute), pod("b", 2*time.Minute)), func(i *Input) {
				i.PendingCreates = 1
				i.ScaleDownPendingSince = ptr.To(t0.Add(-time.Hour))
			}),
			wantDelete: []string{"a:ScaleDown"},
		},
		{
			name: "warm buffer: target is leased + minAvailable above replicas",
			in:   base(1, 2, pod("a", time.Minute, leased), pod("b", time.Minute)), wantCreate: 1,
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(3), a.Status.Desired)
				assert.Equal(t, int32(1), a.Status.Leased)
				assert.Equal(t, int32(1), a.Status.Available)
			},
		},
		{
			name: "replicas wins when above leased + minAvailable",
			in:   base(4, 1, pod("a", time.Minute, leased)), wantCreate: 3,
		},
		{
			name: "maxReplicas caps the target",
			in:   with(base(1, 5), func(i *Input) { i.MaxReplicas = ptr.To[int32](3) }), wantCreate: 3,
			check: func(t *testing.T, a Actions) { assert.Equal(t, int32(3), a.Status.Desired) },
		},
		{
			name: "lease demand from the source scales from zero",
			in:   with(base(0, 1), func(i *Input) { i.Demand = 2 }), wantCreate: 3,
		},
		{
			name: "scale-down waits for the cooldown and asks to be requeued",
			in:   base(1, 0, pod("a", 3*time.Minute), pod("b", 2*time.Minute), pod("c", time.Minute)),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, &t0, a.Status.ScaleDownPendingSince)
				assert.Equal(t, 30*time.Second, a.RequeueAfter)
				assert.Equal(t, "ScaleDownCooldown", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "scale-down within the cooldown keeps the first time and waits the rest",
			in: with(base(1, 0, pod("a", 3*time.Minute), pod("b", 2*time.Minute)), func(i *Input) {
				i.ScaleDownPendingSince = ptr.To(t0.Add(-20 * time.Second))
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, t0.Add(-20*time.Second), *a.Status.ScaleDownPendingSince)
				assert.Equal(t, 10*time.Second, a.RequeueAfter)
			},
		},
		{
			name: "scale-down after the cooldown removes not-ready first, then newest",
			in: with(base(1, 0,
				pod("oldest", 4*time.Minute), pod("older-notready", 3*time.Minute, notReady),
				pod("newer", 2*time.Minute), pod("newest", time.Minute)), func(i *Input) {
				i.ScaleDownPendingSince = ptr.To(t0.Add(-time.Minute))
			}),
			wantDelete: []string{"older-notready:ScaleDown", "newest:ScaleDown", "newer:ScaleDown"},
			check: func(t *testing.T, a Actions) {
				assert.Nil(t, a.Status.ScaleDownPendingSince)
				assert.Equal(t, "ScalingDown", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "scale-down ranks pending pods before running not-ready ones",
			in: with(base(1, 0, pod("keep", 4*time.Minute), pod("running-notready", time.Minute, notReady),
				pod("pending", 3*time.Minute, pending)), func(i *Input) { i.Cooldown = 0 }),
			wantDelete: []string{"pending:ScaleDown", "running-notready:ScaleDown"},
		},
		{
			name: "scale to zero never deletes leased pods",
			in: with(base(0, 0, pod("l1", time.Minute, leased), pod("l2", time.Minute, leased, notReady),
				pod("free", time.Minute)), func(i *Input) { i.Cooldown = 0 }),
			wantDelete: []string{"free:ScaleDown"},
			check:      func(t *testing.T, a Actions) { assert.Equal(t, int32(2), a.Status.Desired) },
		},
		{
			name: "scale to zero with minAvailable keeps the buffer next to the leased pod",
			in: with(base(0, 2, pod("l", 5*time.Minute, leased), pod("a", 4*time.Minute), pod("b", 3*time.Minute),
				pod("c", 2*time.Minute), pod("d", time.Minute)), func(i *Input) { i.Cooldown = 0 }),
			wantDelete: []string{"d:ScaleDown", "c:ScaleDown"},
		},
		{
			name: "maxReplicas below the leased count deletes no leased pod",
			in: with(base(0, 0, pod("l1", time.Minute, leased), pod("l2", time.Minute, leased)), func(i *Input) {
				i.MaxReplicas = ptr.To[int32](1)
				i.Cooldown = 0
			}),
		},
		{
			name: "Replace: a used, released pod is deleted at once and refilled",
			in:   base(1, 2, pod("released", time.Minute, used), pod("a", time.Minute), pod("l", time.Minute, leased)),
			// target = max(1, 1+2) = 3; live = a, l -> create 1
			wantCreate: 1, wantDelete: []string{"released:Released"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(2), a.Status.Replicas)
				assert.Equal(t, int32(3), a.Status.Desired)
			},
		},
		{
			name: "Replace: a used pod that is still leased stays",
			in:   base(0, 0, pod("l", time.Minute, leased)),
		},
		{
			name: "Replace: a leased pod without the used mark gets it",
			in:   base(1, 0, pod("l", time.Minute, func(p *PodState) { p.Leased = true })),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, []PodRef{{Name: "l", UID: "uid-l", ResourceVersion: "rv-l"}}, a.MarkUsed)
			},
		},
		{
			name: "Reuse: a leased pod is not marked",
			in: with(base(1, 0, pod("l", time.Minute, func(p *PodState) { p.Leased = true })), func(i *Input) {
				i.Recycle = v1alpha1.RecyclePolicyReuse
			}),
			check: func(t *testing.T, a Actions) { assert.Empty(t, a.MarkUsed) },
		},
		{
			name: "Reuse: a released pod gets its used mark cleared and stays",
			in: with(base(2, 0, pod("released", time.Minute, used), pod("a", time.Minute)), func(i *Input) {
				i.Recycle = v1alpha1.RecyclePolicyReuse
			}),
			wantClear: []string{"released"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(1), a.Status.Available, "a pod with the used mark is not claimable")
			},
		},
		{
			name: "terminating pods do not count",
			in:   base(2, 0, pod("a", time.Minute), pod("gone", time.Minute, term)), wantCreate: 1,
		},
		{
			name: "rollout: outdated not-ready pods go at once, ready ones wait for new ready pods",
			in:   base(2, 0, pod("o1", time.Minute, old), pod("o2", time.Minute, old, notReady)),
			// replacements surge: 2 created; o2 (not ready) deleted; o1 kept while nothing new is ready
			wantCreate: 2, wantDelete: []string{"o2:Outdated"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(0), a.Status.Updated)
			},
		},
		{
			name:       "rollout: outdated ready pods go once new pods are ready",
			in:         base(2, 0, pod("o1", 3*time.Minute, old), pod("o2", 2*time.Minute, old), pod("n1", time.Minute), pod("n2", time.Minute)),
			wantDelete: []string{"o2:Outdated", "o1:Outdated"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(2), a.Status.Updated)
				assert.Equal(t, "RollingOut", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "rollout: outdated leased pods stay until release and count as existing",
			in:   base(2, 0, pod("ol", time.Minute, old, leased), pod("n", time.Minute)),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, "RollingOut", cond(a, "Progressing").Reason)
				assert.Equal(t, int32(1), a.Status.Updated)
			},
		},
		{
			name: "rollout: released outdated pod under Replace is deleted as released",
			in:   base(1, 0, pod("ou", time.Minute, old, used)), wantCreate: 1, wantDelete: []string{"ou:Released"},
		},
		{
			name: "rollout at maxReplicas replaces one ready pod at a time",
			in: with(base(2, 0, pod("o1", 2*time.Minute, old), pod("o2", time.Minute, old)), func(i *Input) {
				i.MaxReplicas = ptr.To[int32](2)
			}),
			wantDelete: []string{"o2:Outdated"},
		},
		{
			name:       "a failed pod is deleted and replaced at once",
			in:         base(2, 0, pod("a", time.Minute), pod("f", time.Minute, failed("Error"))),
			wantCreate: 1, wantDelete: []string{"f:Failed"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(1), a.Status.ConsecutiveFailures)
				assert.Equal(t, t0, *a.Status.LastFailureTime)
				assert.Equal(t, metav1.ConditionFalse, cond(a, "ReplicaFailure").Status)
			},
		},
		{
			name: "repeated failures back off instead of a hot loop",
			in: with(base(1, 0, pod("f", time.Second, failed("Error"))), func(i *Input) {
				i.ConsecutiveFailures = 1
				i.LastFailureTime = ptr.To(t0.Add(-2 * time.Second))
			}),
			wantDelete: []string{"f:Failed"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(2), a.Status.ConsecutiveFailures)
				assert.Equal(t, failureBackoffBase, a.RequeueAfter)
				assert.Equal(t, "FailureBackoff", cond(a, "Progressing").Reason)
			},
		},
		{
			name: "backoff doubles and ends: create resumes after the wait",
			in: with(base(1, 0), func(i *Input) {
				i.ConsecutiveFailures = 3
				i.LastFailureTime = ptr.To(t0.Add(-2 * failureBackoffBase))
			}),
			wantCreate: 1,
		},
		{
			name: "backoff is capped",
			in: with(base(1, 0), func(i *Input) {
				i.ConsecutiveFailures = 40
				i.LastFailureTime = ptr.To(t0.Add(-time.Minute))
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, failureBackoffMax-time.Minute, a.RequeueAfter)
			},
		},
		{
			name: "repeated failures surface ReplicaFailure with the pod's reason",
			in: with(base(1, 0, pod("f", time.Second, failed("QEMUExited"))), func(i *Input) {
				i.ConsecutiveFailures = 2
				i.LastFailureTime = ptr.To(t0.Add(-time.Hour))
			}),
			wantDelete: []string{"f:Failed"},
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, 2*failureBackoffBase, a.RequeueAfter, "third failure waits twice the base")
				c := cond(a, "ReplicaFailure")
				assert.Equal(t, metav1.ConditionTrue, c.Status)
				assert.Equal(t, "QEMUExited", c.Reason)
				assert.Contains(t, c.Message, "pod f: qemu exited 1")
			},
		},
		{
			name: "repeated failures keep the last failed pod's reason once it is gone",
			in: with(base(1, 0), func(i *Input) {
				i.ConsecutiveFailures = 4
				i.LastFailureTime = ptr.To(t0.Add(-time.Second))
				i.LastFailure = &Condition{"ReplicaFailure", metav1.ConditionTrue, "GuestPanicked", "4 pods failed in a row; last: pod f: guest panicked"}
			}),
			check: func(t *testing.T, a Actions) {
				c := cond(a, "ReplicaFailure")
				assert.Equal(t, metav1.ConditionTrue, c.Status)
				assert.Equal(t, "GuestPanicked", c.Reason)
				assert.Equal(t, "4 pods failed in a row; last: pod f: guest panicked", c.Message)
			},
		},
		{
			name: "a previous image pull ReplicaFailure is not taken for repeated failures",
			in: with(base(1, 0), func(i *Input) {
				i.ConsecutiveFailures = 3
				i.LastFailureTime = ptr.To(t0.Add(-time.Second))
				i.LastFailure = &Condition{"ReplicaFailure", metav1.ConditionTrue, "ImagePullBackOff", "1 pods cannot start; pod p: not found"}
			}),
			check: func(t *testing.T, a Actions) {
				c := cond(a, "ReplicaFailure")
				assert.Equal(t, "PodFailed", c.Reason)
				assert.Equal(t, "3 pods failed in a row", c.Message)
			},
		},
		{
			name: "a pod Ready after the last failure resets the failure count",
			in: with(base(1, 0, pod("a", 0)), func(i *Input) {
				i.ConsecutiveFailures = 5
				i.LastFailureTime = ptr.To(t0.Add(-time.Minute))
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(0), a.Status.ConsecutiveFailures)
				assert.Equal(t, metav1.ConditionFalse, cond(a, "ReplicaFailure").Status)
			},
		},
		{
			name: "a pod Ready only briefly does not reset the failure count (a VM Ready while QEMU runs, crashing after boot)",
			in: with(base(1, 0, pod("a", 3*time.Second, readySince(t0.Add(-3*time.Second)))), func(i *Input) {
				i.ConsecutiveFailures = 5
				i.LastFailureTime = ptr.To(t0.Add(-time.Minute))
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(5), a.Status.ConsecutiveFailures)
				assert.Equal(t, metav1.ConditionTrue, cond(a, "ReplicaFailure").Status)
				assert.Equal(t, stableReady-3*time.Second, a.RequeueAfter, "looks again when the pod may count as started")
			},
		},
		{
			name: "a pod Ready for stableReady after the last failure resets the failure count",
			in: with(base(1, 0, pod("a", time.Minute, readySince(t0.Add(-stableReady)))), func(i *Input) {
				i.ConsecutiveFailures = 5
				i.LastFailureTime = ptr.To(t0.Add(-2 * time.Minute))
			}),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, int32(0), a.Status.ConsecutiveFailures)
				assert.Equal(t, metav1.ConditionFalse, cond(a, "ReplicaFailure").Status)
			},
		},
		{
			name: "image pull errors surface as ReplicaFailure and cause no churn",
			in:   base(2, 0, pod("p1", time.Minute, waiting("ImagePullBackOff")), pod("p2", time.Minute, waiting("ErrImagePull"))),
			check: func(t *testing.T, a Actions) {
				c := cond(a, "ReplicaFailure")
				assert.Equal(t, metav1.ConditionTrue, c.Status)
				assert.Equal(t, "ImagePullBackOff", c.Reason)
				assert.Contains(t, c.Message, "2 pods cannot start; pod p1: pull oci://x: not found")
				assert.Equal(t, metav1.ConditionFalse, cond(a, "Available").Status)
			},
		},
		{
			name: "a leased pod that failed is kept for its holder",
			in:   base(0, 0, pod("lf", time.Minute, leased, failed("Error"))),
		},
		{
			name: "status counts and Available condition",
			in: base(2, 1, pod("l", time.Minute, leased), pod("a", time.Minute), pod("n", time.Minute, notReady),
				pod("o", time.Minute, old, leased)),
			// leased 2 -> target max(2, 2+1) = 3; have = 3 (l, a, n updated + o old leased) -> 4 > 3 scale-down waits
			check: func(t *testing.T, a Actions) {
				s := a.Status
				assert.Equal(t, Status{Replicas: 4, Desired: 3, Ready: 3, Available: 1, Leased: 2, Updated: 3,
					ScaleDownPendingSince: &t0}, Status{s.Replicas, s.Desired, s.Ready, s.Available, s.Leased, s.Updated, 0,
					s.ScaleDownPendingSince, 0, nil, nil})
				assert.Equal(t, metav1.ConditionTrue, cond(a, "Available").Status)
			},
		},
		{
			name: "Available is False while the warm buffer is short",
			in:   base(1, 2, pod("l", time.Minute, leased), pod("a", time.Minute), pod("b", time.Minute, notReady)),
			check: func(t *testing.T, a Actions) {
				c := cond(a, "Available")
				assert.Equal(t, metav1.ConditionFalse, c.Status)
				assert.Equal(t, "2/3 pods ready, 1/2 available", c.Message)
			},
		},
		{
			name: "converged set reports Progressing False",
			in:   base(2, 0, pod("a", time.Minute), pod("b", time.Minute)),
			check: func(t *testing.T, a Actions) {
				assert.Equal(t, metav1.ConditionFalse, cond(a, "Progressing").Status)
				assert.Equal(t, metav1.ConditionTrue, cond(a, "Available").Status)
				assert.Zero(t, a.RequeueAfter)
			},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a := Plan(tc.in)
			assert.Equal(t, tc.wantCreate, a.Create, "create")
			assert.Equal(t, tc.wantDelete, deletions(a), "delete")
			var clear []string
			for _, c := range a.ClearUsed {
				clear = append(clear, c.Name)
			}
			assert.Equal(t, tc.wantClear, clear, "clear used")
			for _, d := range a.Delete {
				assert.NotEmpty(t, d.UID, "deletion without UID precondition")
				assert.NotEmpty(t, d.ResourceVersion, "deletion without resourceVersion precondition")
			}
			if tc.check != nil {
				tc.check(t, a)
			}
		})
	}
}

// TestPlanNeverDeletesLeased checks the leased-pod rule over many random
// inputs, whatever the other rules decide.
func TestPlanNeverDeletesLeased(t *testing.T) {
	opts := []func(*PodState){notReady, pending, leased, used, old, term, failed("E"), waiting("ErrImagePull"),
		expiresAt(t0.Add(time.Minute))}
	for seed := 0; seed < 2000; seed++ {
		r := seed
		next := func(n int) int { r = (r*1103515245 + 12345) & 0x7fffffff; return r % n }
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
		in := base(int32(next(5)), int32(next(3)), pods...)
		in.Cooldown = 0
		if next(2) == 0 {
			in.MaxReplicas = ptr.To(int32(next(6)))
		}
		if next(2) == 0 {
			in.Recycle = v1alpha1.RecyclePolicyReuse
		}
		a := Plan(in)
		leasedNames := map[string]bool{}
		for _, p := range pods {
			if p.Leased { // a lease expiring in a minute holds now
				leasedNames[p.Name] = true
			}
		}
		if next(4) == 0 { // the same input once every lease expired
			in2 := in
			in2.Now = t0.Add(time.Hour)
			for _, d := range Plan(in2).Delete {
				for _, p := range pods {
					if p.Name == d.Name && p.Leased && p.LeaseExpires.IsZero() {
						t.Fatalf("seed %d: leased pod %s without expiry deleted (%s)", seed, d.Name, d.Reason)
					}
				}
			}
		}
		seen := map[string]bool{}
		for _, d := range a.Delete {
			if leasedNames[d.Name] {
				t.Fatalf("seed %d: leased pod %s deleted (%s); input %+v", seed, d.Name, d.Reason, in)
			}
			if seen[d.Name] {
				t.Fatalf("seed %d: pod %s deleted twice", seed, d.Name)
			}
			seen[d.Name] = true
		}
		if in.MaxReplicas != nil {
			var live int32
			for _, p := range pods {
				if !p.Terminating && p.Phase != corev1.PodFailed && p.Phase != corev1.PodSucceeded {
					live++
				}
			}
			if live < *in.MaxReplicas && live+a.Create > *in.MaxReplicas {
				t.Fatalf("seed %d: %d live + %d created exceeds maxReplicas %d", seed, live, a.Create, *in.MaxReplicas)
			}
		}
	}
}

// TestPlanLeaseExpiry: a lease with an expiry holds until then (the plan
// asks to be made again at the expiry) and counts as released from then
// on: Replace deletes the pod (LeaseExpired) and a fresh one refills the
// buffer; Reuse removes the lease label first and clears the used mark on
// the next plan, keeping the pod.
func TestPlanLeaseExpiry(t *testing.T) {
	exp := t0.Add(20 * time.Second)
	t.Run("holds until the expiry and requeues then", func(t *testing.T) {
		in := base(1, 1, pod("l", time.Minute, leased, expiresAt(exp)), pod("a", time.Minute))
		a := Plan(in)
		assert.Empty(t, a.Delete)
		assert.Empty(t, a.ExpireLease)
		assert.Equal(t, int32(1), a.Status.Leased)
		assert.Equal(t, int32(2), a.Status.Desired, "target = leased + minAvailable")
		assert.Equal(t, 20*time.Second, a.RequeueAfter, "look again at the expiry")
		// The earliest of several expiries, and the cooldown if sooner.
		in.Pods = append(in.Pods, pod("m", time.Minute, leased, expiresAt(t0.Add(5*time.Second))))
		assert.Equal(t, 5*time.Second, Plan(in).RequeueAfter)
	})
	t.Run("Replace deletes the pod at the expiry", func(t *testing.T) {
		for _, now := range []time.Time{exp, exp.Add(time.Hour)} {
			in := with(base(1, 1, pod("l", time.Minute, leased, expiresAt(exp)), pod("a", time.Minute)), func(in *Input) { in.Now = now })
			a := Plan(in)
			assert.Equal(t, []string{"l:" + ReasonLeaseExpired}, deletions(a), "at %s", now)
			assert.Empty(t, a.ExpireLease)
			assert.Equal(t, int32(0), a.Status.Leased)
			assert.Equal(t, int32(1), a.Status.Desired)
			assert.Equal(t, int32(1), a.Status.Available)
			assert.Equal(t, "Recycling", cond(a, "Progressing").Reason)
			assert.Zero(t, a.RequeueAfter)
		}
	})
	t.Run("Replace refills the buffer", func(t *testing.T) {
		// minAvailable 1 with the only free pod leased until now: the
		// expired pod goes and a new one is created.
		a := Plan(with(base(0, 1, pod("l", time.Minute, leased, expiresAt(exp))), func(in *Input) { in.Now = exp }))
		assert.Equal(t, []string{"l:" + ReasonLeaseExpired}, deletions(a))
		assert.Equal(t, int32(1), a.Create)
	})
	t.Run("Reuse removes the lease label, then the used mark", func(t *testing.T) {
		in := with(base(1, 1, pod("l", time.Minute, leased, expiresAt(exp)), pod("a", time.Minute)), func(in *Input) {
			in.Recycle, in.Now = v1alpha1.RecyclePolicyReuse, exp.Add(time.Second)
		})
		a := Plan(in)
		assert.Empty(t, a.Delete)
		assert.Equal(t, []PodRef{{Name: "l", UID: "uid-l", ResourceVersion: "rv-l"}}, a.ExpireLease)
		assert.Empty(t, a.ClearUsed, "the used mark goes after the lease label, as for any release")
		assert.Equal(t, int32(0), a.Status.Leased)
		assert.Equal(t, int32(1), a.Status.Available, "the expired pod is not free until its used mark is cleared")
		assert.Zero(t, a.Create, "target max(1, 0+1) = 1 with 2 pods")
		// Next plan: the label is gone (executor), the used mark stays.
		in.Pods[0] = pod("l", time.Minute, used)
		a = Plan(in)
		assert.Empty(t, a.ExpireLease)
		assert.Equal(t, []PodRef{{Name: "l", UID: "uid-l", ResourceVersion: "rv-l"}}, a.ClearUsed)
	})
	t.Run("a failed leased pod is kept until its lease expires", func(t *testing.T) {
		in := base(0, 0, pod("l", time.Minute, leased, failed("GuestPanicked"), expiresAt(exp)))
		assert.Empty(t, Plan(in).Delete)
		in.Now = exp
		assert.Equal(t, []string{"l:" + ReasonFailed}, deletions(Plan(in)))
	})
	t.Run("a pod marked for removal goes when its lease expires, counted once", func(t *testing.T) {
		in := with(base(2, 0, pod("r", time.Minute, leased, func(p *PodState) { p.RemoveRequested = true }, expiresAt(exp)), pod("a", time.Minute)), func(in *Input) {
			in.ScaleIn = v1alpha1.ScaleInExplicit
		})
		a := Plan(in)
		assert.Empty(t, a.Delete, "leased until the expiry")
		assert.Nil(t, a.Set)
		in.Now = exp
		a = Plan(in)
		assert.Equal(t, []string{"r:" + ReasonRemoved}, deletions(a))
		if assert.NotNil(t, a.Set) {
			assert.Equal(t, int32(1), *a.Set.Replicas)
		}
		assert.Zero(t, a.Create)
	})
	t.Run("no expiry: the lease holds forever", func(t *testing.T) {
		a := Plan(with(base(1, 0, pod("l", time.Minute, leased)), func(in *Input) { in.Now = t0.Add(1000 * time.Hour) }))
		assert.Empty(t, a.Delete)
		assert.Equal(t, int32(1), a.Status.Leased)
		assert.Zero(t, a.RequeueAfter)
	})
	t.Run("the input is not modified", func(t *testing.T) {
		in := with(base(1, 0, pod("l", time.Minute, leased, expiresAt(exp))), func(in *Input) { in.Now = exp })
		Plan(in)
		assert.True(t, in.Pods[0].Leased, "Plan is pure")
	})
}

// TestLabelLeasesExpiry: the label source reads the expiry annotation of
// leased pods; a malformed one is reported and the lease does not expire.
func TestLabelLeasesExpiry(t *testing.T) {
	mk := func(name string, labels, ann map[string]string) corev1.Pod {
		return corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: labels, Annotations: ann}}
	}
	leasedBy := map[string]string{v1alpha1.LeaseLabel: "ci", v1alpha1.UsedLabel: "true"}
	pods := []corev1.Pod{
		mk("ok", leasedBy, map[string]string{v1alpha1.LeaseExpiresAnnotation: "2026-01-01T12:00:20Z"}),
		mk("bad", leasedBy, map[string]string{v1alpha1.LeaseExpiresAnnotation: "in 20 minutes"}),
		mk("stale", map[string]string{v1alpha1.UsedLabel: "true"}, map[string]string{v1alpha1.LeaseExpiresAnnotation: "garbage"}),
		mk("none", leasedBy, nil),
	}
	l, _, err := LabelLeases{}.Leases(t.Context(), nil, pods)
	assert.NoError(t, err)
	assert.Equal(t, t0.Add(20*time.Second), l["ok"].Expires.UTC())
	assert.NoError(t, l["ok"].ExpiryErr)
	assert.True(t, l["bad"].Expires.IsZero())
	if assert.Error(t, l["bad"].ExpiryErr) {
		assert.Contains(t, l["bad"].ExpiryErr.Error(), `"in 20 minutes" is not an RFC 3339 time`)
	}
	assert.NoError(t, l["stale"].ExpiryErr, "an unleased pod's annotation is ignored")
	assert.True(t, l["none"].Leased)
	assert.True(t, l["none"].Expires.IsZero())
}
