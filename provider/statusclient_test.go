package provider

import (
	"context"
	"fmt"
	"maps"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// nodeRestricted is a fake API server whose pods/status updates are
// admitted as NodeRestriction admits a node's: refused when the labels
// differ from the stored pod's (plugin/pkg/admission/noderestriction,
// admitPodStatus). forbidOther refuses every status update, as RBAC would.
func nodeRestricted(t *testing.T, pod *corev1.Pod, forbidOther bool) (*fake.Clientset, *int) {
	t.Helper()
	client := fake.NewClientset(pod)
	writes := 0
	client.PrependReactor("update", "pods", func(a k8stesting.Action) (bool, runtime.Object, error) {
		if a.GetSubresource() != "status" {
			return false, nil, nil
		}
		writes++
		gr := schema.GroupResource{Resource: "pods"}
		if forbidOther {
			return true, nil, apierrors.NewForbidden(gr, pod.Name, fmt.Errorf("not allowed"))
		}
		next := a.(k8stesting.UpdateAction).GetObject().(*corev1.Pod)
		old, err := client.Tracker().Get(gr.WithVersion("v1"), next.Namespace, next.Name)
		if err != nil {
			return true, nil, err
		}
		if !maps.Equal(old.(*corev1.Pod).Labels, next.Labels) {
			return true, nil, apierrors.NewForbidden(gr, next.Name, fmt.Errorf("node %q cannot update labels through pod status", "n1"))
		}
		return false, nil, nil
	})
	return client, &writes
}

func TestStatusWriterKeepsStoredLabels(t *testing.T) {
	ctx := context.Background()
	stored := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "ns", UID: "u1",
		Labels:      map[string]string{"app": "a", "qemu-kubelet.io/leased-by": "lease-1"},
		Annotations: map[string]string{"qemu-kubelet.io/leased-at": "2026-11-24T12:00:00Z"}}}
	// The provider's copy, taken before the lease landed.
	stale := stored.DeepCopy()
	stale.Labels = map[string]string{"app": "a"}
	stale.Annotations = nil
	stale.Status = corev1.PodStatus{Phase: corev1.PodRunning}

	t.Run("the raw client loses the write", func(t *testing.T) {
		client, _ := nodeRestricted(t, stored.DeepCopy(), false)
		_, err := client.CoreV1().Pods("ns").UpdateStatus(ctx, stale.DeepCopy(), metav1.UpdateOptions{})
		require.Error(t, err)
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
	})

	t.Run("the writer retries with the stored metadata", func(t *testing.T) {
		client, writes := nodeRestricted(t, stored.DeepCopy(), false)
		out, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, stale.DeepCopy(), metav1.UpdateOptions{})
		require.NoError(t, err)
		assert.Equal(t, corev1.PodRunning, out.Status.Phase)
		got, err := client.CoreV1().Pods("ns").Get(ctx, "p", metav1.GetOptions{})
		require.NoError(t, err)
		assert.Equal(t, corev1.PodRunning, got.Status.Phase, "the status landed")
		assert.Equal(t, stored.Labels, got.Labels, "the lease label is kept")
		assert.Equal(t, stored.Annotations, got.Annotations)
		assert.Equal(t, 2, *writes, "one refused write, one retry")
	})

	t.Run("matching labels: one write", func(t *testing.T) {
		client, writes := nodeRestricted(t, stored.DeepCopy(), false)
		fresh := stored.DeepCopy()
		fresh.Status.Phase = corev1.PodSucceeded
		_, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, fresh, metav1.UpdateOptions{})
		require.NoError(t, err)
		assert.Equal(t, 1, *writes)
	})

	t.Run("another pod of the same name is not written", func(t *testing.T) {
		client, writes := nodeRestricted(t, stored.DeepCopy(), false)
		other := stale.DeepCopy()
		other.UID = "u0" // the previous incarnation's status
		_, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, other, metav1.UpdateOptions{})
		require.Error(t, err)
		assert.True(t, apierrors.IsForbidden(err), "%v", err)
		assert.Equal(t, 1, *writes, "no retry over another pod")
		got, err := client.CoreV1().Pods("ns").Get(ctx, "p", metav1.GetOptions{})
		require.NoError(t, err)
		assert.Empty(t, got.Status.Phase)
	})

	t.Run("a refusal for another reason is returned as it came", func(t *testing.T) {
		client, writes := nodeRestricted(t, stored.DeepCopy(), true)
		fresh := stored.DeepCopy()
		_, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, fresh, metav1.UpdateOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "not allowed")
		assert.Equal(t, 1, *writes, "same metadata: nothing to repair")
	})

	t.Run("a failed retry says both", func(t *testing.T) {
		client, writes := nodeRestricted(t, stored.DeepCopy(), true)
		_, err := StatusWriter(client.CoreV1()).Pods("ns").UpdateStatus(ctx, stale.DeepCopy(), metav1.UpdateOptions{})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "with its stored labels")
		assert.True(t, apierrors.IsForbidden(err), "the retry's error is wrapped: %v", err)
		assert.Equal(t, 2, *writes)
	})
}
