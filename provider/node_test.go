package provider

import (
	"context"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/record"
)

// TestSetRecorderSwapsTheRecorder: the pods' events go to the recorder set
// last (SetRecorder, as cmd sets it once the pod controller's event
// broadcaster exists); before one is set they are dropped. Each pod here
// is refused by admission (its memory request is over the node's), which
// sends a Warning event and starts no worker.
func TestSetRecorderSwapsTheRecorder(t *testing.T) {
	ctx := context.Background()
	p := NewVMs(ctx, VMsConfig{NodeName: "n1", StateDir: t.TempDir(),
		Allocatable: func() corev1.ResourceList { return podtest.RL("cpu", "8", "memory", "128Mi", "pods", "10") }})
	refused := func(uid string) *corev1.Pod {
		pod := podFor(uid, "reg.example/os:1", corev1.RestartPolicyNever, nil)
		pod.Spec.Containers[0].Resources.Requests = podtest.RL("memory", "256Mi")
		return pod
	}
	require.NoError(t, p.CreatePod(ctx, refused("u-before")), "no recorder yet: the event is dropped")
	st, err := p.GetPodStatus(ctx, "default", "vm-u-before")
	require.NoError(t, err)
	assert.Equal(t, corev1.PodFailed, st.Phase, "refused by admission")

	first, second := record.NewFakeRecorder(10), record.NewFakeRecorder(10)
	p.SetRecorder(first)
	require.NoError(t, p.CreatePod(ctx, refused("u-first")))
	p.SetRecorder(second)
	require.NoError(t, p.CreatePod(ctx, refused("u-second")))

	evs := drainEvents(first)
	require.Len(t, evs, 1, "the pod created while the first recorder was set: %v", evs)
	assert.True(t, strings.HasPrefix(evs[0], "Warning OutOfmemory "), evs[0])
	evs = drainEvents(second)
	require.Len(t, evs, 1, "the pod created after the recorder was replaced: %v", evs)
	assert.True(t, strings.HasPrefix(evs[0], "Warning OutOfmemory "), evs[0])
}
