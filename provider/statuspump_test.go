package provider

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
)

// pumpVMs is a VMs with n running pods ("p0".."pn-1") and no QEMU: records
// as the pod worker leaves them after a start.
func pumpVMs(t *testing.T, n int, rec record.EventRecorder) (*VMs, []*podVM) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	p := NewVMs(ctx, VMsConfig{NodeName: "n1", NodeIP: "10.1.2.3", StateDir: t.TempDir(), Recorder: rec})
	var recs []*podVM
	for i := range n {
		uid := types.UID(fmt.Sprintf("p%d", i))
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: string(uid), UID: uid},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "img"}}}}
		run := p.newRun(pod)
		r := run.rec
		r.state.StartTime = time.Now().UTC()
		r.state.SetRunning(time.Now())
		p.pods[uid] = run
		recs = append(recs, r)
	}
	return p, recs
}

// TestStatusNotDelayedByFlood: one pod's newest status reaches the library
// at once while the other pods flood it with status pushes (each delivery
// of theirs held up as by a throttled API) and events.
func TestStatusNotDelayedByFlood(t *testing.T) {
	ev := record.NewFakeRecorder(100000)
	p, recs := pumpVMs(t, 51, ev)
	target := recs[0]
	release := make(chan struct{})
	var floodCalls atomic.Int64
	got := make(chan *corev1.Pod, 100)
	p.NotifyPods(context.Background(), func(pod *corev1.Pod) {
		if pod.UID != target.uid {
			floodCalls.Add(1)
			<-release // an API that does not answer for the other pods
			return
		}
		got <- pod
	})
	// NotifyPods pushed every pod once: the target's first delivery.
	select {
	case <-got:
	case <-time.After(5 * time.Second):
		t.Fatal("initial status of the target not delivered")
	}

	require.Eventually(t, func() bool { return floodCalls.Load() == 50 }, 5*time.Second, 10*time.Millisecond,
		"every other pod has its first delivery in flight, held by the API")

	// The flood: 50 pods x 40 status pushes and events, concurrently.
	var wg sync.WaitGroup
	for _, r := range recs[1:] {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				p.event(r.pod, corev1.EventTypeNormal, "Flood", fmt.Sprint(i))
				p.runOf(r.uid).update(func(st *podstatus.VMState) { st.RestartCount++ })
			}
		}()
	}
	wg.Wait()

	// The target's new status (its VM ended) arrives at once.
	start := time.Now()
	p.runOf(target.uid).update(func(st *podstatus.VMState) {
		st.SetTerminated(corev1.ContainerStateTerminated{ExitCode: 0, Reason: podstatus.ReasonCompleted})
		st.Final = true
	})
	select {
	case pod := <-got:
		assert.Equal(t, corev1.PodSucceeded, pod.Status.Phase)
		assert.Less(t, time.Since(start), time.Second, "the target's status waited behind the flood")
	case <-time.After(5 * time.Second):
		t.Fatal("the target's status waited behind the other pods' flood")
	}
	assert.Len(t, ev.Events, 50*40, "the events were all recorded meanwhile")

	// The flood drains: each other pod gets exactly one more delivery, of
	// its newest state (40 pushes coalesced into 1 in flight + 1).
	var mu sync.Mutex
	last := map[types.UID]int32{}
	p.setNotify(func(pod *corev1.Pod) {
		mu.Lock()
		last[pod.UID] = pod.Status.ContainerStatuses[0].RestartCount
		mu.Unlock()
	})
	close(release)
	for _, r := range recs[1:] {
		p.pump.Flush(r.uid)
	}
	assert.Equal(t, int64(50), floodCalls.Load(), "no delivery made per push: coalesced")
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, last, 50)
	for uid, n := range last {
		assert.Equal(t, int32(40), n, "pod %s: the newest status is the last delivered", uid)
	}
}

// TestStatusNeverGoesBackwards: concurrent pushes of one pod (worker,
// probes, delete, NotifyPods) deliver its states in order, the last
// delivered being the newest, with a slow callback. Run with -race.
func TestStatusNeverGoesBackwards(t *testing.T) {
	p, recs := pumpVMs(t, 1, nil)
	r := recs[0]
	var mu sync.Mutex
	var seen []int32
	var calls atomic.Int64
	p.NotifyPods(context.Background(), func(pod *corev1.Pod) {
		calls.Add(1)
		n := pod.Status.ContainerStatuses[0].RestartCount
		time.Sleep(time.Duration(n%3) * time.Millisecond) // a callback of varying speed
		mu.Lock()
		seen = append(seen, n)
		mu.Unlock()
	})
	const pushers, each = 8, 200
	var wg sync.WaitGroup
	for range pushers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				p.runOf(r.uid).update(func(st *podstatus.VMState) { st.RestartCount++ })
				if calls.Load()%7 == 0 {
					p.push(r) // a push without a change (probes, NotifyPods)
				}
			}
		}()
	}
	wg.Wait()
	p.pump.Flush(r.uid)
	mu.Lock()
	defer mu.Unlock()
	require.NotEmpty(t, seen)
	for i := 1; i < len(seen); i++ {
		require.GreaterOrEqual(t, seen[i], seen[i-1], "status went backwards at delivery %d: %v", i, seen[max(0, i-3):i+1])
	}
	assert.Equal(t, int32(pushers*each), seen[len(seen)-1], "the newest state is delivered last")
	assert.Less(t, len(seen), pushers*each, "pushes during a delivery are coalesced")
	t.Logf("%d pushes, %d deliveries", pushers*each, len(seen))
}
