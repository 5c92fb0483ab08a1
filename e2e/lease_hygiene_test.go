package e2e

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/jstest"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// seaBIOS is a firmware a lease flashes: Debian's SeaBIOS, which boots
// the test image's kernel as QEMU's own does.
const seaBIOS = "/usr/share/seabios/bios-256k.bin"

// TestExporterSetLeaseHygiene runs two leases in sequence on one pod of a
// Jumpstarter-mode set with recyclePolicy Reuse (real control plane,
// controller, node, TCG VMs, the test Jumpstarter): the first lease
// flashes the bios, sets a smaller memory size and writes a token in the
// guest (kubectl exec). With the lease state policy Reset (the default)
// the second lease, on the same pod, sees the set's definition: no
// flashed firmware, the template's memory, the set's image, no token (the
// guest booted again), a VM that boots and serves its console and HTTP
// port; the exporter went through AFTER_LEASE_HOOK between them. With
// Keep, the second lease sees what the first left, the token included
// (the guest kept running). Both sets have an afterLease hook whose exec
// step writes a file in the guest (through qemu-guest-agent, after the
// reset's boot): the second lease finds it.
func TestExporterSetLeaseHygiene(t *testing.T) {
	testutil.SkipIfShort(t, "a control plane, a node and TCG VMs")
	if _, err := os.Stat(seaBIOS); err != nil {
		t.Skipf("no SeaBIOS to flash (%v): install the seabios package", err)
	}
	e := startExsEnv(t)
	js := e.jumpstarter(t)
	t.Run("Reset", func(t *testing.T) { e.testLeaseHygiene(t, js, "hyg-reset", v1alpha1.LeaseStatePolicyReset) })
	t.Run("Keep", func(t *testing.T) { e.testLeaseHygiene(t, js, "hyg-keep", v1alpha1.LeaseStatePolicyKeep) })
}

