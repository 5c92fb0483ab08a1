package controller

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

// upstreamFixture is an upstream set of our provisioner with pods in a
// fake API server, planned by an UpstreamReconciler whose clock the test
// sets.
type upstreamFixture struct {
	c    client.Client
	r    *UpstreamReconciler
	key  types.NamespacedName
	set  *vtv1.ExporterSet
	hash string
	now  time.Time
}

func newUpstreamFixture(t *testing.T, minReplicas int32, cooldown time.Duration, pods ...*corev1.Pod) *upstreamFixture {
	t.Helper()
	scheme := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(scheme))
	require.NoError(t, vtv1.AddToScheme(scheme))
	require.NoError(t, jsv1.AddToScheme(scheme))
	class := vtClass("ns", "ours", vtv1.DefaultProvisioner, `{"qemuKubelet":{"image":"reg.invalid/os:1"}}`)
	set := vtSet("ns", "mine", "ours", minReplicas)
	set.UID, set.Generation = "set-uid", 1
	set.Spec.ScaleDownCooldown = &metav1.Duration{Duration: cooldown}
	spec, cerr := MapUpstream(set, class, time.Minute)
	require.Nil(t, cerr)
	f := &upstreamFixture{set: set, key: client.ObjectKeyFromObject(set), hash: upstreamHash(&spec.Template, set.Spec.Template.Metadata.Labels),
		now: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)}
	objs := []client.Object{class, set}
	for _, p := range pods {
		objs = append(objs, p)
	}
	f.c = fake.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&vtv1.ExporterSet{}).WithObjects(objs...).Build()
	f.r = NewUpstreamReconciler(f.c, &events.FakeRecorder{}, "")
	f.r.Now = func() time.Time { return f.now }
	f.r.Jumpstarter = true
	return f
}

// pod is a pod of the set, of its current template, created at created.
func (f *upstreamFixture) pod(name string, created time.Time, phase corev1.PodPhase) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: types.UID("uid-" + name),
		CreationTimestamp: metav1.NewTime(created),
		Labels:            map[string]string{UpstreamLabel: "mine", v1alpha1.TemplateHashLabel: f.hash},
		OwnerReferences: []metav1.OwnerReference{{APIVersion: vtv1.GroupVersion.String(), Kind: "ExporterSet", Name: "mine",
			UID: "set-uid", Controller: ptr.To(true)}}},
		Status: corev1.PodStatus{Phase: phase}}
	if phase == corev1.PodRunning {
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue,
			LastTransitionTime: metav1.NewTime(created)}}
	}
	return p
}

// pass plans the set once at f.now.
func (f *upstreamFixture) pass(t *testing.T) ctrl.Result {
	t.Helper()
	res, err := f.r.Reconcile(context.Background(), ctrl.Request{NamespacedName: f.key})
	require.NoError(t, err)
	return res
}

func (f *upstreamFixture) podNames(t *testing.T) []string {
	t.Helper()
	var l corev1.PodList
	require.NoError(t, f.c.List(context.Background(), &l, client.InNamespace("ns")))
	var out []string
	for _, p := range l.Items {
		out = append(out, p.Name)
	}
	return out
}

// fixtureHash is the template hash of the fixture's set (MapUpstream is
// pure: the same set and class give the same template).
func fixtureHash(t *testing.T) string {
	t.Helper()
	return newUpstreamFixture(t, 1, time.Minute).hash
}

