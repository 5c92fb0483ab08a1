package provider

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"
)

// harness runs a VMs provider against a real registry, image store and QEMU
// (TCG), recording every status it pushes.
type harness struct {
	t        testing.TB
	vms      *VMs
	cancel   context.CancelFunc
	stateDir string
	// events holds the pod events, "Type Reason Message" (buffered).
	events *record.FakeRecorder

	mu   sync.Mutex
	last map[types.UID]*corev1.Pod
	seen map[types.UID][]string // waiting reasons / phases seen, in order
}

func newHarness(t testing.TB, stateDir string, store ImageStore, imageDir string) *harness {
	return newHarnessWith(t, stateDir, store, imageDir, nil)
}

// newHarnessWith lets mutate change the provider's configuration.
func newHarnessWith(t testing.TB, stateDir string, store ImageStore, imageDir string, mutate func(*VMsConfig)) *harness {
	ctx, cancel := context.WithCancel(context.Background())
	h := &harness{t: t, cancel: cancel, stateDir: stateDir, last: map[types.UID]*corev1.Pod{}, seen: map[types.UID][]string{}, events: record.NewFakeRecorder(1000)}
	cfg := VMsConfig{
		Recorder: h.events,
		NodeName: "n1", NodeIP: "10.1.2.3", StateDir: stateDir, Accelerator: "tcg",
		Images: store, ImageDir: imageDir,
		Allocatable:      func() corev1.ResourceList { return podtest.RL("cpu", "8", "memory", "8Gi", "pods", "10") },
		Backoff:          podstatus.Backoff{Initial: time.Second, Max: 4 * time.Second},
		ErrImagePullHold: 300 * time.Millisecond,
	}
	if mutate != nil {
		mutate(&cfg)
	}
	h.vms = NewVMs(ctx, cfg)
	h.vms.NotifyPods(ctx, func(p *corev1.Pod) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.last[p.UID] = p
		tag := string(p.Status.Phase)
		if len(p.Status.ContainerStatuses) > 0 {
			cs := p.Status.ContainerStatuses[0]
			switch {
			case cs.State.Waiting != nil:
				tag += "/" + cs.State.Waiting.Reason
			case cs.State.Running != nil:
				tag += "/Running"
			case cs.State.Terminated != nil:
				tag += "/" + cs.State.Terminated.Reason
			}
		}
		s := h.seen[p.UID]
		if len(s) == 0 || s[len(s)-1] != tag {
			h.seen[p.UID] = append(s, tag)
		}
	})
	t.Cleanup(cancel)
	return h
}

func (h *harness) wait(uid types.UID, timeout time.Duration, what string, ok func(*corev1.Pod) bool) *corev1.Pod {
	h.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		h.mu.Lock()
		p := h.last[uid]
		seen := append([]string(nil), h.seen[uid]...)
		h.mu.Unlock()
		if p != nil && ok(p) {
			return p
		}
		if time.Now().After(deadline) {
			h.t.Fatalf("pod %s: waiting for %s: statuses seen %v; last %+v\n%s", uid, what, seen, lastState(p), h.diagnose(uid))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// diagnose describes the pod's VM for a failed wait: vmtest.Diagnose of its
// state dir, and QEMU's run state (QMP query-status) while the provider
// holds a running VM for it.
func (h *harness) diagnose(uid types.UID) string {
	d := vmtest.Diagnose(filepath.Join(h.stateDir, VMsDirName, string(uid)))
	rec := h.rec(uid)
	if rec == nil {
		return d + "QMP: the provider holds no run for the pod\n"
	}
	vm := rec.vm.get()
	if vm == nil {
		return d + "QMP: the provider holds no VM for the pod\n"
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var st struct {
		Running bool   `json:"running"`
		Status  string `json:"status"`
	}
	if err := vm.QMP(ctx, "query-status", nil, &st); err != nil {
		return d + fmt.Sprintf("QMP query-status (pid %d): %v\n", vm.Pid(), err)
	}
	return d + fmt.Sprintf("QMP query-status (pid %d): status %q running %t\n", vm.Pid(), st.Status, st.Running)
}

// drainEvents returns the events recorded since the last call.
func (h *harness) drainEvents() []string { return drainEvents(h.events) }

func (h *harness) seenTags(uid types.UID) []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.seen[uid]...)
}

func lastState(p *corev1.Pod) any {
	if p == nil || len(p.Status.ContainerStatuses) == 0 {
		return nil
	}
	return p.Status.ContainerStatuses[0]
}

func running(p *corev1.Pod) bool {
	return p.Status.Phase == corev1.PodRunning && len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Running != nil
}

func terminated(p *corev1.Pod) *corev1.ContainerStateTerminated {
	if len(p.Status.ContainerStatuses) == 0 {
		return nil
	}
	return p.Status.ContainerStatuses[0].State.Terminated
}

func podFor(uid, image string, policy corev1.RestartPolicy, ann map[string]string) *corev1.Pod {
	grace := int64(20)
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "vm-" + uid, UID: types.UID(uid), Annotations: ann},
		Spec: corev1.PodSpec{
			NodeName: "n1", RestartPolicy: policy, TerminationGracePeriodSeconds: &grace,
			Containers: []corev1.Container{{Name: "vm", Image: image, Resources: corev1.ResourceRequirements{Limits: podtest.RL("cpu", "1", "memory", "256Mi")}}},
		},
	}
}

