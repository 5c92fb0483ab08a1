package controller

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/event"
	"sigs.k8s.io/controller-runtime/pkg/handler"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func TestExpectations(t *testing.T) {
	key := types.NamespacedName{Namespace: "ns", Name: "set"}
	cached := func(names ...string) []corev1.Pod {
		var out []corev1.Pod
		for _, n := range names {
			out = append(out, corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: n, UID: types.UID("uid-" + n)}})
		}
		return out
	}
	// owned is pod n of the set, as its informer events carry it.
	owned := func(n string) *corev1.Pod {
		p := &cached(n)[0]
		p.Namespace = key.Namespace
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "ExporterSet", Name: key.Name, Controller: ptr.To(true)}}
		return p
	}
	terminating := func(ps []corev1.Pod) []corev1.Pod {
		for i := range ps {
			ps[i].DeletionTimestamp = &metav1.Time{Time: t0}
		}
		return ps
	}
	// events is the reconciler's pod event handler over e.
	events := func(e *expectations) podEvents {
		return podEvents{exp: e, inner: handler.Funcs{}, owner: v1alpha1.GroupVersion.String()}
	}
	ctx := context.Background()
	cases := []struct {
		name         string
		setup        func(e *expectations)
		cache        []corev1.Pod
		at           time.Time
		wantCreates  []string
		wantDeleting []types.UID
	}{
		{name: "nothing expected", cache: cached("a"), at: t0},
		{name: "created pods missing from the cache are pending",
			setup: func(e *expectations) { e.ExpectCreate(key, "a", t0); e.ExpectCreate(key, "b", t0) },
			cache: cached("a"), at: t0, wantCreates: []string{"b"}},
		{name: "a created pod the list shows is settled",
			setup: func(e *expectations) { e.ExpectCreate(key, "a", t0) },
			cache: cached("a"), at: t0},
		// The list is read before the expectations are settled: an add
		// event that lands between the two must not settle the create, or
		// the pod is neither listed nor pending and is created again.
		{name: "an add event after the list was read leaves the create pending for that list",
			setup: func(e *expectations) {
				e.ExpectCreate(key, "a", t0)
				events(e).Create(ctx, event.CreateEvent{Object: owned("a")}, nil)
			},
			at: t0, wantCreates: []string{"a"}},
		{name: "an update event after the list was read leaves the create pending for that list",
			setup: func(e *expectations) {
				e.ExpectCreate(key, "a", t0)
				events(e).Update(ctx, event.UpdateEvent{ObjectOld: owned("a"), ObjectNew: owned("a")}, nil)
			},
			at: t0, wantCreates: []string{"a"}},
		{name: "a pod deleted before a list showed it is settled by its delete event",
			setup: func(e *expectations) {
				e.ExpectCreate(key, "a", t0)
				events(e).Delete(ctx, event.DeleteEvent{Object: owned("a")}, nil)
			},
			at: t0},
		{name: "a delete event of another set's pod settles nothing",
			setup: func(e *expectations) {
				e.ExpectCreate(key, "a", t0)
				p := owned("a")
				p.OwnerReferences[0].Name = "other"
				events(e).Delete(ctx, event.DeleteEvent{Object: p}, nil)
			},
			at: t0, wantCreates: []string{"a"}},
		{name: "an unobserved create expires after the TTL",
			setup: func(e *expectations) { e.ExpectCreate(key, "a", t0) },
			at:    t0.Add(expectationTTL + time.Second)},
		{name: "deleted pods the cache still shows live are hidden",
			setup: func(e *expectations) { e.ExpectDelete(key, "uid-a", t0); e.ExpectDelete(key, "uid-b", t0) },
			cache: cached("a"), at: t0, wantDeleting: []types.UID{"uid-a"}},
		{name: "a delete event after the list was read keeps the listed pod hidden",
			setup: func(e *expectations) {
				e.ExpectDelete(key, "uid-a", t0)
				events(e).Delete(ctx, event.DeleteEvent{Object: owned("a")}, nil)
			},
			cache: cached("a"), at: t0, wantDeleting: []types.UID{"uid-a"}},
		{name: "a deleted pod the list shows terminating is settled",
			setup: func(e *expectations) { e.ExpectDelete(key, "uid-a", t0) },
			cache: terminating(cached("a")), at: t0},
		{name: "expectations of another set do not count",
			setup: func(e *expectations) { e.ExpectCreate(types.NamespacedName{Namespace: "ns", Name: "other"}, "x", t0) },
			at:    t0},
		{name: "forget drops a deleted set",
			setup: func(e *expectations) { e.ExpectCreate(key, "a", t0); e.Forget(key) },
			at:    t0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newExpectations()
			if tc.setup != nil {
				tc.setup(e)
			}
			creates, deleting := e.Pending(key, tc.cache, tc.at)
			assert.Equal(t, tc.wantCreates, creates)
			var got []types.UID
			for uid := range deleting {
				got = append(got, uid)
			}
			assert.ElementsMatch(t, tc.wantDeleting, got)
		})
	}
}

