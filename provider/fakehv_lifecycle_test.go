package provider

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// The worker's crash, restart, delete and recovery paths against a fake
// hypervisor (fakehv_test.go): the same assertions as the real-QEMU tests
// of TestVMLifecycle (KilledQEMURestartsWithAlways, GuestPanicFails,
// GuestPowerOffNeverCompletes, RecoveryKillsUnreachableQEMU,
// RestartRecovery), in milliseconds, with no QEMU.

// fakeVMHarness is a harness whose VMs are fakeVMs of hv, with crash-loop
// back-off initial; forceDeletes counts the final deletes (one per
// finishDelete of a pod with a deletion timestamp).
type fakeVMHarness struct {
	*harness
	imgs     *fakeImages
	hv       *fakeHypervisor
	stateDir string

	mu           sync.Mutex
	forceDeletes map[types.UID]int
}

func newFakeVMHarness(t *testing.T, stateDir string, hv *fakeHypervisor, initial time.Duration, more ...func(*VMsConfig)) *fakeVMHarness {
	imageDir := t.TempDir()
	f := &fakeVMHarness{imgs: &fakeImages{dir: imageDir}, hv: hv, stateDir: stateDir, forceDeletes: map[types.UID]int{}}
	f.harness = newHarnessWith(t, stateDir, f.imgs, imageDir, func(c *VMsConfig) {
		c.Hypervisor = hv
		c.Backoff = podstatus.Backoff{Initial: initial, Max: 4 * initial}
		c.ForceDelete = func(_ context.Context, pod *corev1.Pod) error {
			f.mu.Lock()
			f.forceDeletes[pod.UID]++
			f.mu.Unlock()
			return nil
		}
		for _, m := range more {
			m(c)
		}
	})
	return f
}

func (f *fakeVMHarness) finalDeletes(uid types.UID) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.forceDeletes[uid]
}

func (f *fakeVMHarness) dir(uid types.UID) string {
	return filepath.Join(f.stateDir, VMsDirName, string(uid))
}

// nextVM is the next VM the fake hypervisor starts.
func nextVM(t *testing.T, hv *fakeHypervisor) *fakeVM {
	t.Helper()
	select {
	case vm := <-hv.started:
		return vm
	case <-time.After(5 * time.Second):
		t.Fatal("no VM started within 10s")
		return nil
	}
}

// noVMStarted checks that no VM starts within d.
func noVMStarted(t *testing.T, hv *fakeHypervisor, d time.Duration, why string) {
	t.Helper()
	select {
	case vm := <-hv.started:
		t.Errorf("%s: VM pid %d started in %s", why, vm.pid, vm.dir)
	case <-time.After(d):
	}
}

// waitWorkerDone waits until the pod's worker ended.
func waitWorkerDone(t *testing.T, rec *podVM) {
	t.Helper()
	select {
	case <-rec.done:
	case <-time.After(5 * time.Second):
		t.Fatalf("pod %s: worker still running after 10s", rec.uid)
	}
}

// deleteFakePod deletes the pod and checks nothing is left of it: worker
// ended, pod forgotten, one final delete, state dir removed, its VM ended.
func (f *fakeVMHarness) deleteFakePod(t *testing.T, pod *corev1.Pod) {
	t.Helper()
	rec := f.rec(pod.UID)
	require.NotNil(t, rec, "pod %s known", pod.UID)
	require.NoError(t, f.vms.DeletePod(context.Background(), deleting(pod)))
	waitWorkerDone(t, rec)
	f.assertGone(t, pod.UID)
}

func (f *fakeVMHarness) assertGone(t *testing.T, uid types.UID) {
	t.Helper()
	assert.Nil(t, f.rec(uid), "deleted pod forgotten")
	assert.Equal(t, 1, f.finalDeletes(uid), "exactly one final delete")
	_, err := os.Stat(f.dir(uid))
	assert.True(t, os.IsNotExist(err), "state dir %s removed (%v)", f.dir(uid), err)
	if vm := f.hv.vmIn(f.dir(uid)); vm != nil {
		_, ended := vm.Exit()
		assert.True(t, ended, "the pod's last VM (pid %d) ended", vm.pid)
	}
}