func (e *exsEnv) testLeaseHygiene(t *testing.T, js *jsEnv, name string, policy v1alpha1.LeaseStatePolicy) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	set := e.jsSet(name, 1, 0, js)
	set.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
	set.Spec.Jumpstarter.LeaseStatePolicy = policy
	hookMark := "qk-hook-" + name
	set.Spec.Jumpstarter.Hooks = &v1alpha1.LeaseHooks{AfterLease: &v1alpha1.LeaseHook{
		Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookExec, Command: []string{"/bin/sh", "-c", "echo " + hookMark + " > /tmp/qk-after-lease"}}},
		// the reset's boot under TCG on a loaded machine, then the agent
		Timeout: int32((2 * vmBoot).Seconds()), OnFailure: v1alpha1.LeaseHookEndLease}}
	k := &kubectlEnv{t: t, c: e.c}
	sel := set.Spec.Jumpstarter.ExporterLabels
	e.createSet(t, set)
	defer e.deleteSet(t, name)
	_, pods := e.waitSet(t, name, 2*vmBoot, "one Ready VM with an Online exporter", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		if len(ps) != 1 || !podReady(&ps[0]) {
			return false
		}
		st, ok := js.ctl.ExporterState(e.ns, ps[0].Name)
		return ok && st.Online && st.Status == pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE
	})
	pod := pods[0]
	defined := e.vmSpec(t, pod)
	require.Empty(t, defined.BIOS, "the set's VM boots QEMU's own firmware")
	require.Equal(t, 256, defined.MemoryMiB, "the template's memory limit")

	// Lease 1: a smaller memory and a flashed bios (the flash restarts
	// the VM with both).
	js.createLease(t, e.ns, name+"-1", sel)
	l1 := js.waitLease(t, e.ns, name+"-1", time.Minute, "Ready", leaseReady)
	require.Equal(t, pod.Name, leaseExporter(l1))
	sess, err := js.client.Dial(ctx, name+"-1")
	require.NoError(t, err)
	rep, err := sess.GetReport(ctx)
	require.NoError(t, err)
	root, _ := jstest.FindDriver(rep, "")
	flasher, ok := jstest.FindDriver(rep, "flasher")
	require.True(t, ok)
	_, err = sess.Call(ctx, root.Uuid, "set_memory_size", "192M")
	require.NoError(t, err)
	fw, err := os.Open(seaBIOS)
	require.NoError(t, err)
	require.NoError(t, sess.Flash(ctx, flasher.Uuid, fw, "bios", ""))
	fw.Close()
	sess.Close()
	// A token in the guest the flash booted (its guest agent answers once
	// the guest is up).
	token := "qk-token-" + string(pod.UID)
	k.eventually(2*vmBoot, token, "-n", e.ns, "exec", pod.Name, "--", "/bin/sh", "-c", "echo "+token+" > /tmp/qk-token && cat /tmp/qk-token")
	flashed := e.vmSpec(t, pod)
	assert.Contains(t, flashed.BIOS, "flash", "the first lease boots its flashed bios")
	assert.Equal(t, 192, flashed.MemoryMiB)
	js.release(t, e.ns, name+"-1")
	js.waitLease(t, e.ns, name+"-1", time.Minute, "ended", leaseEnded)

	// Lease 2 on the same pod (Reuse).
	js.createLease(t, e.ns, name+"-2", sel)
	l2 := js.waitLease(t, e.ns, name+"-2", 2*vmBoot, "Ready", leaseReady)
	require.Equal(t, pod.Name, leaseExporter(l2), "Reuse: the same pod")
	st, _ := js.ctl.ExporterState(e.ns, pod.Name)
	_, pods = e.waitSet(t, name, 2*vmBoot, "the leased VM Ready", func(_ *v1alpha1.ExporterSet, ps []corev1.Pod) bool {
		return len(ps) == 1 && podReady(&ps[0])
	})
	require.Equal(t, pod.UID, pods[0].UID, "Reuse: the same pod")
	seen := e.vmSpec(t, pod)
	assert.True(t, slices.Contains(st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK), "the first lease's end ran the hook: %v", st.StatusHistory)
	assert.NotContains(t, st.StatusHistory, pb.ExporterStatus_EXPORTER_STATUS_AFTER_LEASE_HOOK_FAILED, "the hook passed: %s", st.StatusMessage)
	// The afterLease hook's exec step wrote its file in the guest the
	// second lease gets (after the reset's boot with Reset).
	k.eventually(2*vmBoot, hookMark, "-n", e.ns, "exec", pod.Name, "--", "cat", "/tmp/qk-after-lease")
	out, err := k.run("-n", e.ns, "exec", pod.Name, "--", "cat", "/tmp/qk-token")
	if policy == v1alpha1.LeaseStatePolicyKeep {
		require.NoError(t, err, "Keep: the first lease's token is still in the guest: %s", out)
		assert.Contains(t, out, token, "Keep: the first lease's token")
		assert.Equal(t, flashed.BIOS, seen.BIOS, "Keep: the first lease's firmware")
		assert.Equal(t, 192, seen.MemoryMiB, "Keep: the first lease's memory")
	} else {
		require.Error(t, err, "Reset: the guest booted again, without the first lease's token: %s", out)
		assert.Contains(t, out, "No such file", "Reset: no token file in the guest")
		assert.NotContains(t, out, token)
		assert.Empty(t, seen.BIOS, "Reset: the set's firmware, not the flashed bios")
		assert.Equal(t, defined.MemoryMiB, seen.MemoryMiB, "Reset: the set's memory")
		assert.Equal(t, defined.Kernel, seen.Kernel, "Reset: the set's image")
		e.waitPodEvent(t, pod.Name, "Reset", "reset to the pod's definition", 30*time.Second)
	}
	assert.Equal(t, set.Spec.Template.Spec.Containers[0].Image, pods[0].Status.ContainerStatuses[0].Image, "the set's image")
	// The VM serves the second lease: console and guest HTTP.
	e.driveVM(t, js, name+"-2")
	js.release(t, e.ns, name+"-2")
	js.waitLease(t, e.ns, name+"-2", time.Minute, "ended", leaseEnded)
}

// vmSpec is the qemu.Spec the pod's VM was last started with (its
// spec.json in the node's state dir).
func (e *exsEnv) vmSpec(t *testing.T, p corev1.Pod) qemu.Spec {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(e.stateDir, "vms", string(p.UID), "spec.json"))
	require.NoError(t, err)
	var s qemu.Spec
	require.NoError(t, json.Unmarshal(b, &s))
	return s
}
