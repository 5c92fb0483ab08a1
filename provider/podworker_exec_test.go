package provider

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The pod worker's executor with a fake image store and a VM that can never
// start (its kernel does not exist, and no QEMU binary is configured): every
// start fails at once as StartError (exit 128), so restart, back-off, power
// and delete races run in milliseconds and no QEMU is ever started.

// fakeImages is an ImageStore: Pull returns one image (or blocks until the
// pull is cancelled when block is set); holds count Acquire minus release.
type fakeImages struct {
	dir   string
	block bool

	mu       sync.Mutex
	pulls    int
	holds    int
	canceled int
}

func (f *fakeImages) Pull(ctx context.Context, ref string, opts oci.PullOptions) (*oci.Image, error) {
	f.mu.Lock()
	f.pulls++
	block := f.block
	f.mu.Unlock()
	if block {
		<-ctx.Done()
		f.mu.Lock()
		f.canceled++
		f.mu.Unlock()
		return nil, ctx.Err()
	}
	return &oci.Image{Ref: ref, Digest: "sha256:" + strings.Repeat("ab", 32),
		Kernel: filepath.Join(f.dir, "no-such-kernel")}, nil
}

func (f *fakeImages) Acquire(string) (func(), error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.holds++
	var once sync.Once
	return func() {
		once.Do(func() {
			f.mu.Lock()
			f.holds--
			f.mu.Unlock()
		})
	}, nil
}

func (f *fakeImages) AuxDir(string, string) (string, error) {
	return "", errors.New("fake image store: no aux dirs")
}

func (f *fakeImages) counts() (pulls, holds, canceled int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pulls, f.holds, f.canceled
}

// fastHarness is a harness whose VMs never start, with back-off initial.
func fastHarness(t *testing.T, initial time.Duration) (*harness, *fakeImages) {
	imageDir := t.TempDir()
	imgs := &fakeImages{dir: imageDir}
	h := newHarnessWith(t, t.TempDir(), imgs, imageDir, func(c *VMsConfig) {
		c.QEMUBinary = filepath.Join(imageDir, "no-qemu")
		c.Backoff = podstatus.Backoff{Initial: initial, Max: 4 * initial}
	})
	return h, imgs
}

func (h *harness) rec(uid types.UID) *podVM {
	if r := h.vms.runOf(uid); r != nil {
		return r.rec
	}
	return nil
}

// runOf is the run p holds for the pod uid (nil: none).
func (p *VMs) runOf(uid types.UID) *podRun {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pods[uid]
}

func restarts(p *corev1.Pod) int32 {
	if len(p.Status.ContainerStatuses) == 0 {
		return -1
	}
	return p.Status.ContainerStatuses[0].RestartCount
}

// deleteAndWaitGone deletes the pod and waits until its worker has ended
// and it is forgotten; the image hold is released.
func deleteAndWaitGone(t *testing.T, h *harness, imgs *fakeImages, pod *corev1.Pod) {
	t.Helper()
	rec := h.rec(pod.UID)
	require.NotNil(t, rec)
	require.NoError(t, h.vms.DeletePod(context.Background(), deleting(pod)))
	select {
	case <-rec.done:
	case <-time.After(10 * time.Second):
		t.Fatalf("pod %s: worker still running 10s after the delete", pod.UID)
	}
	// No VM ran when it was deleted: the failed start's end, or (deleted
	// in the back-off) ContainerStatusUnknown as the kubelet shows it.
	p := h.wait(pod.UID, 5*time.Second, "terminal status", func(p *corev1.Pod) bool { return terminated(p) != nil })
	assert.Contains(t, []string{"ContainerStatusUnknown", podstatus.ReasonStartError}, terminated(p).Reason)
	assert.Nil(t, h.rec(pod.UID), "deleted pod forgotten")
	_, holds, _ := imgs.counts()
	assert.Zero(t, holds, "image hold released")
}

func TestPodWorkerFastCrashLoop(t *testing.T) {
	for _, policy := range []corev1.RestartPolicy{corev1.RestartPolicyAlways, corev1.RestartPolicyOnFailure} {
		t.Run(string(policy), func(t *testing.T) {
			h, imgs := fastHarness(t, 20*time.Millisecond)
			pod := podFor("u-loop", "reg.example/os:1", policy, nil)
			require.NoError(t, h.vms.CreatePod(context.Background(), pod))
			// Start failures (exit 128) restart under Always and OnFailure,
			// with CrashLoopBackOff from the second crash on.
			p := h.wait(pod.UID, 10*time.Second, "3 restarts", func(p *corev1.Pod) bool { return restarts(p) >= 3 })
			assert.NotEqual(t, corev1.PodFailed, p.Status.Phase)
			assert.Contains(t, h.seenTags(pod.UID), "Running/CrashLoopBackOff")
			pulls, holds, _ := imgs.counts()
			assert.GreaterOrEqual(t, pulls, 3, "each start pulls (from the cache)")
			assert.Equal(t, 1, holds, "one hold on the image while the pod lives")
			deleteAndWaitGone(t, h, imgs, pod)
		})
	}
}