// assertNoHolds checks every image hold was released (all pods gone).
func (f *fakeVMHarness) assertNoHolds(t *testing.T) {
	t.Helper()
	_, holds, _ := f.imgs.counts()
	assert.Zero(t, holds, "image holds released")
}

func hasEvent(events []string, prefix string) bool {
	for _, e := range events {
		if strings.HasPrefix(e, prefix) {
			return true
		}
	}
	return false
}

// A running VM that crashes is restarted (Always, and OnFailure for a
// failure): the first restart at once, the next after the crash-loop
// back-off; the status counts the restarts and shows the crash as the last
// termination, as the kubelet does.
func TestFakeVMCrashRestarts(t *testing.T) {
	for _, policy := range []corev1.RestartPolicy{corev1.RestartPolicyAlways, corev1.RestartPolicyOnFailure} {
		t.Run(string(policy), func(t *testing.T) {
			const backoff = 200 * time.Millisecond
			f := newFakeVMHarness(t, t.TempDir(), newFakeHypervisor(), backoff)
			pod := podFor("u-crash", "reg.example/os:1", policy, nil)
			require.NoError(t, f.vms.CreatePod(context.Background(), pod))
			vm1 := nextVM(t, f.hv)
			p := f.wait(pod.UID, 10*time.Second, "Running", running)
			assert.Equal(t, int32(0), restarts(p))
			f.drainEvents()

			require.True(t, vm1.crash())
			vm2 := nextVM(t, f.hv)
			p = f.wait(pod.UID, 10*time.Second, "restarted", func(p *corev1.Pod) bool { return running(p) && restarts(p) == 1 })
			assert.NotEqual(t, vm1.pid, vm2.pid, "a new VM")
			assert.Equal(t, vm1.dir, vm2.dir)
			last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
			require.NotNil(t, last, "last termination shown")
			assert.Equal(t, int32(qemu.ExitCodeCrashed), last.ExitCode)
			assert.Equal(t, podstatus.ReasonError, last.Reason)
			assert.Equal(t, crashExit().Reason, last.Message)
			assert.Equal(t, podstatus.ContainerIDPrefix+"u-crash", last.ContainerID)
			assert.Equal(t, corev1.PodRunning, p.Status.Phase)
			evs := f.drainEvents()
			assert.True(t, hasEvent(evs, "Warning VMExited VM exited with code 139: "+crashExit().Reason), "events %q", evs)

			// A second crash soon after: CrashLoopBackOff for the back-off,
			// then the second restart.
			crashed := time.Now()
			require.True(t, vm2.crash())
			vm3 := nextVM(t, f.hv)
			assert.GreaterOrEqual(t, vm3.startTimes.Begin.Sub(crashed), backoff, "restarted only after the back-off")
			p = f.wait(pod.UID, 10*time.Second, "second restart", func(p *corev1.Pod) bool { return running(p) && restarts(p) == 2 })
			assert.Contains(t, f.seenTags(pod.UID), "Running/CrashLoopBackOff")
			assert.Equal(t, podstatus.ReasonError, p.Status.ContainerStatuses[0].LastTerminationState.Terminated.Reason)
			evs = f.drainEvents()
			assert.True(t, hasEvent(evs, "Warning BackOff Back-off restarting failed VM"), "events %q", evs)
			starts, _ := f.hv.counts()
			assert.Equal(t, 3, starts)

			f.deleteFakePod(t, pod)
			f.assertNoHolds(t)
			stops, _ := vm3.stopsKills()
			assert.Equal(t, 1, stops, "the delete stopped the running VM")
			assert.Empty(t, f.hv.runningVMs())
		})
	}
}

