package provider

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/node"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"
)

func TestStatusDiverged(t *testing.T) {
	yes := true
	base := corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: "10.1.2.3",
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue},
			{Type: corev1.ContainersReady, Status: corev1.ConditionTrue},
		},
		ContainerStatuses: []corev1.ContainerStatus{{Name: "vm", Ready: true, Started: &yes,
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.Now()}}}},
	}
	cases := []struct {
		name string
		mut  func(api *corev1.PodStatus)
		want bool
	}{
		{"same", func(*corev1.PodStatus) {}, false},
		{"timestamps only (API keeps seconds)", func(a *corev1.PodStatus) {
			a.ContainerStatuses[0].State.Running.StartedAt = metav1.NewTime(time.Now().Add(-time.Hour))
			a.Conditions[0].LastTransitionTime = metav1.NewTime(time.Now().Add(-time.Hour))
		}, false},
		{"condition set by others kept", func(a *corev1.PodStatus) {
			a.Conditions = append(a.Conditions, corev1.PodCondition{Type: corev1.PodScheduled, Status: corev1.ConditionTrue},
				corev1.PodCondition{Type: "example.com/gate", Status: corev1.ConditionFalse})
		}, false},
		{"ready overwritten by the node lifecycle controller", func(a *corev1.PodStatus) {
			a.Conditions[0].Status = corev1.ConditionFalse
			a.Conditions[0].Reason = "NodeNotReady"
		}, true},
		{"condition missing", func(a *corev1.PodStatus) { a.Conditions = a.Conditions[1:] }, true},
		{"phase", func(a *corev1.PodStatus) { a.Phase = corev1.PodPending }, true},
		{"pod IP", func(a *corev1.PodStatus) { a.PodIP = "" }, true},
		{"container not ready", func(a *corev1.PodStatus) { a.ContainerStatuses[0].Ready = false }, true},
		{"container state", func(a *corev1.PodStatus) {
			a.ContainerStatuses[0].State = corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}
		}, true},
		{"restart count", func(a *corev1.PodStatus) { a.ContainerStatuses[0].RestartCount = 3 }, true},
		{"no container statuses", func(a *corev1.PodStatus) { a.ContainerStatuses = nil }, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			api := *base.DeepCopy()
			c.mut(&api)
			assert.Equal(t, c.want, StatusDiverged(api, base))
		})
	}
}

// TestStatusRewrittenAfterOverwrite: with the real virtual-kubelet pod
// controller over a fake API server, a Running pod's status that someone
// else overwrites (Ready=False, as the node lifecycle controller does when
// the node's lease lapses) is written back by the node, though its VM's
// state never changed (issue #20: the library alone skips it for good).
func TestStatusRewrittenAfterOverwrite(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	p, recs := pumpVMs(t, 1, record.NewFakeRecorder(100))
	rec := recs[0]
	pod := rec.pod.DeepCopy()
	pod.Spec.NodeName = "n1"
	rec.pod.Spec.NodeName = "n1"

	client := fake.NewClientset(pod)
	factory := informers.NewSharedInformerFactory(client, 0)
	podInformer := factory.Core().V1().Pods()
	_, err := podInformer.Informer().AddEventHandler(p.StatusResyncHandler())
	require.NoError(t, err)
	pc, err := node.NewPodController(node.PodControllerConfig{
		PodClient: client.CoreV1(), EventRecorder: record.NewFakeRecorder(100), Provider: p,
		PodInformer: podInformer, SecretInformer: factory.Core().V1().Secrets(),
		ConfigMapInformer: factory.Core().V1().ConfigMaps(), ServiceInformer: factory.Core().V1().Services(),
		SkipDownwardAPIResolution: true,
	})
	require.NoError(t, err)
	factory.Start(ctx.Done())
	go pc.Run(ctx, 1) //nolint:errcheck // ends with ctx
	select {
	case <-pc.Ready():
	case <-time.After(10 * time.Second):
		t.Fatal("pod controller not ready")
	}

	ready := func() corev1.ConditionStatus {
		got, err := client.CoreV1().Pods("ns").Get(ctx, pod.Name, metav1.GetOptions{})
		require.NoError(t, err)
		if c := findCondition(got.Status.Conditions, corev1.PodReady); c != nil {
			return c.Status
		}
		return ""
	}
	require.Eventually(t, func() bool { return ready() == corev1.ConditionTrue }, 10*time.Second, 20*time.Millisecond,
		"the node wrote the running pod's status")

	// The node lifecycle controller's write.
	got, err := client.CoreV1().Pods("ns").Get(ctx, pod.Name, metav1.GetOptions{})
	require.NoError(t, err)
	c := findCondition(got.Status.Conditions, corev1.PodReady)
	c.Status, c.Reason = corev1.ConditionFalse, "NodeNotReady"
	_, err = client.CoreV1().Pods("ns").UpdateStatus(ctx, got, metav1.UpdateOptions{})
	require.NoError(t, err)

	require.Eventually(t, func() bool { return ready() == corev1.ConditionTrue }, 10*time.Second, 20*time.Millisecond,
		"the node wrote its status back over the overwrite")
}
