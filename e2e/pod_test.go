package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/e2e/cluster"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// podEnv is what the pod scenarios share: one control plane, one registry
// holding the test OS images (pushed with oras), one qemu-kubelet node
// running VMs under TCG.
type podEnv struct {
	c    *cluster.Cluster
	a    *nodeAgent
	refs map[string]string
	reg  string
}

// TestPods runs pods as real VMs (QEMU TCG) on a qemu-kubelet node of a real
// control plane, booted from OS images in a real registry.
func TestPods(t *testing.T) {
	prebuild(t, kubeletPkg) // under way while the control plane starts
	c := cluster.StartT(t, cluster.Options{})
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	refs := vmtest.PushTestImages(t, reg.Addr)
	bin := buildQemuKubelet(t)
	e := &podEnv{c: c, refs: refs, reg: reg.Addr}
	a := newNodeAgent(t, c, bin, "qk-vms", "tcg", armNodeConfig(t, e, "qk-vms")) // arch_test.go
	e.a = a
	// Runs before the agent is killed (cleanups are LIFO): delete every pod
	// so their VMs stop; then fail if any QEMU is left.
	vmtest.ReapQEMU(t, a.dir)
	t.Cleanup(func() { deleteAllPods(t, c, "default", a.dir) })
	a.start()
	waitNode(t, c, a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))

	t.Run("BootsRunningAndDeletesGracefully", e.testBootAndDelete)
	t.Run("Arm64GuestOnArm64Node", e.testArm64Guest)
	t.Run("ACPIIgnoringGuestKilledAtGrace", e.testForcedStop)
	t.Run("MissingImageBacksOff", e.testMissingImage)
	t.Run("GuestPowerOffCompletes", e.testPowerOff)
	t.Run("GuestPowerOffRestartsAlways", e.testPowerOffAlways)
	t.Run("GuestPanicFails", e.testPanic)
	t.Run("KilledQEMURestarts", e.testKillRestart)
	t.Run("RefusedPods", e.testRefused)
	t.Run("JumpstarterExporter", e.testJumpstarter)
	t.Run("StatePolicyRetainSurvivesRebootAndRestart", e.testStatePolicy) // state_test.go
	t.Run("NodeRestartKeepsVMs", e.testNodeRestart)
	t.Run("NoExecuteTaintAndDrainEvict", e.testEvict)
}

func (e *podEnv) create(t *testing.T, p *corev1.Pod) *corev1.Pod {
	t.Helper()
	got, err := e.c.Client().CoreV1().Pods(p.Namespace).Create(context.Background(), p, metav1.CreateOptions{})
	require.NoError(t, err)
	return got
}