// TestUpstreamScaleDownAfterCooldown: an upstream set of minReplicas 1
// with two Ready pods and a cooldown of one minute keeps its surplus pod
// while the cooldown runs (the pass half-way does not restart it) and
// disables the newest pod's Exporter on the first pass after it elapsed
// and deletes the pod once the drain delay passed; once the set is gone
// its memory is dropped.
func TestUpstreamScaleDownAfterCooldown(t *testing.T) {
	hash := fixtureHash(t)
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	mk := (&upstreamFixture{hash: hash}).pod
	f := newUpstreamFixture(t, 1, time.Minute,
		mk("old", t0.Add(-time.Hour), corev1.PodRunning), mk("new", t0.Add(-time.Minute), corev1.PodRunning))
	require.Equal(t, hash, f.hash)

	f.now = t0
	res := f.pass(t)
	assert.ElementsMatch(t, []string{"new", "old"}, f.podNames(t), "cooldown started: nothing deleted")
	assert.Equal(t, time.Minute, res.RequeueAfter, "planned again when the cooldown ends")
	m := f.r.mem.Get(f.key, "set-uid")
	require.NotNil(t, m.ScaleDownPendingSince, "the cooldown's start is remembered")
	assert.Equal(t, t0, *m.ScaleDownPendingSince)

	f.now = t0.Add(30 * time.Second)
	res = f.pass(t)
	assert.ElementsMatch(t, []string{"new", "old"}, f.podNames(t), "cooldown half-way: nothing deleted")
	assert.Equal(t, 30*time.Second, res.RequeueAfter, "the cooldown did not restart")

	f.now = t0.Add(time.Minute)
	f.pass(t)
	assert.ElementsMatch(t, []string{"new", "old"}, f.podNames(t), "cooldown elapsed: the surplus pod's Exporter is disabled first")
	var e jsv1.Exporter
	require.NoError(t, f.c.Get(context.Background(), types.NamespacedName{Namespace: "ns", Name: "new"}, &e))
	assert.False(t, e.IsEnabled(), "the newest surplus pod's Exporter is disabled")

	f.now = f.now.Add(DefaultDrainDelay)
	f.pass(t)
	assert.Equal(t, []string{"old"}, f.podNames(t), "drained: the newest surplus pod is deleted")

	require.NoError(t, f.c.Delete(context.Background(), f.set))
	f.pass(t)
	assert.Zero(t, f.r.mem.Len(), "a gone set's memory is dropped")
}

// TestUpstreamFailureBackoff: an upstream set whose pods keep failing
// counts the failures from pass to pass: after the first failure a
// replacement is created at once, after the second none until
// failureBackoffBase has passed (the failed pod goes once its Exporter
// drained); from the third the set is Degraded, and
// stays so with the last pod's reason on a pass that sees no new failure.
func TestUpstreamFailureBackoff(t *testing.T) {
	ctx := context.Background()
	hash := fixtureHash(t)
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	f := newUpstreamFixture(t, 1, time.Minute, (&upstreamFixture{hash: hash}).pod("a", t0.Add(-time.Minute), corev1.PodFailed))
	// failOnly fails the set's only pod (the fake API server gives created
	// pods no UID: one is set).
	failOnly := func(n int) {
		t.Helper()
		names := f.podNames(t)
		require.Len(t, names, 1)
		var p corev1.Pod
		require.NoError(t, f.c.Get(ctx, types.NamespacedName{Namespace: "ns", Name: names[0]}, &p))
		require.NoError(t, f.c.Delete(ctx, &p))
		p.UID, p.ResourceVersion = types.UID(fmt.Sprintf("uid-%d", n)), ""
		p.Status.Phase, p.Status.Reason, p.Status.Message = corev1.PodFailed, "VMCrashed", "guest panicked"
		require.NoError(t, f.c.Create(ctx, &p))
	}
	degraded := func() *metav1.Condition {
		t.Helper()
		var s vtv1.ExporterSet
		require.NoError(t, f.c.Get(ctx, f.key, &s))
		return meta.FindStatusCondition(s.Status.Conditions, vtv1.ExporterSetConditionDegraded)
	}

	f.now = t0
	f.pass(t)
	names := f.podNames(t)
	require.Len(t, names, 1, "the failed pod is replaced at once")
	require.NotEqual(t, "a", names[0])
	assert.Equal(t, int32(1), f.r.mem.Get(f.key, "set-uid").ConsecutiveFailures)

	failOnly(2)
	f.now = t0.Add(time.Second)
	res := f.pass(t)
	assert.Equal(t, names, f.podNames(t), "second failure in a row: no create during the backoff (the failed pod's Exporter drains)")
	m := f.r.mem.Get(f.key, "set-uid")
	assert.Equal(t, int32(2), m.ConsecutiveFailures)
	require.NotNil(t, m.LastFailureTime)
	assert.Equal(t, f.now, *m.LastFailureTime)
	assert.Equal(t, failureBackoffBase, res.RequeueAfter)

	f.now = t0.Add(time.Second + failureBackoffBase)
	f.pass(t)
	require.Len(t, f.podNames(t), 1, "backoff over: the drained failed pod is deleted, a pod is created")
	require.NotEqual(t, names, f.podNames(t))

	names = f.podNames(t)
	failOnly(3)
	f.now = f.now.Add(time.Second)
	f.pass(t)
	assert.Equal(t, names, f.podNames(t), "third failure: backing off again")
	m = f.r.mem.Get(f.key, "set-uid")
	assert.Equal(t, int32(3), m.ConsecutiveFailures)
	require.NotNil(t, m.LastFailure, "the repeated-failure condition is kept")
	c := degraded()
	require.NotNil(t, c)
	assert.Equal(t, metav1.ConditionTrue, c.Status)
	assert.Equal(t, "VMCrashed", c.Reason)
	assert.Contains(t, c.Message, "3"+failedInARow)

	// A pass with no new failure (still backing off) keeps the last pod's
	// reason and detail from memory.
	f.now = f.now.Add(time.Second)
	f.pass(t)
	c = degraded()
	assert.Equal(t, "VMCrashed", c.Reason)
	assert.Contains(t, c.Message, "guest panicked")
}