func TestPodWorkerFastNeverFinishes(t *testing.T) {
	h, imgs := fastHarness(t, 20*time.Millisecond)
	pod := podFor("u-never", "reg.example/os:1", corev1.RestartPolicyNever, nil)
	require.NoError(t, h.vms.CreatePod(context.Background(), pod))
	p := h.wait(pod.UID, 10*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	assert.Equal(t, int32(0), restarts(p))
	assert.Equal(t, podstatus.ReasonStartError, terminated(p).Reason)
	_, holds, _ := imgs.counts()
	assert.Zero(t, holds, "a finished pod gives its image up")
	// A finished pod refuses power on at once (it no longer waits for the
	// caller's timeout).
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := h.vms.runOf(pod.UID).request(ctx, vmRequest{op: opPowerOn})
	assert.ErrorIs(t, err, errPodFinished)
	require.NoError(t, h.vms.DeletePod(context.Background(), deleting(pod)))
	h.wait(pod.UID, 5*time.Second, "forgotten", func(*corev1.Pod) bool { return h.rec(pod.UID) == nil })
}

// A delete during a long back-off ends the pod at once; the restart count
// is not advanced by the delete.
func TestPodWorkerFastDeleteDuringBackOff(t *testing.T) {
	h, imgs := fastHarness(t, time.Hour)
	pod := podFor("u-backoff", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, h.vms.CreatePod(context.Background(), pod))
	p := h.wait(pod.UID, 10*time.Second, "CrashLoopBackOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonCrashLoopBackOff })
	assert.Equal(t, int32(1), restarts(p), "the first restart has no back-off, the second waits")
	t0 := time.Now()
	deleteAndWaitGone(t, h, imgs, pod)
	assert.Less(t, time.Since(t0), time.Minute, "the delete did not wait for the back-off")
	assert.Equal(t, int32(1), restarts(h.last[pod.UID]))
}

// Power off during the back-off stays off; power on starts at once (and
// fails again into the back-off).
func TestPodWorkerFastPowerDuringBackOff(t *testing.T) {
	h, imgs := fastHarness(t, time.Hour)
	pod := podFor("u-power", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, h.vms.CreatePod(context.Background(), pod))
	h.wait(pod.UID, 10*time.Second, "CrashLoopBackOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonCrashLoopBackOff })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	run := h.vms.runOf(pod.UID)
	require.NoError(t, run.request(ctx, vmRequest{op: opPowerOff}))
	p := h.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
	assert.Equal(t, int32(1), restarts(p), "power off is not a restart")
	require.NoError(t, run.request(ctx, vmRequest{op: opPowerOff}), "power off when off: done")
	pulls0, _, _ := imgs.counts()
	// Power on: answered by the start, which fails.
	err := run.request(ctx, vmRequest{op: opPowerOn})
	require.Error(t, err)
	assert.Contains(t, err.Error(), podstatus.ReasonStartError)
	// Power on reset the crash count: the failure restarts at once (it may
	// already have when the answer is read), then backs off.
	h.wait(pod.UID, 10*time.Second, "CrashLoopBackOff again", func(p *corev1.Pod) bool {
		return waitingReason(p) == podstatus.ReasonCrashLoopBackOff && restarts(p) == 2
	})
	pulls1, _, _ := imgs.counts()
	assert.Equal(t, pulls0+2, pulls1, "power on started the VM once, its failure restarted it once, then the back-off holds")
	// Power on during the back-off starts now.
	err = run.request(ctx, vmRequest{op: opPowerOn})
	require.Error(t, err)
	assert.Contains(t, err.Error(), podstatus.ReasonStartError)
	deleteAndWaitGone(t, h, imgs, pod)
}

// A delete while the image is being pulled cancels the pull and ends the
// pod.
func TestPodWorkerFastDeleteWhileStarting(t *testing.T) {
	h, imgs := fastHarness(t, 20*time.Millisecond)
	imgs.block = true
	pod := podFor("u-pull", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].ImagePullPolicy = corev1.PullAlways
	require.NoError(t, h.vms.CreatePod(context.Background(), pod))
	h.wait(pod.UID, 5*time.Second, "pulling", func(*corev1.Pod) bool { p, _, _ := imgs.counts(); return p > 0 })
	rec := h.rec(pod.UID)
	require.NoError(t, h.vms.DeletePod(context.Background(), deleting(pod)))
	select {
	case <-rec.done:
	case <-time.After(10 * time.Second):
		t.Fatal("worker still running 10s after a delete during the pull")
	}
	_, holds, canceled := imgs.counts()
	assert.Equal(t, 1, canceled, "the pull was cancelled")
	assert.Zero(t, holds)
	p := h.wait(pod.UID, 5*time.Second, "terminal status", func(p *corev1.Pod) bool { return terminated(p) != nil })
	assert.Equal(t, "ContainerStatusUnknown", terminated(p).Reason)
}