func (e *podEnv) testBootAndDelete(t *testing.T) {
	ctx := context.Background()
	rec := recordPod(t, e.c, "default", "boot")
	p := e.create(t, vmPodSpec("boot", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Running", podRunning)
	assert.NoError(t, containsSeq(rec.seen(), "Pending/ContainerCreating", "Running/Running"))
	cs := p.Status.ContainerStatuses[0]
	assert.False(t, cs.State.Running.StartedAt.IsZero())
	assert.True(t, cs.Ready)
	assert.Equal(t, "qemu://"+string(p.UID), cs.ContainerID)
	assert.Contains(t, cs.ImageID, "@sha256:")
	assert.Equal(t, e.a.ip, p.Status.PodIP)

	out, err := e.c.Kubectl(ctx, "get", "pod", p.Name, "-o", "wide")
	require.NoError(t, err)
	row := wideRow(t, out, p.Name)
	assert.Equal(t, "Running", row["STATUS"], out)
	assert.Equal(t, "1/1", row["READY"], out)
	assert.Equal(t, e.a.name, row["NODE"], out)
	assert.Equal(t, e.a.ip, row["IP"], out)

	dir := e.a.vmDir(string(p.UID))
	waitFileContains(t, filepath.Join(dir, qemu.ConsoleLogName), vmtest.BootMarker, 90*time.Second)
	require.Len(t, vmtest.QEMUPids(dir), 1)

	// The node reports the cached image.
	n := waitNode(t, e.c, e.a.name, 30*time.Second, "image listed", func(n *corev1.Node) bool {
		for _, im := range n.Status.Images {
			for _, name := range im.Names {
				if strings.HasPrefix(name, e.reg+"/"+vmtest.Repo) {
					return true
				}
			}
		}
		return false
	})
	assert.NotZero(t, n.Status.Images[0].SizeBytes)
	out, err = e.c.Kubectl(ctx, "describe", "node", e.a.name)
	require.NoError(t, err)
	assertDescribeNodeLists(t, out, "default", p.Name, "100m", "64Mi")

	// A status overwritten by someone else (Ready=False, as the node
	// lifecycle controller writes when the node's lease lapses) is written
	// back by the node though its VM never changed (kubelet status resync).
	cur, err := e.c.Client().CoreV1().Pods("default").Get(ctx, p.Name, metav1.GetOptions{})
	require.NoError(t, err)
	for i := range cur.Status.Conditions {
		if cur.Status.Conditions[i].Type == corev1.PodReady {
			cur.Status.Conditions[i].Status, cur.Status.Conditions[i].Reason = corev1.ConditionFalse, "NodeNotReady"
		}
	}
	_, err = e.c.Client().CoreV1().Pods("default").UpdateStatus(ctx, cur, metav1.UpdateOptions{})
	require.NoError(t, err)
	waitPod(t, e.c, "default", p.Name, 30*time.Second, "Ready written back", func(p *corev1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				return c.Status == corev1.ConditionTrue
			}
		}
		return false
	})

	// Delete: the ACPI guest powers off within the grace period; the pod
	// leaves the API server without waiting for the grace period to end.
	start := time.Now()
	_, err = e.c.Kubectl(ctx, "delete", "pod", p.Name, "--wait=true", "--timeout=60s")
	require.NoError(t, err)
	t.Logf("delete took %s", time.Since(start).Round(time.Millisecond))
	assert.Contains(t, rec.seen(), "Succeeded/Completed", "terminal status after an ACPI power-off: %v", rec.seen())
	waitNoDir(t, dir, 30*time.Second)
}

func (e *podEnv) testMissingImage(t *testing.T) {
	rec := recordPod(t, e.c, "default", "missing")
	p := e.create(t, vmPodSpec("missing", e.a.name, e.reg+"/qemu-kubelet/does-not-exist:1", corev1.RestartPolicyAlways, nil))
	p = waitPod(t, e.c, "default", p.Name, 60*time.Second, "ImagePullBackOff", func(p *corev1.Pod) bool {
		return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Waiting != nil &&
			p.Status.ContainerStatuses[0].State.Waiting.Reason == "ImagePullBackOff"
	})
	assert.Equal(t, corev1.PodPending, p.Status.Phase)
	w := p.Status.ContainerStatuses[0].State.Waiting
	assert.Contains(t, w.Message, "not found")
	assert.Contains(t, w.Message, "does-not-exist")
	assert.NoError(t, containsSeq(rec.seen(), "Pending/ErrImagePull", "Pending/ImagePullBackOff"))
	out, err := e.c.Kubectl(context.Background(), "get", "events", "--field-selector", "involvedObject.name=missing")
	require.NoError(t, err)
	assert.Contains(t, out, "Failed to pull image")

	// Fixing the image (a new pod) works.
	fixed := e.create(t, vmPodSpec("fixed", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	fixed = waitPod(t, e.c, "default", fixed.Name, 120*time.Second, "Running", podRunning)
	e.waitBooted(t, fixed)

	zero := int64(0)
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), p.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}))
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), fixed.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 30*time.Second)
	waitPodGone(t, e.c, "default", fixed.Name, 60*time.Second)
	waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
	waitNoDir(t, e.a.vmDir(string(fixed.UID)), 30*time.Second)
}