// A VM that fails to start is a terminated run (StartError, exit 128):
// restarted at once, then after the back-off, until a start succeeds; the
// failure stays as the last termination.
func TestFakeVMStartFailsThenRuns(t *testing.T) {
	const backoff = 100 * time.Millisecond
	f := newFakeVMHarness(t, t.TempDir(), newFakeHypervisor(), backoff)
	f.hv.failNextStarts(2, errors.New("fake: QEMU could not start"))
	pod := podFor("u-nostart", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	t0 := time.Now()
	require.NoError(t, f.vms.CreatePod(context.Background(), pod))
	vm := nextVM(t, f.hv)
	assert.GreaterOrEqual(t, vm.startTimes.Begin.Sub(t0), backoff, "the third start waited for the back-off")
	p := f.wait(pod.UID, 10*time.Second, "Running", func(p *corev1.Pod) bool { return running(p) && restarts(p) == 2 })
	last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
	require.NotNil(t, last)
	assert.Equal(t, podstatus.ReasonStartError, last.Reason)
	assert.Equal(t, int32(128), last.ExitCode)
	assert.Contains(t, last.Message, "fake: QEMU could not start")
	assert.Contains(t, f.seenTags(pod.UID), "Running/CrashLoopBackOff")
	evs := f.drainEvents()
	assert.True(t, hasEvent(evs, "Warning Failed Error: fake: QEMU could not start"), "events %q", evs)
	starts, _ := f.hv.counts()
	assert.Equal(t, 1, starts, "one VM ran")
	f.deleteFakePod(t, pod)
	f.assertNoHolds(t)
}

// With restartPolicy Never a VM that ends is not restarted: a crash or a
// guest panic fails the pod, a guest power off completes it; the image is
// given up.
func TestFakeVMNeverRestarts(t *testing.T) {
	for _, tc := range []struct {
		name     string
		exit     qemu.Exit
		phase    corev1.PodPhase
		reason   string
		exitCode int32
	}{
		{"Crash", crashExit(), corev1.PodFailed, podstatus.ReasonError, qemu.ExitCodeCrashed},
		{"GuestPanic", qemu.Exit{Class: qemu.ExitPanicked, ExitCode: qemu.ExitCodePanicked, Reason: "guest kernel panicked (pvpanic)"},
			corev1.PodFailed, podstatus.ReasonGuestPanicked, qemu.ExitCodePanicked},
		{"GuestPowerOff", qemu.Exit{Class: qemu.ExitGuestShutdown, Reason: "guest powered off"}, corev1.PodSucceeded, podstatus.ReasonCompleted, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFakeVMHarness(t, t.TempDir(), newFakeHypervisor(), 20*time.Millisecond)
			pod := podFor("u-never", "reg.example/os:1", corev1.RestartPolicyNever, nil)
			require.NoError(t, f.vms.CreatePod(context.Background(), pod))
			vm := nextVM(t, f.hv)
			f.wait(pod.UID, 10*time.Second, "Running", running)
			require.True(t, vm.end(tc.exit))
			p := f.wait(pod.UID, 10*time.Second, string(tc.phase), func(p *corev1.Pod) bool { return p.Status.Phase == tc.phase })
			term := terminated(p)
			require.NotNil(t, term)
			assert.Equal(t, tc.reason, term.Reason)
			assert.Equal(t, tc.exitCode, term.ExitCode)
			assert.Equal(t, tc.exit.Reason, term.Message)
			assert.Equal(t, int32(0), restarts(p))
			assert.Contains(t, f.seenTags(pod.UID), "Running/Running")
			noVMStarted(t, f.hv, 100*time.Millisecond, "restartPolicy Never")
			_, holds, _ := f.imgs.counts()
			assert.Zero(t, holds, "a finished pod gives its image up")
			f.deleteFakePod(t, pod)
			f.assertNoHolds(t)
			stops, _ := vm.stopsKills()
			assert.Zero(t, stops, "nothing to stop for a finished pod")
		})
	}
}

