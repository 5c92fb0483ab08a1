package controller

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/events"
	"k8s.io/utils/ptr"
	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/client/fake"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// TestStatusWrittenWhenCacheLagsOurWrite: the controller wrote leased=1
// (a release); the cache still shows its earlier leased=2 write when a new
// claim makes the plan leased=2 again. Equal to the cached status, the
// write must not be skipped: the stored status says 1 and no further event
// would come (CI saw a set stuck at leased=1 with both pods leased).
func TestStatusWrittenWhenCacheLagsOurWrite(t *testing.T) {
	ctx := context.Background()
	scheme := runtime.NewScheme()
	require.NoError(t, corev1.AddToScheme(scheme))
	require.NoError(t, v1alpha1.AddToScheme(scheme))

	set := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Name: "plug", Namespace: "ns", UID: "set-uid", Generation: 1},
		Spec: v1alpha1.ExporterSetSpec{
			Replicas:      ptr.To[int32](2),
			Selector:      &metav1.LabelSelector{MatchLabels: map[string]string{"app": "plug"}},
			RecyclePolicy: v1alpha1.RecyclePolicyReuse,
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "plug"}},
				Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "os:1"}}}},
		},
	}
	hash := TemplateHash(&set.Spec.Template)
	pod := func(name string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ns", UID: k8stypes.UID("uid-" + name),
			Labels: map[string]string{"app": "plug", v1alpha1.TemplateHashLabel: hash, v1alpha1.LeaseLabel: "holder-" + name, v1alpha1.UsedLabel: "true"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: v1alpha1.GroupVersion.String(), Kind: "ExporterSet", Name: "plug",
				UID: "set-uid", Controller: ptr.To(true)}}},
			Status: corev1.PodStatus{Phase: corev1.PodRunning, Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}}}
	}
	stored := fake.NewClientBuilder().WithScheme(scheme).WithStatusSubresource(&v1alpha1.ExporterSet{}).
		WithObjects(set.DeepCopy(), pod("a"), pod("b")).Build()
	r := &Reconciler{Client: stored, Recorder: &events.FakeRecorder{}, Leases: LabelLeases{}}
	key := client.ObjectKeyFromObject(set)

	// First plan: both leased, written; the cache (a copy of the stored
	// state taken now) sees that write.
	_, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	var s v1alpha1.ExporterSet
	require.NoError(t, stored.Get(ctx, key, &s))
	require.Equal(t, int32(2), s.Status.LeasedReplicas)
	cachedSet := s.DeepCopy()

	// A release: b loses its holder; the controller writes leased=1.
	var b corev1.Pod
	require.NoError(t, stored.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "b"}, &b))
	delete(b.Labels, v1alpha1.LeaseLabel)
	require.NoError(t, stored.Update(ctx, &b))
	_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, stored.Get(ctx, key, &s))
	require.Equal(t, int32(1), s.Status.LeasedReplicas)

	// A new claim of b. The controller reads a cache that has the claim
	// but still the set from before the leased=1 write.
	b = corev1.Pod{}
	require.NoError(t, stored.Get(ctx, client.ObjectKey{Namespace: "ns", Name: "b"}, &b))
	b.Labels[v1alpha1.LeaseLabel] = "holder-b2"
	require.NoError(t, stored.Update(ctx, &b))
	r.Reader = staleSetReader{Client: stored, set: cachedSet}
	res, err := r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
	require.NoError(t, err)
	require.NoError(t, stored.Get(ctx, key, &s))
	if s.Status.LeasedReplicas != 2 {
		// The write conflicted on the stale version: it must be planned
		// again, and succeed once the cache caught up.
		require.NotZero(t, res.RequeueAfter, "stored status says leased=%d, the pods 2, and no plan is coming", s.Status.LeasedReplicas)
		r.Reader = stored
		_, err = r.Reconcile(ctx, ctrl.Request{NamespacedName: key})
		require.NoError(t, err)
		require.NoError(t, stored.Get(ctx, key, &s))
	}
	assert.Equal(t, int32(2), s.Status.LeasedReplicas)
}