func TestPodState(t *testing.T) {
	now := metav1.NewTime(t0)
	cases := []struct {
		name string
		pod  corev1.Pod
		want PodState
	}{
		{
			name: "ready running pod with hash",
			pod: corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p", UID: "u", ResourceVersion: "7", CreationTimestamp: now,
					Labels: map[string]string{v1alpha1.TemplateHashLabel: "h"}},
				Status: corev1.PodStatus{Phase: corev1.PodRunning,
					Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
			},
			want: PodState{Name: "p", UID: "u", ResourceVersion: "7", Created: t0, Phase: corev1.PodRunning, Ready: true, TemplateHash: "h"},
		},
		{
			name: "ready since the Ready condition's transition",
			pod: corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p"},
				Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{
					{Type: corev1.ContainersReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.NewTime(t0.Add(-time.Hour))},
					{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.NewTime(t0.Add(-time.Minute))}}},
			},
			want: PodState{Name: "p", Phase: corev1.PodRunning, Ready: true, ReadySince: t0.Add(-time.Minute)},
		},
		{
			name: "image pull back-off is a waiting reason",
			pod: corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p"},
				Status: corev1.PodStatus{Phase: corev1.PodPending, ContainerStatuses: []corev1.ContainerStatus{{Name: "vm",
					State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ImagePullBackOff", Message: "not found"}}}}},
			},
			want: PodState{Name: "p", Phase: corev1.PodPending, WaitingReason: "ImagePullBackOff", WaitingMessage: "not found"},
		},
		{
			name: "failed pod: the pod reason wins over the container's",
			pod: corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p", DeletionTimestamp: &now},
				Status: corev1.PodStatus{Phase: corev1.PodFailed, Reason: "QEMUExited", Message: "exit 1",
					ContainerStatuses: []corev1.ContainerStatus{{Name: "vm",
						State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 1, Reason: "Error"}}}}},
			},
			want: PodState{Name: "p", Phase: corev1.PodFailed, Terminating: true, FailedReason: "QEMUExited", FailedMessage: "exit 1"},
		},
		{
			name: "failed container without a pod reason",
			pod: corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Name: "p"},
				Status: corev1.PodStatus{Phase: corev1.PodFailed, ContainerStatuses: []corev1.ContainerStatus{{Name: "vm",
					State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 3, Reason: "Error", Message: "boom"}}}}},
			},
			want: PodState{Name: "p", Phase: corev1.PodFailed, FailedReason: "Error", FailedMessage: "container vm exited 3: boom"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, podState(&tc.pod, Lease{}))
		})
	}
}

func TestLabelLeases(t *testing.T) {
	pods := []corev1.Pod{
		{ObjectMeta: metav1.ObjectMeta{Name: "free"}},
		{ObjectMeta: metav1.ObjectMeta{Name: "held", Labels: map[string]string{v1alpha1.LeaseLabel: "ci-1", v1alpha1.UsedLabel: "true"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "released", Labels: map[string]string{v1alpha1.UsedLabel: "true"}}},
		{ObjectMeta: metav1.ObjectMeta{Name: "bare-claim", Labels: map[string]string{v1alpha1.LeaseLabel: ""}}},
	}
	got, demand, err := LabelLeases{}.Leases(t.Context(), nil, pods)
	assert.NoError(t, err)
	assert.Zero(t, demand)
	assert.Equal(t, map[string]Lease{
		"free":       {},
		"held":       {Leased: true, Holder: "ci-1", Used: true},
		"released":   {Used: true},
		"bare-claim": {Leased: true},
	}, got)
}

func TestTemplateHashAndNewPod(t *testing.T) {
	set := sampleSet("ns", "s", 1)
	set.UID = "set-uid"
	set.Spec.Template.Labels[v1alpha1.LeaseLabel] = "oops"
	h := TemplateHash(&set.Spec.Template)
	assert.Equal(t, h, TemplateHash(set.Spec.Template.DeepCopy()), "stable")
	other := set.Spec.Template.DeepCopy()
	other.Spec.Containers[0].Image = "x"
	assert.NotEqual(t, h, TemplateHash(other), "changes with the template")

	p := newPod(set, h)
	assert.Equal(t, "s-", p.GenerateName)
	assert.Equal(t, map[string]string{"app": "s", v1alpha1.TemplateHashLabel: h}, p.Labels, "a new pod is never born leased")
	assert.True(t, metav1.IsControlledBy(p, set))
	assert.Equal(t, ptr.To(true), p.OwnerReferences[0].BlockOwnerDeletion)
	assert.Equal(t, "oops", set.Spec.Template.Labels[v1alpha1.LeaseLabel], "the set's template is not modified")
}