func (e *podEnv) testPowerOff(t *testing.T) {
	p := e.create(t, vmPodSpec("poweroff", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyNever,
		map[string]string{"qemu-kubelet.io/kernel-cmdline": vmtest.PoweroffCmdline}))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Succeeded", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodSucceeded })
	term := podTerminated(p)
	require.NotNil(t, term)
	assert.Equal(t, int32(0), term.ExitCode)
	assert.Equal(t, "Completed", term.Reason)
	assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount)
	assert.Empty(t, vmtest.QEMUPids(e.a.vmDir(string(p.UID))))
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 30*time.Second)
	waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
}

func (e *podEnv) testPanic(t *testing.T) {
	p := e.create(t, vmPodSpec("panic", e.a.name, e.refs[vmtest.VariantPanic], corev1.RestartPolicyNever, nil))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	term := podTerminated(p)
	require.NotNil(t, term)
	assert.Equal(t, "GuestPanicked", term.Reason)
	assert.Equal(t, int32(qemu.ExitCodePanicked), term.ExitCode)
	assert.Contains(t, term.Message, "panic")
	b, _ := os.ReadFile(filepath.Join(e.a.vmDir(string(p.UID)), qemu.ConsoleLogName))
	assert.Contains(t, string(b), vmtest.PanicMarker)
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 30*time.Second)
	waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
}

