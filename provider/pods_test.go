package provider

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

func testPod(ns, name string) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name)},
		Spec: corev1.PodSpec{
			NodeName:       "n1",
			InitContainers: []corev1.Container{{Name: "init", Image: "i"}},
			Containers:     []corev1.Container{{Name: "a", Image: "img-a"}, {Name: "b", Image: "img-b"}},
		},
	}
}

func TestUnsupportedPodsLifecycle(t *testing.T) {
	ctx := context.Background()
	p := NewUnsupportedPods("n1", "v0.1.0-test")
	var pushed []*corev1.Pod
	p.NotifyPods(ctx, func(pod *corev1.Pod) { pushed = append(pushed, pod) })

	require.NoError(t, p.CreatePod(ctx, testPod("ns2", "z")))
	require.NoError(t, p.CreatePod(ctx, testPod("ns1", "y")))
	require.Len(t, pushed, 2)

	st := pushed[0].Status
	assert.Equal(t, corev1.PodFailed, st.Phase)
	assert.Equal(t, ReasonVMsNotSupported, st.Reason)
	assert.Contains(t, st.Message, "does not run VMs yet")
	assert.Contains(t, st.Message, "v0.1.0-test")
	require.Len(t, st.ContainerStatuses, 2)
	require.Len(t, st.InitContainerStatuses, 1)
	for _, cs := range append(st.ContainerStatuses, st.InitContainerStatuses...) {
		require.NotNil(t, cs.State.Terminated, cs.Name)
		assert.Equal(t, ReasonVMsNotSupported, cs.State.Terminated.Reason)
	}
	assert.NotNil(t, st.StartTime)

	pods, err := p.GetPods(ctx)
	require.NoError(t, err)
	require.Len(t, pods, 2)
	assert.Equal(t, "ns1/y", pods[0].Namespace+"/"+pods[0].Name, "sorted")
	assert.Equal(t, "uid-y", string(pods[0].UID), "UID kept: the library matches pods by it")

	got, err := p.GetPodStatus(ctx, "ns2", "z")
	require.NoError(t, err)
	assert.Equal(t, corev1.PodFailed, got.Phase)

	upd := testPod("ns2", "z")
	upd.Labels = map[string]string{"x": "1"}
	require.NoError(t, p.UpdatePod(ctx, upd))
	gp, err := p.GetPod(ctx, "ns2", "z")
	require.NoError(t, err)
	assert.Equal(t, "1", gp.Labels["x"])
	assert.Equal(t, ReasonVMsNotSupported, gp.Status.Reason, "update keeps the status")

	require.NoError(t, p.DeletePod(ctx, testPod("ns2", "z")))
	require.Len(t, pushed, 3)
	assert.Equal(t, corev1.PodFailed, pushed[2].Status.Phase, "terminal status pushed on delete")
	assert.True(t, errdefs.IsNotFound(p.DeletePod(ctx, testPod("ns2", "z"))), "second delete: NotFound")
	_, err = p.GetPod(ctx, "ns2", "z")
	assert.True(t, errdefs.IsNotFound(err))
	assert.True(t, errdefs.IsNotFound(p.UpdatePod(ctx, testPod("ns2", "z"))))

	pods, _ = p.GetPods(ctx)
	require.Len(t, pods, 1)

	_, err = p.GetContainerLogs(ctx, "ns1", "y", "a", apiLogOpts())
	assert.ErrorContains(t, err, "does not run VMs yet")
}

func apiLogOpts() api.ContainerLogOpts { return api.ContainerLogOpts{} }