func waitConsole(t testing.TB, dir, marker string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		b, _ := os.ReadFile(filepath.Join(dir, qemu.ConsoleLogName))
		if strings.Contains(string(b), marker) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("console of %s: no %q within %s; console:\n%s", dir, marker, timeout, b)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func waitGoneDir(t testing.TB, dir string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if _, err := os.Stat(dir); os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			ents, _ := os.ReadDir(dir)
			t.Fatalf("state dir %s still there after %s: %v", dir, timeout, ents)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func deleting(p *corev1.Pod) *corev1.Pod {
	p = p.DeepCopy()
	now := metav1.Now()
	p.DeletionTimestamp = &now
	p.DeletionGracePeriodSeconds = p.Spec.TerminationGracePeriodSeconds
	return p
}

// vmEnv is what a test booting VM pods needs: a registry holding the test
// images, an image store and a state dir, under one temp root whose
// QEMUs are reaped at the end.
type vmEnv struct {
	root, imageDir, stateDir string
	reg                      *ocitest.Registry
	refs                     map[string]string
	store                    *oci.Store
}

func newVMEnv(t testing.TB) *vmEnv {
	t.Helper()
	e := &vmEnv{root: t.TempDir()}
	vmtest.ReapQEMU(t, e.root)
	e.reg = ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	e.refs = vmtest.PushTestImages(t, e.reg.Addr)
	e.imageDir, e.stateDir = filepath.Join(e.root, "images"), filepath.Join(e.root, "state")
	store, err := oci.Open(e.imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	e.store = store
	return e
}

// TestVMLifecycle drives pods through the provider against a real
// docker-registry holding the test OS images (pushed with oras), a real
// image store and real QEMU under TCG.
func TestVMLifecycle(t *testing.T) {
	env := newVMEnv(t)
	root, refs, store, imageDir, stateDir := env.root, env.refs, env.store, env.imageDir, env.stateDir
	h := newHarness(t, stateDir, store, imageDir)
	ctx := context.Background()

	t.Run("BootsRunsAndStopsGracefully", func(t *testing.T) {
		pod := podFor("u-acpi", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		h.drainEvents()
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		p := h.wait(pod.UID, 90*time.Second, "Running", running)
		evs := strings.Join(h.drainEvents(), "\n")
		assert.Contains(t, evs, "Normal Pulling Pulling image", "first use of the image pulls it")
		assert.Contains(t, evs, "Normal Pulled Successfully pulled image")
		cs := p.Status.ContainerStatuses[0]
		assert.False(t, cs.State.Running.StartedAt.IsZero())
		assert.True(t, cs.Ready)
		assert.Equal(t, "qemu://u-acpi", cs.ContainerID)
		assert.Contains(t, cs.ImageID, "@sha256:")
		assert.Equal(t, "10.1.2.3", p.Status.PodIP)
		assert.Equal(t, "Pending/ContainerCreating", h.seenTags(pod.UID)[0])
		dir := filepath.Join(stateDir, VMsDirName, "u-acpi")
		waitConsole(t, dir, vmtest.BootMarker, 60*time.Second)
		require.Len(t, vmtest.QEMUPids(dir), 1)
		// The image is in use: listed with a user.
		imgs := store.List()
		require.NotEmpty(t, imgs)

		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)), "repeated delete is safe")
		p = h.wait(pod.UID, 60*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
		term := terminated(p)
		assert.Equal(t, int32(0), term.ExitCode, "ACPI guest powers off: %+v", term)
		assert.Equal(t, podstatus.ReasonCompleted, term.Reason)
		waitGoneDir(t, dir, 10*time.Second)
		assert.Empty(t, vmtest.QEMUPids(dir))
		_, err := h.vms.GetPod(ctx, pod.Namespace, pod.Name)
		assert.Error(t, err, "deleted pod is forgotten")
	})

	t.Run("MissingImageBacksOff", func(t *testing.T) {
		pod := podFor("u-missing", env.reg.Addr+"/qemu-kubelet/nope:1", corev1.RestartPolicyAlways, nil)
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		p := h.wait(pod.UID, 30*time.Second, "ImagePullBackOff", func(p *corev1.Pod) bool {
			w := p.Status.ContainerStatuses[0].State.Waiting
			return w != nil && w.Reason == podstatus.ReasonImagePullBackOff
		})
		assert.Equal(t, corev1.PodPending, p.Status.Phase)
		assert.Contains(t, p.Status.ContainerStatuses[0].State.Waiting.Message, "not found")
		t.Logf("ImagePullBackOff message: %s", p.Status.ContainerStatuses[0].State.Waiting.Message)
		tags := h.seenTags(pod.UID)
		assert.Contains(t, tags, "Pending/ErrImagePull")
		// Backs off and retries: ErrImagePull shows again.
		h.wait(pod.UID, 30*time.Second, "second ErrImagePull", func(*corev1.Pod) bool {
			n := 0
			for _, s := range h.seenTags(pod.UID) {
				if s == "Pending/ErrImagePull" {
					n++
				}
			}
			return n >= 2
		})
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		h.wait(pod.UID, 10*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-missing"), 10*time.Second)
	})

	t.Run("GuestPowerOffNeverCompletes", func(t *testing.T) {
		pod := podFor("u-off", refs[vmtest.VariantACPI], corev1.RestartPolicyNever, map[string]string{podspec.AnnotationKernelCmdline: vmtest.PoweroffCmdline})
		h.drainEvents()
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		h.wait(pod.UID, 90*time.Second, "started", func(p *corev1.Pod) bool { return p.Status.Phase != corev1.PodPending })
		// The image is cached by now: the kubelet's single Pulled event.
		evs := strings.Join(h.drainEvents(), "\n")
		assert.Contains(t, evs, "Normal Pulled Container image \""+refs[vmtest.VariantACPI]+"\" already present on machine")
		assert.NotContains(t, evs, "Pulling", "no Pulling event for a cached image")
		p := h.wait(pod.UID, 90*time.Second, "Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
		term := terminated(p)
		require.NotNil(t, term)
		assert.Equal(t, int32(0), term.ExitCode)
		assert.Equal(t, podstatus.ReasonCompleted, term.Reason)
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount)
		assert.Contains(t, h.seenTags(pod.UID), "Running/Running")
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-off"), 10*time.Second)
	})

	t.Run("GuestPanicFails", func(t *testing.T) {
		pod := podFor("u-panic", refs[vmtest.VariantPanic], corev1.RestartPolicyNever, nil)
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		p := h.wait(pod.UID, 90*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
		term := terminated(p)
		require.NotNil(t, term)
		assert.Equal(t, podstatus.ReasonGuestPanicked, term.Reason)
		assert.Equal(t, int32(qemu.ExitCodePanicked), term.ExitCode)
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-panic"), 10*time.Second)
	})

	t.Run("KilledQEMURestartsWithAlways", func(t *testing.T) {
		pod := podFor("u-kill", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		h.wait(pod.UID, 90*time.Second, "Running", running)
		dir := filepath.Join(stateDir, VMsDirName, "u-kill")
		pids := vmtest.QEMUPids(dir)
		require.Len(t, pids, 1)
		require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
		p := h.wait(pod.UID, 60*time.Second, "restarted", func(p *corev1.Pod) bool {
			return running(p) && p.Status.ContainerStatuses[0].RestartCount == 1
		})
		last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
		require.NotNil(t, last)
		assert.NotEqual(t, int32(0), last.ExitCode)
		assert.Equal(t, podstatus.ReasonError, last.Reason)
		newPids := vmtest.QEMUPids(dir)
		require.Len(t, newPids, 1)
		assert.NotEqual(t, pids[0], newPids[0])

		// A second crash soon after: CrashLoopBackOff (1s here), then the
		// second restart.
		require.NoError(t, syscall.Kill(newPids[0], syscall.SIGKILL))
		p = h.wait(pod.UID, 60*time.Second, "second restart", func(p *corev1.Pod) bool {
			return running(p) && p.Status.ContainerStatuses[0].RestartCount == 2
		})
		assert.Contains(t, h.seenTags(pod.UID), "Running/CrashLoopBackOff")
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, dir, 60*time.Second)
	})

	t.Run("SameNameNewUIDWhileStopping", func(t *testing.T) {
		old := podFor("u-r1", refs[vmtest.VariantNoACPI], corev1.RestartPolicyAlways, nil)
		old.Name = "vm-same"
		grace := int64(3)
		old.Spec.TerminationGracePeriodSeconds = &grace
		require.NoError(t, h.vms.CreatePod(ctx, old))
		h.wait(old.UID, 90*time.Second, "Running", running)
		require.NoError(t, h.vms.DeletePod(ctx, deleting(old)))
		// The old VM ignores ACPI and is still stopping: the name is free.
		_, err := h.vms.GetPod(ctx, "default", "vm-same")
		require.Error(t, err, "a stopping pod is not returned by name")
		repl := podFor("u-r2", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		repl.Name = "vm-same"
		require.NoError(t, h.vms.CreatePod(ctx, repl))
		h.wait(repl.UID, 90*time.Second, "Running", running)
		got, err := h.vms.GetPod(ctx, "default", "vm-same")
		require.NoError(t, err)
		assert.Equal(t, repl.UID, got.UID)
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-r1"), 30*time.Second)
		require.NoError(t, h.vms.DeletePod(ctx, deleting(repl)))
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-r2"), 60*time.Second)
	})

	t.Run("NotAdmitted", func(t *testing.T) {
		pod := podFor("u-big", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		pod.Spec.Containers[0].Resources.Requests = podtest.RL("cpu", "16")
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		p := h.wait(pod.UID, 5*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
		assert.Equal(t, "OutOfcpu", p.Status.Reason)
		bad := podFor("u-bad", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		bad.Spec.InitContainers = []corev1.Container{{Name: "init", Image: "busybox"}}
		require.NoError(t, h.vms.CreatePod(ctx, bad))
		p = h.wait(bad.UID, 5*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
		assert.Equal(t, podspec.ReasonUnsupportedPodSpec, p.Status.Reason)
		assert.Contains(t, p.Status.Message, "spec.initContainers")
		_, err := os.Stat(filepath.Join(stateDir, VMsDirName, "u-bad"))
		assert.True(t, os.IsNotExist(err), "nothing created for a rejected pod")
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		require.NoError(t, h.vms.DeletePod(ctx, deleting(bad)))
		h.wait(bad.UID, 5*time.Second, "gone", func(*corev1.Pod) bool {
			_, err := h.vms.GetPod(ctx, bad.Namespace, bad.Name)
			return err != nil
		})
	})

	t.Run("ImageGCKeepsImagesInUse", func(t *testing.T) {
		for _, v := range []string{vmtest.VariantNoACPI, vmtest.VariantPanic} {
			_, err := store.Pull(ctx, refs[v], oci.PullOptions{})
			require.NoError(t, err)
		}
		pod := podFor("u-gc", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		require.NoError(t, h.vms.CreatePod(ctx, pod))
		h.wait(pod.UID, 90*time.Second, "Running", running)
		type ev struct{ typ, reason, msg string }
		var events []ev
		gc := nodestatus.ImageGC{Store: store, Policy: oci.GCPolicy{MaxBytes: 1}, Event: func(typ, reason, msg string) { events = append(events, ev{typ, reason, msg}) }}
		res, err := gc.Once(ctx)
		require.NoError(t, err)
		assert.Len(t, res.Removed, 2, "the two unused images go")
		assert.Equal(t, 1, res.KeptInUse)
		require.Len(t, events, 2)
		assert.Equal(t, nodestatus.ReasonImagesRemoved, events[0].reason)
		assert.Contains(t, events[0].msg, "removed 2 unused image(s)")
		assert.Equal(t, nodestatus.ReasonFreeDiskSpaceFailed, events[1].reason)
		assert.Equal(t, corev1.EventTypeWarning, events[1].typ)
		imgs := store.List()
		require.Len(t, imgs, 1)
		assert.Contains(t, imgs[0].Names, refs[vmtest.VariantACPI])
		require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-gc"), 60*time.Second)
	})

	t.Run("RecoveryKillsUnreachableQEMU", func(t *testing.T) {
		sd := filepath.Join(root, "state-stale")
		dir := filepath.Join(sd, VMsDirName, "u-stale")
		pod := podFor("u-stale", refs[vmtest.VariantACPI], corev1.RestartPolicyNever, nil)
		require.NoError(t, os.MkdirAll(dir, 0o700))
		b, _ := json.Marshal(pod)
		require.NoError(t, os.WriteFile(filepath.Join(dir, PodFileName), b, 0o600))
		img, err := store.Pull(ctx, refs[vmtest.VariantACPI], oci.PullOptions{})
		require.NoError(t, err)
		vm, err := qemu.Start(ctx, qemu.Spec{Name: "stale", CPUs: 1, MemoryMiB: 128, Kernel: img.Kernel, Initrd: img.Initrd, Cmdline: img.Cmdline, AllowedDirs: []string{imageDir}}, dir)
		require.NoError(t, err)
		vm.Detach()
		require.NoError(t, os.Remove(filepath.Join(dir, qemu.QMPSocketName))) // alive, unreachable
		require.Len(t, vmtest.QEMUPids(dir), 1)

		h3 := newHarness(t, sd, store, imageDir)
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		res, err := h3.vms.Recover(rctx)
		cancel()
		require.NoError(t, err)
		assert.Equal(t, RecoveryResult{Exited: 1}, res)
		assert.Empty(t, vmtest.QEMUPids(dir), "the unreachable QEMU was killed")
		_, err = h3.vms.GetPod(ctx, pod.Namespace, pod.Name)
		require.NoError(t, err)
		term := h3.wait(pod.UID, 10*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
		assert.Contains(t, terminated(term).Message, "could not re-adopt")
		require.NoError(t, h3.vms.DeletePod(ctx, deleting(pod)))
		waitGoneDir(t, dir, 10*time.Second)
	})

	t.Run("RestartRecovery", func(t *testing.T) {
		keep := podFor("u-keep", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		gone := podFor("u-gone", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		died := podFor("u-died", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		for _, p := range []*corev1.Pod{keep, gone, died} {
			require.NoError(t, h.vms.CreatePod(ctx, p))
		}
		for _, p := range []*corev1.Pod{keep, gone, died} {
			h.wait(p.UID, 90*time.Second, "Running", running)
		}
		diedDir := filepath.Join(stateDir, VMsDirName, "u-died")
		keepDir := filepath.Join(stateDir, VMsDirName, "u-keep")
		goneDir := filepath.Join(stateDir, VMsDirName, "u-gone")
		pid := vmtest.QEMUPids(keepDir)
		require.Len(t, pid, 1)

		// A pod whose creation was interrupted after its intent record,
		// and a state dir without one holding a running QEMU.
		mid := podFor("u-mid", refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
		midDir := filepath.Join(stateDir, VMsDirName, "u-mid")
		require.NoError(t, os.MkdirAll(midDir, 0o700))
		b, _ := json.Marshal(mid)
		require.NoError(t, os.WriteFile(filepath.Join(midDir, PodFileName), b, 0o600))
		require.NoError(t, os.WriteFile(filepath.Join(midDir, OverlayFileName), []byte("half-made"), 0o600))
		orphanDir := filepath.Join(stateDir, VMsDirName, "u-orphan")
		img, err := store.Pull(ctx, refs[vmtest.VariantACPI], oci.PullOptions{})
		require.NoError(t, err)
		ovm, err := qemu.Start(ctx, qemu.Spec{Name: "orphan", CPUs: 1, MemoryMiB: 128, Kernel: img.Kernel, Initrd: img.Initrd, Cmdline: img.Cmdline, AllowedDirs: []string{imageDir}}, orphanDir)
		require.NoError(t, err)
		orphanPid := ovm.Pid()
		ovm.Detach()

		// "Restart" qemu-kubelet: the old workers stop and detach. While
		// nobody supervises, one VM dies.
		h.cancel()
		time.Sleep(200 * time.Millisecond)
		diedPid := vmtest.QEMUPids(diedDir)
		require.Len(t, diedPid, 1)
		require.NoError(t, syscall.Kill(diedPid[0], syscall.SIGKILL))
		require.Eventually(t, func() bool { return len(vmtest.QEMUPids(diedDir)) == 0 }, 10*time.Second, 50*time.Millisecond)
		h2 := newHarness(t, stateDir, store, imageDir)
		res, err := h2.vms.Recover(ctx)
		require.NoError(t, err)
		assert.Equal(t, RecoveryResult{Running: 2, Exited: 1, Pending: 1, Orphans: 1}, res)
		assert.Equal(t, pid, vmtest.QEMUPids(keepDir), "the VM kept running: same QEMU pid")
		_, err = os.Stat(orphanDir)
		assert.True(t, os.IsNotExist(err), "orphan state dir removed")
		assert.Empty(t, vmtest.QEMUPids(orphanDir), "orphan QEMU %d killed", orphanPid)

		pods, err := h2.vms.GetPods(ctx)
		require.NoError(t, err)
		var names []string
		for _, p := range pods {
			names = append(names, p.Namespace+"/"+p.Name+"/"+string(p.UID))
		}
		assert.Equal(t, []string{"default/vm-u-died/u-died", "default/vm-u-gone/u-gone", "default/vm-u-keep/u-keep", "default/vm-u-mid/u-mid"}, names)
		for _, p := range pods {
			switch p.UID {
			case "u-keep", "u-gone":
				assert.True(t, running(p), "%s reports Running after recovery", p.Name)
			case "u-died":
				term := terminated(p)
				require.NotNil(t, term, "the VM that died while unsupervised reports how it ended: %+v", p.Status.ContainerStatuses)
				assert.NotZero(t, term.ExitCode)
			}
		}
		// Restart policy Always: once the library shows the pod still
		// exists, the dead VM is restarted.
		_, err = h2.vms.GetPod(ctx, died.Namespace, died.Name)
		require.NoError(t, err)
		h2.wait(died.UID, 90*time.Second, "restarted", func(p *corev1.Pod) bool {
			return running(p) && p.Status.ContainerStatuses[0].RestartCount == 1
		})

		// The library's start-up sweep deletes the pod gone from the API;
		// the in-flight pod is confirmed (GetPod) and gets its VM.
		require.NoError(t, h2.vms.DeletePod(ctx, gone))
		_, err = h2.vms.GetPod(ctx, mid.Namespace, mid.Name)
		require.NoError(t, err)
		h2.wait(mid.UID, 90*time.Second, "Running", running)
		waitGoneDir(t, goneDir, 60*time.Second)
		assert.Empty(t, vmtest.QEMUPids(goneDir))
		assert.Equal(t, pid, vmtest.QEMUPids(keepDir))

		for _, p := range []*corev1.Pod{keep, mid, died} {
			require.NoError(t, h2.vms.DeletePod(ctx, deleting(p)))
		}
		waitGoneDir(t, keepDir, 60*time.Second)
		waitGoneDir(t, midDir, 60*time.Second)
		waitGoneDir(t, diedDir, 60*time.Second)
	})
}