func (e *podEnv) testKillRestart(t *testing.T) {
	p := e.create(t, vmPodSpec("crashy", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Running", podRunning)
	dir := e.a.vmDir(string(p.UID))
	pids := vmtest.QEMUPids(dir)
	require.Len(t, pids, 1)
	require.NoError(t, syscall.Kill(pids[0], syscall.SIGKILL))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "restartCount 1 and Running", func(p *corev1.Pod) bool {
		return podRunning(p) && p.Status.ContainerStatuses[0].RestartCount == 1
	})
	last := p.Status.ContainerStatuses[0].LastTerminationState.Terminated
	require.NotNil(t, last)
	assert.Equal(t, "Error", last.Reason)
	assert.NotZero(t, last.ExitCode)
	newPids := vmtest.QEMUPids(dir)
	require.Len(t, newPids, 1)
	assert.NotEqual(t, pids[0], newPids[0])
	e.waitBooted(t, p)
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(context.Background(), p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 60*time.Second)
	waitNoDir(t, dir, 30*time.Second)
}

func (e *podEnv) testRefused(t *testing.T) {
	ctx := context.Background()
	bad := vmPodSpec("with-init", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{"qemu-kubelet.io/cpus": "4"})
	bad.Spec.InitContainers = []corev1.Container{{Name: "init", Image: "busybox"}}
	bad = e.create(t, bad)
	got := waitPod(t, e.c, "default", bad.Name, 60*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	assert.Equal(t, "UnsupportedPodSpec", got.Status.Reason)
	assert.Contains(t, got.Status.Message, "spec.initContainers")
	assert.Contains(t, got.Status.Message, "qemu-kubelet.io/cpus")
	_, err := os.Stat(e.a.vmDir(string(bad.UID)))
	assert.True(t, os.IsNotExist(err), "nothing created for a refused pod")

	// Bound directly (no scheduler), larger than the node: OutOfcpu.
	big := vmPodSpec("too-big", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)
	big.Spec.NodeSelector = nil
	big.Spec.NodeName = e.a.name
	big.Spec.Containers[0].Resources.Requests[corev1.ResourceCPU] = resource.MustParse("64")
	big.Spec.Containers[0].Resources.Limits[corev1.ResourceCPU] = resource.MustParse("64")
	big = e.create(t, big)
	got = waitPod(t, e.c, "default", big.Name, 60*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	assert.Equal(t, "OutOfcpu", got.Status.Reason)
	assert.Contains(t, got.Status.Message, "Node didn't have enough resource: cpu")
	out, err := e.c.Kubectl(ctx, "get", "pod", big.Name)
	require.NoError(t, err)
	assert.Contains(t, out, "OutOfcpu")

	// Requires KVM on this TCG node.
	kvm := e.create(t, vmPodSpec("needs-kvm", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, map[string]string{"qemu-kubelet.io/accelerator": "kvm"}))
	got = waitPod(t, e.c, "default", kvm.Name, 60*time.Second, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	assert.Equal(t, "KVMUnavailable", got.Status.Reason)

	for _, n := range []string{bad.Name, big.Name, kvm.Name} {
		require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, n, metav1.DeleteOptions{}))
	}
	for _, n := range []string{bad.Name, big.Name, kvm.Name} {
		waitPodGone(t, e.c, "default", n, 30*time.Second)
	}
}

func (e *podEnv) testNodeRestart(t *testing.T) {
	ctx := context.Background()
	// An image only reachable through a proxy that stalls its first blob
	// download: its pod is mid-creation (pulling) when qemu-kubelet dies.
	proxy := ocitest.NewProxy(t, e.reg)
	slowRef := vmtest.PushVariant(t, e.reg, "inflight", vmtest.VariantACPI, "qk.inflight=1")
	slowRef = proxy.Addr + strings.TrimPrefix(slowRef, e.reg)
	proxy.AddFault(&ocitest.Fault{Match: "/blobs/", CutAfter: 1, Stall: true})

	// Three VMs run through the restart; a fourth pod is deleted while
	// qemu-kubelet is down.
	var keeps []*corev1.Pod
	for _, n := range []string{"keep-a", "keep-b", "keep-c"} {
		keeps = append(keeps, e.create(t, vmPodSpec(n, e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil)))
	}
	gone := e.create(t, vmPodSpec("gone", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	keepPids := map[string][]int{}
	startedAt := map[string]metav1.Time{}
	for i, k := range keeps {
		keeps[i] = waitPod(t, e.c, "default", k.Name, 120*time.Second, "Running", podRunning)
		keepPids[k.Name] = vmtest.QEMUPids(e.a.vmDir(string(k.UID)))
		require.Len(t, keepPids[k.Name], 1, k.Name)
		startedAt[k.Name] = keeps[i].Status.ContainerStatuses[0].State.Running.StartedAt
	}
	gone = waitPod(t, e.c, "default", gone.Name, 120*time.Second, "Running", podRunning)
	e.waitBooted(t, gone) // so that its guest honours the power button later
	inflight := e.create(t, vmPodSpec("inflight", e.a.name, slowRef, corev1.RestartPolicyAlways, nil))
	waitPod(t, e.c, "default", inflight.Name, 60*time.Second, "pulling", func(p *corev1.Pod) bool {
		return len(p.Status.ContainerStatuses) == 1 && p.Status.ContainerStatuses[0].State.Waiting != nil &&
			p.Status.ContainerStatuses[0].State.Waiting.Reason == "ContainerCreating"
	})
	// The manifest came through (requests are recorded when they end); the
	// first blob download is now held open by the proxy.
	require.Eventually(t, func() bool { return hasGet(proxy.Requests(), "/manifests/") }, 30*time.Second, 100*time.Millisecond, "the pull reached the registry")
	time.Sleep(500 * time.Millisecond)
	_, err := os.Stat(filepath.Join(e.a.vmDir(string(inflight.UID)), "pod.json"))
	require.NoError(t, err, "the intent record of the pod being created is on disk")
	require.Len(t, vmtest.QEMUPids(e.a.dir), 4, "3 kept VMs + the one to delete run; none for the pod being created")

	// kill -9 qemu-kubelet mid-creation; while it is down, delete one pod
	// for good.
	_ = e.a.kill(syscall.SIGKILL)
	zero := int64(0)
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, gone.Name, metav1.DeleteOptions{GracePeriodSeconds: &zero}))
	waitPodGone(t, e.c, "default", gone.Name, 30*time.Second)
	assert.Len(t, vmtest.QEMUPids(e.a.vmDir(string(gone.UID))), 1, "its VM runs on while qemu-kubelet is down")
	for _, k := range keeps {
		assert.Equal(t, keepPids[k.Name], vmtest.QEMUPids(e.a.vmDir(string(k.UID))), k.Name)
	}

	restarted := time.Now()
	e.a.start()
	waitNode(t, e.c, e.a.name, 90*time.Second, "Ready=True", readyIs(corev1.ConditionTrue))
	// The deleted pod's VM is stopped and cleaned up.
	waitNoDir(t, e.a.vmDir(string(gone.UID)), 90*time.Second)
	t.Logf("restart: VM of the pod deleted while down cleaned up after %s", time.Since(restarted).Round(time.Millisecond))
	// The kept pods' VMs were adopted: same QEMU processes, still Running.
	for _, k := range keeps {
		p := waitPod(t, e.c, "default", k.Name, 30*time.Second, "Running", podRunning)
		assert.Equal(t, keepPids[k.Name], vmtest.QEMUPids(e.a.vmDir(string(k.UID))), "%s: same QEMU pid after the restart", k.Name)
		assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].RestartCount, k.Name)
		st := startedAt[k.Name]
		assert.True(t, st.Equal(&p.Status.ContainerStatuses[0].State.Running.StartedAt), "%s: startedAt unchanged", k.Name)
	}
	// The pod that was being created resumes (the stall fault was one-shot)
	// and runs; exactly one QEMU for it.
	inflight = waitPod(t, e.c, "default", inflight.Name, 120*time.Second, "Running", podRunning)
	t.Logf("restart: in-flight pod Running after %s", time.Since(restarted).Round(time.Millisecond))
	inflightPids := vmtest.QEMUPids(e.a.vmDir(string(inflight.UID)))
	require.Len(t, inflightPids, 1)
	e.waitBooted(t, inflight)
	// Nothing orphaned: exactly the 4 QEMUs of the live pods run under the
	// node's dir, and exactly their 4 state dirs exist.
	want := []int{inflightPids[0]}
	wantDirs := []string{string(inflight.UID)}
	for _, k := range keeps {
		want = append(want, keepPids[k.Name]...)
		wantDirs = append(wantDirs, string(k.UID))
	}
	assert.ElementsMatch(t, want, vmtest.QEMUPids(e.a.dir), "QEMU processes under the node's dir")
	ents, err := os.ReadDir(filepath.Dir(e.a.vmDir("x")))
	require.NoError(t, err)
	var dirs []string
	for _, d := range ents {
		dirs = append(dirs, d.Name())
	}
	assert.ElementsMatch(t, wantDirs, dirs, "VM state dirs")
	// The provider lists exactly the node's pods.
	out, err := e.c.Kubectl(ctx, "get", "--raw", "/api/v1/nodes/"+e.a.name+"/proxy/runningpods/")
	require.NoError(t, err)
	var l corev1.PodList
	require.NoError(t, json.Unmarshal([]byte(out), &l), out)
	var listed []string
	for _, p := range l.Items {
		listed = append(listed, string(p.UID))
	}
	assert.ElementsMatch(t, wantDirs, listed, out)

	all := append([]*corev1.Pod{inflight}, keeps...)
	for _, p := range all {
		require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, p.Name, metav1.DeleteOptions{}))
	}
	for _, p := range all {
		waitPodGone(t, e.c, "default", p.Name, 60*time.Second)
		waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
	}
}