// A crash that arrives while a delete is stopping the VM ends the delete
// (Stop returns the crash): one final delete, no restart, nothing left.
func TestFakeVMCrashDuringDelete(t *testing.T) {
	f := newFakeVMHarness(t, t.TempDir(), newFakeHypervisor(), 20*time.Millisecond)
	pod := podFor("u-race", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, f.vms.CreatePod(context.Background(), pod))
	vm := nextVM(t, f.hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	vm.setHoldStop(true) // the guest ignores the power button
	rec := f.rec(pod.UID)
	require.NoError(t, f.vms.DeletePod(context.Background(), deleting(pod)))
	select {
	case <-vm.stopCalled:
	case <-time.After(5 * time.Second):
		t.Fatal("the delete did not stop the VM within 10s")
	}
	assert.NotNil(t, f.rec(pod.UID), "the pod is known while its VM stops")
	assert.Zero(t, f.finalDeletes(pod.UID), "no final delete while the VM stops")

	require.True(t, vm.crash(), "the crash ends the VM (not the stop)")
	waitWorkerDone(t, rec)
	f.assertGone(t, pod.UID)
	f.assertNoHolds(t)
	p := f.wait(pod.UID, time.Second, "terminal status", func(p *corev1.Pod) bool { return terminated(p) != nil })
	term := terminated(p)
	assert.Equal(t, podstatus.ReasonError, term.Reason, "the terminal status is the crash")
	assert.Equal(t, int32(qemu.ExitCodeCrashed), term.ExitCode)
	assert.Equal(t, int32(0), restarts(p))
	noVMStarted(t, f.hv, 100*time.Millisecond, "crash during the delete")
	stops, kills := vm.stopsKills()
	assert.Equal(t, 1, stops)
	assert.Zero(t, kills)
	assert.Equal(t, 1, f.finalDeletes(pod.UID), "still one final delete")
	assert.Error(t, f.vms.DeletePod(context.Background(), deleting(pod)), "a deleted pod is NotFound")
}

// A crash and a delete arriving together, in either order: whatever the
// worker sees first, the pod ends with one final delete and no VM left.
func TestFakeVMCrashAndDeleteTogether(t *testing.T) {
	f := newFakeVMHarness(t, t.TempDir(), newFakeHypervisor(), 20*time.Millisecond)
	for i := range 30 {
		pod := podFor(fmt.Sprintf("u-both-%d", i), "reg.example/os:1", corev1.RestartPolicyAlways, nil)
		require.NoError(t, f.vms.CreatePod(context.Background(), pod))
		vm := nextVM(t, f.hv)
		f.wait(pod.UID, 10*time.Second, "Running", running)
		rec := f.rec(pod.UID)
		var wg sync.WaitGroup
		wg.Add(2)
		go func() { defer wg.Done(); vm.crash() }()
		go func() { defer wg.Done(); assert.NoError(t, f.vms.DeletePod(context.Background(), deleting(pod))) }()
		wg.Wait()
		waitWorkerDone(t, rec)
		f.assertGone(t, pod.UID)
		f.assertNoHolds(t)
	drain:
		for { // a restart that won the race is stopped by the delete
			select {
			case <-f.hv.started:
			default:
				break drain
			}
		}
	}
	assert.Empty(t, f.hv.runningVMs(), "no VM left running")
}

// Agent restart: running VMs are adopted as they are (same VM, no start)
// and report Running; a VM that died while nobody supervised reports how
// it ended and restarts (Always) once the pod is confirmed; a VM that
// cannot be adopted fails its pod (Never) with "could not re-adopt"; a pod
// caught mid-create gets its VM once confirmed; a state dir without an
// intent record has its VM killed and is removed; a pod gone from the API
// is deleted by the library's sweep.
func TestFakeVMRecovery(t *testing.T) {
	ctx := context.Background()
	stateDir := t.TempDir()
	hv := newFakeHypervisor()
	f1 := newFakeVMHarness(t, stateDir, hv, 20*time.Millisecond)
	keep := podFor("u-keep", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	gone := podFor("u-gone", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	died := podFor("u-died", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	stale := podFor("u-stale", "reg.example/os:1", corev1.RestartPolicyNever, nil)
	vms := map[types.UID]*fakeVM{}
	var recs []*podVM
	for _, p := range []*corev1.Pod{keep, gone, died, stale} {
		require.NoError(t, f1.vms.CreatePod(ctx, p))
		vms[p.UID] = nextVM(t, hv)
		f1.wait(p.UID, 10*time.Second, "Running", running)
		recs = append(recs, f1.rec(p.UID))
	}

	// A pod whose creation was interrupted after its intent record, and a
	// state dir without one holding a running VM.
	mid := podFor("u-mid", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	midDir := f1.dir(mid.UID)
	require.NoError(t, os.MkdirAll(midDir, 0o700))
	b, _ := json.Marshal(mid)
	require.NoError(t, os.WriteFile(filepath.Join(midDir, PodFileName), b, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(midDir, OverlayFileName), []byte("half-made"), 0o600))
	orphanDir := f1.dir("u-orphan")
	orphan, err := hv.Start(ctx, qemu.Spec{Name: "orphan"}, orphanDir)
	require.NoError(t, err)
	<-hv.started
	orphan.Detach()

	// "Restart" the agent: the workers stop and detach. While nobody
	// supervises, one VM dies, and one can no longer be reached.
	f1.cancel()
	for _, r := range recs {
		waitWorkerDone(t, r)
	}
	for uid, vm := range vms {
		vm.mu.Lock()
		assert.True(t, vm.detached, "%s: VM detached at shutdown", uid)
		vm.mu.Unlock()
		_, ended := vm.Exit()
		assert.False(t, ended, "%s: VM left running at shutdown", uid)
	}
	require.True(t, vms["u-died"].crash())
	hv.setAdoptErr(f1.dir(stale.UID), errors.New("QMP socket gone"))
	startsBefore, _ := hv.counts()

	f2 := newFakeVMHarness(t, stateDir, hv, 20*time.Millisecond)
	res, err := f2.vms.Recover(ctx)
	require.NoError(t, err)
	assert.Equal(t, RecoveryResult{Running: 2, Exited: 2, Pending: 1, Orphans: 1}, res)
	_, err = os.Stat(orphanDir)
	assert.True(t, os.IsNotExist(err), "orphan state dir removed")
	oex, ended := orphan.Exit()
	assert.True(t, ended, "orphan VM killed")
	assert.Equal(t, qemu.ExitKilled, oex.Class)
	for _, uid := range []types.UID{"u-keep", "u-gone"} {
		rec := f2.rec(uid)
		require.NotNil(t, rec)
		adopted := rec.vm.get()
		assert.Same(t, vms[uid], adopted, "%s: the same VM adopted", uid)
		_, ended := vms[uid].Exit()
		assert.False(t, ended, "%s: VM kept running", uid)
	}

	pods, err := f2.vms.GetPods(ctx)
	require.NoError(t, err)
	var names []string
	for _, p := range pods {
		names = append(names, p.Namespace+"/"+p.Name+"/"+string(p.UID))
	}
	assert.Equal(t, []string{"default/vm-u-died/u-died", "default/vm-u-gone/u-gone", "default/vm-u-keep/u-keep", "default/vm-u-mid/u-mid", "default/vm-u-stale/u-stale"}, names)
	for _, p := range pods {
		switch p.UID {
		case "u-keep", "u-gone":
			assert.True(t, running(p), "%s reports Running after recovery", p.Name)
		case "u-died":
			term := terminated(p)
			require.NotNil(t, term, "the VM that died while unsupervised reports how it ended: %+v", p.Status.ContainerStatuses)
			assert.Equal(t, int32(qemu.ExitCodeCrashed), term.ExitCode)
			assert.Equal(t, podstatus.ReasonError, term.Reason)
		case "u-stale":
			term := terminated(p)
			require.NotNil(t, term)
			assert.Equal(t, podstatus.ReasonStartError, term.Reason)
			assert.Contains(t, term.Message, "could not re-adopt the VM after a restart: QMP socket gone")
		}
	}
	// Nothing is started before the library shows the pods still exist.
	noVMStarted(t, hv, 100*time.Millisecond, "before any pod was confirmed")
	starts, _ := hv.counts()
	assert.Equal(t, startsBefore, starts, "recovery started no VM")

	// Restart policy Always: once the library shows the pod still exists,
	// the dead VM is restarted.
	_, err = f2.vms.GetPod(ctx, died.Namespace, died.Name)
	require.NoError(t, err)
	restarted := nextVM(t, hv)
	assert.Equal(t, f1.dir(died.UID), restarted.dir)
	p := f2.wait(died.UID, 10*time.Second, "restarted", func(p *corev1.Pod) bool { return running(p) && restarts(p) == 1 })
	assert.Equal(t, podstatus.ReasonError, p.Status.ContainerStatuses[0].LastTerminationState.Terminated.Reason)

	// The VM that could not be adopted: Never, so the pod fails and
	// nothing starts.
	_, err = f2.vms.GetPod(ctx, stale.Namespace, stale.Name)
	require.NoError(t, err)
	p = f2.wait(stale.UID, 10*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	assert.Contains(t, terminated(p).Message, "could not re-adopt")
	noVMStarted(t, hv, 100*time.Millisecond, "an unadoptable pod with restartPolicy Never")

	// The library's start-up sweep deletes the pod gone from the API; the
	// in-flight pod is confirmed and gets its VM.
	goneRec := f2.rec(gone.UID)
	require.NoError(t, f2.vms.DeletePod(ctx, gone))
	_, err = f2.vms.GetPod(ctx, mid.Namespace, mid.Name)
	require.NoError(t, err)
	midVM := nextVM(t, hv)
	assert.Equal(t, midDir, midVM.dir)
	f2.wait(mid.UID, 10*time.Second, "Running", running)
	waitWorkerDone(t, goneRec)
	_, err = os.Stat(f1.dir(gone.UID))
	assert.True(t, os.IsNotExist(err), "deleted pod's state dir removed")
	stops, _ := vms["u-gone"].stopsKills()
	assert.Equal(t, 1, stops, "the gone pod's VM was stopped")
	_, ended = vms["u-keep"].Exit()
	assert.False(t, ended, "the kept VM still runs")

	for _, p := range []*corev1.Pod{keep, mid, died} {
		f2.deleteFakePod(t, p)
	}
	// The VM that could not be adopted is killed by its pidfile
	// (qemu.KillStale), which a fake VM has not: it is the only one left.
	left := hv.runningVMs()
	require.Len(t, left, 1)
	assert.Same(t, vms["u-stale"], left[0])
	left[0].Kill()
	f2.deleteFakePod(t, stale)
	f2.assertNoHolds(t)
}

// A new pod's intent record is written by its worker, not by CreatePod
// (the library's sync workers are not held by disk writes). A record that
// cannot be written is retried while the pod waits: no VM starts before it
// is recorded, CreatePod does not fail, and the pod starts once the disk
// takes the record; a pod deleted while unrecorded goes without a VM.
func TestFakeVMRecordRetried(t *testing.T) {
	t.Run("retried until written", func(t *testing.T) {
		stateDir := t.TempDir()
		f := newFakeVMHarness(t, stateDir, newFakeHypervisor(), 50*time.Millisecond)
		pod := podFor("u-rec", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
		// A file where the pod's state dir goes: MkdirAll fails.
		require.NoError(t, os.MkdirAll(filepath.Dir(f.dir(pod.UID)), 0o700))
		require.NoError(t, os.WriteFile(f.dir(pod.UID), []byte("in the way"), 0o600))

		t0 := time.Now()
		require.NoError(t, f.vms.CreatePod(context.Background(), pod), "CreatePod does not write the record")
		assert.Less(t, time.Since(t0), 2*time.Second)
		noVMStarted(t, f.hv, 400*time.Millisecond, "unrecorded pod")
		p := f.wait(pod.UID, 5*time.Second, "waiting", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonContainerCreating })
		assert.Equal(t, corev1.PodPending, p.Status.Phase)
		evs := f.drainEvents()
		assert.True(t, hasEvent(evs, "Warning "+ReasonFailedToRecordState+" Could not record the pod on the node"), "events %q", evs)

		require.NoError(t, os.Remove(f.dir(pod.UID)))
		vm := nextVM(t, f.hv)
		assert.Equal(t, f.dir(pod.UID), vm.dir)
		f.wait(pod.UID, 5*time.Second, "Running", running)
		b, err := os.ReadFile(filepath.Join(f.dir(pod.UID), PodFileName))
		require.NoError(t, err, "the intent record is written before the VM")
		var rec corev1.Pod
		require.NoError(t, json.Unmarshal(b, &rec))
		assert.Equal(t, pod.UID, rec.UID)
		f.deleteFakePod(t, pod)
	})
	t.Run("deleted while unrecorded", func(t *testing.T) {
		stateDir := t.TempDir()
		f := newFakeVMHarness(t, stateDir, newFakeHypervisor(), 50*time.Millisecond)
		pod := podFor("u-rec-del", "reg.example/os:1", corev1.RestartPolicyAlways, map[string]string{
			"qemu-kubelet.io/reclaim-policy": "Retain", // nothing to keep: no disk was made
		})
		require.NoError(t, os.MkdirAll(filepath.Dir(f.dir(pod.UID)), 0o700))
		require.NoError(t, os.WriteFile(f.dir(pod.UID), []byte("in the way"), 0o600))
		require.NoError(t, f.vms.CreatePod(context.Background(), pod))
		f.wait(pod.UID, 5*time.Second, "waiting", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonContainerCreating })
		rec := f.rec(pod.UID)
		require.NotNil(t, rec)
		require.NoError(t, f.vms.DeletePod(context.Background(), deleting(pod)))
		waitWorkerDone(t, rec)
		assert.Nil(t, f.rec(pod.UID), "forgotten")
		assert.Equal(t, 1, f.finalDeletes(pod.UID))
		starts, _ := f.hv.counts()
		assert.Zero(t, starts, "no VM was started")
		evs := f.drainEvents()
		assert.False(t, hasEvent(evs, "Warning "+poddisk.ReasonDiskRetainFailed), "no disk to keep: %q", evs)
	})
}

// A failing liveness probe has the pod's worker kill the VM (the probes
// report, never kill): the kubelet's Killing event, one kill of that VM,
// its exit (137, killed) as the last termination, and the restart the
// policy asks for; the restarted VM, whose guest answers, keeps running.
func TestFakeVMLivenessFailureKills(t *testing.T) {
	hv := newFakeHypervisor()
	// The first VM's guest does not answer: the exec probe fails and it is
	// killed. The restarted VM's guest answers from its start (set here,
	// not once the kill is seen: the restart and its first probe may come
	// before this goroutine runs again).
	hv.guestUpFrom = 2
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-liveness", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].LivenessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"true"}}},
		PeriodSeconds: 1, TimeoutSeconds: 1, FailureThreshold: 1,
	}
	require.NoError(t, f.vms.CreatePod(context.Background(), pod))
	vm1 := nextVM(t, f.hv)
	select {
	case <-vm1.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the VM whose liveness probe fails was not killed within 10s")
	}
	vm2 := nextVM(t, f.hv)
	p := f.wait(pod.UID, 10*time.Second, "restarted", func(p *corev1.Pod) bool { return running(p) && restarts(p) == 1 })
	_, kills := vm1.stopsKills()
	assert.Equal(t, 1, kills, "the failed probe's VM was killed once")
	ex, _ := vm1.Exit()
	assert.Equal(t, qemu.ExitKilled, ex.Class)
	last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
	require.NotNil(t, last, "the killed run is the last termination")
	assert.Equal(t, int32(qemu.ExitCodeKilled), last.ExitCode)
	evs := f.drainEvents()
	assert.True(t, hasEvent(evs, "Normal Killing Container vm failed liveness probe, will be restarted"), "events %q", evs)
	assert.True(t, hasEvent(evs, "Warning Unhealthy Liveness probe failed"), "events %q", evs)
	f.deleteFakePod(t, pod)
	_, kills = vm2.stopsKills()
	assert.Zero(t, kills, "the answering VM was not killed")
	f.assertNoHolds(t)
}
