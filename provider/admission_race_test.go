package provider

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// TestCreatePodConcurrentAdmission: the library runs several sync workers,
// so CreatePod is called concurrently. With room for one pod, of n pods
// created at once exactly one is admitted and the others are OutOfpods.
// The node's Allocatable callback is a barrier that holds every caller
// until all n have read it (or 2 s passed), which is the widest window a
// check-then-insert race can have. No QEMU runs: the admitted pod's image
// is not cached and its pull policy is Never, so its worker waits in
// ErrImagePull back-off until the test ends.
func TestCreatePodConcurrentAdmission(t *testing.T) {
	const n = 6
	dir := t.TempDir()
	store, err := oci.Open(t.TempDir(), oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	var arrived atomic.Int32
	all := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	p := NewVMs(ctx, VMsConfig{
		NodeName: "n1", StateDir: dir, Accelerator: "tcg", Images: store, ImageDir: t.TempDir(),
		Backoff: podstatus.Backoff{Initial: time.Hour, Max: time.Hour}, ErrImagePullHold: time.Hour,
		Allocatable: func() corev1.ResourceList {
			if arrived.Add(1) == n {
				close(all)
			}
			select {
			case <-all:
			case <-time.After(2 * time.Second):
			}
			return podtest.RL("cpu", "8", "memory", "8Gi", "pods", "1")
		},
	})
	t.Cleanup(func() { cancel(); waitWorkers(p) })

	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			pod := podtest.VMPod(func(p *corev1.Pod) {
				p.Name, p.UID = fmt.Sprintf("p%d", i), types.UID(fmt.Sprintf("uid-%d", i))
				p.Spec.Containers[0].Image = "127.0.0.1:1/os/absent:1"
				p.Spec.Containers[0].ImagePullPolicy = corev1.PullNever
			})
			assert.NoError(t, p.CreatePod(context.Background(), pod))
		}()
	}
	wg.Wait()

	admitted, outOfPods := 0, 0
	pods, err := p.GetPods(context.Background())
	require.NoError(t, err)
	require.Len(t, pods, n)
	for _, pod := range pods {
		switch {
		case pod.Status.Phase == corev1.PodFailed && pod.Status.Reason == podspec.ReasonOutOfPods:
			outOfPods++
		case pod.Status.Phase == corev1.PodPending:
			admitted++
		default:
			t.Errorf("pod %s: unexpected phase %s reason %q", pod.Name, pod.Status.Phase, pod.Status.Reason)
		}
	}
	assert.Equal(t, 1, admitted, "pods admitted with room for one")
	assert.Equal(t, n-1, outOfPods, "pods refused OutOfpods")
}

// TestCreatePodCountsVMOverhead: through CreatePod, the node's VMOverhead
// is counted: with 1Gi allocatable and 128Mi of QEMU per VM, a first pod
// requesting 512Mi is admitted and a second one, which fits on requests
// alone (512Mi + 512Mi = 1Gi), is refused OutOfmemory. No QEMU runs (the
// image is absent and never pulled).
func TestCreatePodCountsVMOverhead(t *testing.T) {
	store, err := oci.Open(t.TempDir(), oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	p := NewVMs(ctx, VMsConfig{
		NodeName: "n1", StateDir: t.TempDir(), Accelerator: "tcg", Images: store, ImageDir: t.TempDir(),
		Backoff: podstatus.Backoff{Initial: time.Hour, Max: time.Hour}, ErrImagePullHold: time.Hour,
		Allocatable: func() corev1.ResourceList { return podtest.RL("cpu", "8", "memory", "1Gi", "pods", "10") },
		VMOverhead:  128 << 20,
	})
	t.Cleanup(func() { cancel(); waitWorkers(p) })
	for i := range 2 {
		pod := podtest.VMPod(func(p *corev1.Pod) {
			p.Name, p.UID = fmt.Sprintf("p%d", i), types.UID(fmt.Sprintf("uid-%d", i))
			p.Spec.Containers[0].Image = "127.0.0.1:1/os/absent:1"
			p.Spec.Containers[0].ImagePullPolicy = corev1.PullNever
			p.Spec.Containers[0].Resources.Requests = podtest.RL("memory", "512Mi")
		})
		require.NoError(t, p.CreatePod(context.Background(), pod))
	}
	first, err := p.GetPodStatus(context.Background(), "ns", "p0")
	require.NoError(t, err)
	assert.Equal(t, corev1.PodPending, first.Phase)
	second, err := p.GetPodStatus(context.Background(), "ns", "p1")
	require.NoError(t, err)
	assert.Equal(t, corev1.PodFailed, second.Phase)
	assert.Equal(t, "OutOfmemory", second.Reason)
	assert.Contains(t, second.Message, "requested: 671088640, used: 671088640, capacity: 1073741824 (each VM counts QEMU's own memory, at least 134217728)")
}

// waitWorkers waits until every pod worker of p has ended (its context
// canceled).
func waitWorkers(p *VMs) {
	for _, r := range p.records() {
		<-r.done
	}
}