func (e *podEnv) testEvict(t *testing.T) {
	ctx := context.Background()
	p := e.create(t, vmPodSpec("tainted", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Running", podRunning)
	// A guest honours the power button once booted (acpid running).
	waitFileContains(t, filepath.Join(e.a.vmDir(string(p.UID)), qemu.ConsoleLogName), vmtest.BootMarker, 90*time.Second)
	rec := recordPod(t, e.c, "default", p.Name)
	_, err := e.c.Kubectl(ctx, "taint", "node", e.a.name, "e2e/evict=now:NoExecute")
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = e.c.Kubectl(context.Background(), "taint", "node", e.a.name, "e2e/evict:NoExecute-") })
	waitPodGone(t, e.c, "default", p.Name, 90*time.Second)
	waitNoDir(t, e.a.vmDir(string(p.UID)), 30*time.Second)
	assert.Contains(t, rec.seen(), "Succeeded/Completed", "graceful ACPI power-off on eviction: %v", rec.seen())
	_, err = e.c.Kubectl(ctx, "taint", "node", e.a.name, "e2e/evict:NoExecute-")
	require.NoError(t, err)

	d := e.create(t, vmPodSpec("drained", e.a.name, e.refs[vmtest.VariantACPI], corev1.RestartPolicyAlways, nil))
	d = waitPod(t, e.c, "default", d.Name, 120*time.Second, "Running", podRunning)
	waitFileContains(t, filepath.Join(e.a.vmDir(string(d.UID)), qemu.ConsoleLogName), vmtest.BootMarker, 90*time.Second)
	rec = recordPod(t, e.c, "default", d.Name)
	t.Cleanup(func() { _, _ = e.c.Kubectl(context.Background(), "uncordon", e.a.name) })
	out, err := e.c.Kubectl(ctx, "drain", e.a.name, "--force", "--ignore-daemonsets", "--timeout=90s")
	require.NoError(t, err, out)
	waitPodGone(t, e.c, "default", d.Name, 30*time.Second)
	waitNoDir(t, e.a.vmDir(string(d.UID)), 30*time.Second)
	assert.Contains(t, rec.seen(), "Succeeded/Completed", "graceful ACPI power-off on drain: %v", rec.seen())
	_, err = e.c.Kubectl(ctx, "uncordon", e.a.name)
	require.NoError(t, err)
}