// TestUpstreamMemory: entries are per UID; a set created again under the
// same name starts afresh; Forget drops by name; memoryOf keeps the last
// ReplicaFailure condition only when it reports repeated failures, and
// into hands back what memoryOf took.
func TestUpstreamMemory(t *testing.T) {
	key := types.NamespacedName{Namespace: "ns", Name: "s"}
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	u := newUpstreamMemory()
	u.Put(key, "uid-1", plannerMemory{ConsecutiveFailures: 3, ScaleDownPendingSince: &t0})
	assert.Equal(t, int32(3), u.Get(key, "uid-1").ConsecutiveFailures)
	assert.Equal(t, plannerMemory{}, u.Get(key, "uid-2"), "another set of that name knows nothing")
	u.Put(key, "uid-2", plannerMemory{ConsecutiveFailures: 1})
	assert.Equal(t, 1, u.Len(), "the former set's entry is dropped")
	assert.Equal(t, plannerMemory{}, u.Get(key, "uid-1"))
	u.Forget(key)
	assert.Zero(t, u.Len())

	repeated := Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, "Failed", "2" + failedInARow + lastDetail + "x"}
	st := Status{ScaleDownPendingSince: &t0, ConsecutiveFailures: 2, LastFailureTime: &t0,
		Conditions: []Condition{{v1alpha1.ConditionAvailable, metav1.ConditionTrue, "r", "m"}, repeated}}
	m := memoryOf(st)
	require.NotNil(t, m.LastFailure)
	assert.Equal(t, repeated, *m.LastFailure)
	var in Input
	m.into(&in)
	assert.Equal(t, Input{ScaleDownPendingSince: &t0, ConsecutiveFailures: 2, LastFailureTime: &t0, LastFailure: &repeated}, in)

	// A later ReplicaFailure (a failed create) overrides it, as in the
	// status write.
	st.Conditions = append(st.Conditions, Condition{v1alpha1.ConditionReplicaFailure, metav1.ConditionTrue, EventFailedCreate, "quota"})
	assert.Nil(t, memoryOf(st).LastFailure)
}
