package e2e

import (
	"context"
	"net/http"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
)

// countingTransport counts the requests a client sends.
type countingTransport struct {
	next http.RoundTripper
	n    *atomic.Int64
}

func (c countingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	c.n.Add(1)
	return c.next.RoundTrip(r)
}

// TestStatusWriterOnAPIServer writes pod statuses as the node does
// (provider.StatusWriter, the node's identity, NodeRestriction on) against
// the real API server: a copy of the pod with stale labels and resource
// version is written in one request without a conflict and without
// touching the labels; a field the new status lacks is cleared and a
// container's state replaced whole; the status of a pod's previous
// incarnation (same name, old UID) is refused and does not land, and its
// final delete (provider.FinalDelete) leaves the new pod alone.
func TestStatusWriterOnAPIServer(t *testing.T) {
	const node = "qk-status"
	c := cluster.StartT(t, cluster.Options{})
	ctx := context.Background()
	admin := c.Client().CoreV1().Pods("default")

	kc, err := c.NodeKubeconfig(node)
	require.NoError(t, err)
	rc, err := clientcmd.BuildConfigFromFlags("", kc)
	require.NoError(t, err)
	var requests atomic.Int64
	rc.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return countingTransport{rt, &requests} }
	nodeClient, err := kubernetes.NewForConfig(rc)
	require.NoError(t, err)
	w := podstatus.StatusWriter(nodeClient.CoreV1()).Pods("default")

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "sw", Labels: map[string]string{"app": "sw"}},
		Spec:       corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "vm", Image: "example.test/os:1"}}},
	}
	created, err := admin.Create(ctx, pod, metav1.CreateOptions{})
	require.NoError(t, err)

	// The node's copy, then a lease lands: the stored pod gets a label and
	// a new resource version the copy does not have.
	copyOf := created.DeepCopy()
	leased := created.DeepCopy()
	leased.Labels["qemu-kubelet.io/leased-by"] = "lease-1"
	_, err = admin.Update(ctx, leased, metav1.UpdateOptions{})
	require.NoError(t, err)

	waiting := copyOf.DeepCopy()
	now := metav1.Now()
	waiting.Status = corev1.PodStatus{
		Phase: corev1.PodPending, Message: "pulling the image", Reason: "Pulling", StartTime: &now,
		ContainerStatuses: []corev1.ContainerStatus{{Name: "vm", Image: "example.test/os:1",
			State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}},
	}
	before := requests.Load()
	_, err = w.UpdateStatus(ctx, waiting, metav1.UpdateOptions{})
	require.NoError(t, err, "a stale copy's status is written")
	assert.Equal(t, int64(1), requests.Load()-before, "one request: no conflict, no read, no retry")

	// The raw PUT of the same stale copy, as the library sent it before:
	// refused.
	_, err = nodeClient.CoreV1().Pods("default").UpdateStatus(ctx, waiting, metav1.UpdateOptions{})
	require.Error(t, err)
	assert.True(t, apierrors.IsConflict(err) || apierrors.IsForbidden(err), "%v", err)

	running := copyOf.DeepCopy()
	running.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, StartTime: &now, PodIP: "10.0.2.15",
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}},
		ContainerStatuses: []corev1.ContainerStatus{{Name: "vm", Image: "example.test/os:1", Ready: true,
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}}},
	}
	_, err = w.UpdateStatus(ctx, running, metav1.UpdateOptions{})
	require.NoError(t, err)
	got, err := admin.Get(ctx, "sw", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, corev1.PodRunning, got.Status.Phase)
	assert.Empty(t, got.Status.Message, "cleared")
	assert.Empty(t, got.Status.Reason, "cleared")
	require.Len(t, got.Status.ContainerStatuses, 1)
	assert.NotNil(t, got.Status.ContainerStatuses[0].State.Running)
	assert.Nil(t, got.Status.ContainerStatuses[0].State.Waiting, "the state is replaced whole")
	assert.Equal(t, "lease-1", got.Labels["qemu-kubelet.io/leased-by"], "the lease label is kept")
	assert.Equal(t, "10.0.2.15", got.Status.PodIP)
	assert.NotEmpty(t, got.Status.QOSClass, "the API server's field is kept")

	// The pod is deleted and created again under its name: the old
	// incarnation's status must not land on the new one.
	require.NoError(t, admin.Delete(ctx, "sw", metav1.DeleteOptions{GracePeriodSeconds: new(int64)}))
	again, err := admin.Create(ctx, pod.DeepCopy(), metav1.CreateOptions{})
	require.NoError(t, err)
	require.NotEqual(t, created.UID, again.UID)
	_, refused := w.UpdateStatus(ctx, running, metav1.UpdateOptions{})
	require.Error(t, refused, "the old UID's status is refused")
	assert.True(t, apierrors.IsNotFound(refused), "said as NotFound (the library drops those): %v", refused)
	got, err = admin.Get(ctx, "sw", metav1.GetOptions{})
	require.NoError(t, err)
	assert.Equal(t, again.UID, got.UID)
	assert.NotEqual(t, corev1.PodRunning, got.Status.Phase, "nothing of the old incarnation landed")
	t.Logf("old incarnation's write refused with: %v", refused)

	// The final delete of the old incarnation neither writes nor deletes
	// the new pod; the new one's final delete writes its terminal status
	// and removes it, in two requests.
	oldFinal := running.DeepCopy()
	oldFinal.Status.Phase = corev1.PodSucceeded
	require.NoError(t, podstatus.FinalDelete(ctx, nodeClient.CoreV1(), oldFinal))
	got, err = admin.Get(ctx, "sw", metav1.GetOptions{})
	require.NoError(t, err, "the new pod is not deleted by the old one's final delete")
	assert.Equal(t, again.UID, got.UID)
	assert.NotEqual(t, corev1.PodSucceeded, got.Status.Phase)

	final := again.DeepCopy()
	final.Status = corev1.PodStatus{Phase: corev1.PodSucceeded, StartTime: &now,
		ContainerStatuses: []corev1.ContainerStatus{{Name: "vm", Image: "example.test/os:1",
			State: corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed"}}}}}
	before = requests.Load()
	require.NoError(t, podstatus.FinalDelete(ctx, nodeClient.CoreV1(), final))
	assert.Equal(t, int64(2), requests.Load()-before, "a status patch and a delete")
	_, err = admin.Get(ctx, "sw", metav1.GetOptions{})
	assert.True(t, apierrors.IsNotFound(err), "deleted: %v", err)
	require.NoError(t, podstatus.FinalDelete(ctx, nodeClient.CoreV1(), final), "a pod already gone is not an error")
}