func (e *podEnv) testForcedStop(t *testing.T) {
	ctx := context.Background()
	spec := vmPodSpec("stubborn", e.a.name, e.refs[vmtest.VariantNoACPI], corev1.RestartPolicyAlways, nil)
	grace := int64(6)
	spec.Spec.TerminationGracePeriodSeconds = &grace
	p := e.create(t, spec)
	p = waitPod(t, e.c, "default", p.Name, 120*time.Second, "Running", podRunning)
	dir := e.a.vmDir(string(p.UID))
	waitFileContains(t, filepath.Join(dir, qemu.ConsoleLogName), vmtest.BootMarker, 90*time.Second)
	rec := recordPod(t, e.c, "default", p.Name)
	start := time.Now()
	require.NoError(t, e.c.Client().CoreV1().Pods("default").Delete(ctx, p.Name, metav1.DeleteOptions{}))
	waitPodGone(t, e.c, "default", p.Name, 60*time.Second)
	took := time.Since(start)
	t.Logf("forced stop took %s", took.Round(time.Millisecond))
	assert.GreaterOrEqual(t, took, 2*time.Second, "the guest got its ACPI budget before QEMU was stopped")
	assert.Contains(t, rec.seen(), "Failed/Error", "terminal status of a forced stop: %v", rec.seen())
	waitNoDir(t, dir, 30*time.Second)
}

// waitBooted waits for the boot marker on the pod's console: from then on
// the guest honours the ACPI power button.
func (e *podEnv) waitBooted(t *testing.T, p *corev1.Pod) {
	t.Helper()
	waitFileContains(t, filepath.Join(e.a.vmDir(string(p.UID)), qemu.ConsoleLogName), vmtest.BootMarker, 90*time.Second)
}

func hasGet(reqs []ocitest.Request, part string) bool {
	for _, r := range reqs {
		if r.Method == "GET" && strings.Contains(r.Path, part) {
			return true
		}
	}
	return false
}
