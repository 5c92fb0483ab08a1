package podstatus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// The real API server's side of the status patch (UID precondition,
// NodeRestriction, no conflicts) is e2e.TestStatusWriterOnAPIServer.

func TestStatusPatch(t *testing.T) {
	start := metav1.Unix(1795500000, 0)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u1", ResourceVersion: "42",
			Labels: map[string]string{"app": "a"}, Annotations: map[string]string{"k": "v"}},
		Status: corev1.PodStatus{
			Phase:     corev1.PodRunning,
			StartTime: &start,
			PodIP:     "10.0.0.2",
			Conditions: []corev1.PodCondition{
				{Type: corev1.PodReady, Status: corev1.ConditionTrue},
			},
			ContainerStatuses: []corev1.ContainerStatus{{
				Name:  "vm",
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: start}},
			}},
		},
	}
	b, err := statusPatch(pod)
	require.NoError(t, err)
	var got map[string]map[string]any
	require.NoError(t, json.Unmarshal(b, &got))

	assert.Equal(t, map[string]any{"uid": "u1"}, got["metadata"],
		"the UID alone: no labels, annotations or resource version")
	st := got["status"]
	assert.Equal(t, "Running", st["phase"])
	assert.Equal(t, "10.0.0.2", st["podIP"])
	for _, f := range []string{"message", "reason", "hostIP", "podIPs", "initContainerStatuses"} {
		v, ok := st[f]
		assert.True(t, ok, "%s is named to be cleared", f)
		assert.Nil(t, v, f)
	}
	for _, f := range []string{"qosClass", "nominatedNodeName", "resize", "observedGeneration"} {
		_, ok := st[f]
		assert.False(t, ok, "%s is not the node's to clear", f)
	}
	cs := st["containerStatuses"].([]any)[0].(map[string]any)
	state := cs["state"].(map[string]any)
	assert.Contains(t, state, "running")
	assert.NotContains(t, state, "waiting", "the list is replaced whole: no stale state survives")

	_, err = statusPatch(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p"}})
	assert.ErrorContains(t, err, "no UID")
}

func TestStatusWriterPatchesStatusOnly(t *testing.T) {
	ctx := context.Background()
	stored := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u1",
		Labels: map[string]string{"app": "a", "qemu-kubelet.io/leased-by": "lease-1"}},
		Status: corev1.PodStatus{Phase: corev1.PodPending, Message: "pulling"}}
	client := fake.NewClientset(stored)
	var actions []k8stesting.Action
	client.PrependReactor("*", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		actions = append(actions, a)
		return false, nil, nil
	})
	// The provider's copy, taken before the lease landed, with a stale
	// resource version.
	stale := stored.DeepCopy()
	stale.Labels = map[string]string{"app": "a"}
	stale.ResourceVersion = "1"
	stale.Status = corev1.PodStatus{Phase: corev1.PodRunning}

	out, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, stale, metav1.UpdateOptions{FieldManager: "qk"})
	require.NoError(t, err)
	assert.Equal(t, corev1.PodRunning, out.Status.Phase)
	require.Len(t, actions, 1, "one request, no read")
	pa, ok := actions[0].(k8stesting.PatchAction)
	require.True(t, ok, "a patch, not an update: %T", actions[0])
	assert.Equal(t, "status", pa.GetSubresource())
	assert.Equal(t, types.MergePatchType, pa.GetPatchType())
	assert.NotContains(t, string(pa.GetPatch()), "leased-by")
	assert.NotContains(t, string(pa.GetPatch()), `"labels"`)

	got, err := client.CoreV1().Pods("ns").Get(ctx, "p", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, corev1.PodRunning, got.Status.Phase, "the status landed")
	assert.Empty(t, got.Status.Message, "the message the new status lacks is cleared")
	assert.Equal(t, stored.Labels, got.Labels, "the lease label is kept")
}

func TestUIDMismatch(t *testing.T) {
	gk := schema.GroupKind{Kind: "Pod"}
	uid := apierrors.NewInvalid(gk, "p", field.ErrorList{field.Invalid(field.NewPath("metadata", "uid"), "u0", "field is immutable")})
	phase := apierrors.NewInvalid(gk, "p", field.ErrorList{field.Invalid(field.NewPath("status", "phase"), "Running", "may not go back")})
	assert.True(t, uidMismatch(uid))
	assert.True(t, uidMismatch(fmt.Errorf("wrapped: %w", uid)))
	assert.False(t, uidMismatch(phase), "another invalid field: the delete still goes ahead")
	assert.False(t, uidMismatch(apierrors.NewConflict(schema.GroupResource{Resource: "pods"}, "p", errors.New("x"))))
	assert.False(t, uidMismatch(nil))
}
