package provider

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
)

// TestEmptyDiskBootsFirmware: a pod of the empty-disk image under real
// QEMU (TCG) boots its empty disk through the firmware: SeaBIOS finds
// nothing to boot and halts in its own code (CS is the BIOS segment f000,
// the CPU halted), QEMU running; nothing is pulled into the store. A
// delete quits it at once.
func TestEmptyDiskBootsFirmware(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	root := t.TempDir()
	vmtest.ReapQEMU(t, root)
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	stateDir := filepath.Join(root, "state")
	h := newHarness(t, stateDir, store, imageDir)
	ctx := context.Background()

	pod := podFor("u-empty-vm", v1alpha1.EmptyDiskImage, corev1.RestartPolicyNever, nil)
	pod.Spec.Containers[0].Resources.Limits["ephemeral-storage"] = podtest.RL("ephemeral-storage", "64Mi")["ephemeral-storage"]
	require.NoError(t, h.vms.CreatePod(ctx, pod))
	h.wait(pod.UID, 2*time.Minute, "Running", running)
	vm := h.podVMOf(pod.UID)

	var regs string
	deadline := time.Now().Add(3 * time.Minute)
	for {
		var status struct {
			Running bool   `json:"running"`
			Status  string `json:"status"`
		}
		require.NoError(t, vm.QMP(ctx, "query-status", nil, &status))
		require.True(t, status.Running, "QEMU runs the VM: %+v", status)
		require.NoError(t, vm.QMP(ctx, "human-monitor-command", map[string]string{"command-line": "info registers"}, &regs))
		if strings.Contains(regs, "CS =f000") && strings.Contains(regs, "HLT=1") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the firmware never halted with nothing to boot within 3m; registers:\n%s", regs)
		}
		time.Sleep(time.Second)
	}
	assert.Empty(t, store.List(), "nothing pulled into the store for an empty disk")

	t0 := time.Now()
	require.NoError(t, h.vms.DeletePod(ctx, deleting(pod)))
	h.wait(pod.UID, 90*time.Second, "terminated", func(p *corev1.Pod) bool { return terminated(p) != nil })
	t.Logf("deleted in %s (grace %ds: no ACPI wait)", time.Since(t0).Round(time.Millisecond), *pod.Spec.TerminationGracePeriodSeconds)
	waitGoneDir(t, filepath.Join(stateDir, VMsDirName, "u-empty-vm"), 30*time.Second)
}
