package provider

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
)

// TestResetToPodDefinitionFake: the reset a lease's end makes (the
// exporter's jumpstarter.Resetter, a reset request to the pod's worker)
// against the fake hypervisor (real qemu-img): a flashed root and bios
// and a memory size set through the exporter are dropped, the VM boots
// the pod's image again with a fresh disk, the flash dir is empty, and a
// powered-off VM is powered on. A reset of a finished pod is refused.
func TestResetToPodDefinitionFake(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img inspects flashed images")
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-reset", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	vm1 := nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	dir := f.dir(pod.UID)
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})
	memory := vm1.spec.MemoryMiB

	// The first lease flashes root and bios, grows the memory, writes to
	// its disk and leaves the VM powered off.
	require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(diskBytes(t, 1<<20)), nil))
	nextVM(t, hv)
	require.NoError(t, tgt.SetMemorySize(ctx, int64(memory/2)<<20))
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.WritePartition(ctx, "bios", bytes.NewReader(bytes.Repeat([]byte{0x55, 0xaa}, 64<<10)), nil))
	overlay := filepath.Join(dir, OverlayFileName)
	require.FileExists(t, overlay, "the flashed root's disk")
	st := vmStateFile(t, dir)
	require.Contains(t, st.Flashed, "root")
	require.Contains(t, st.Flashed, "bios")
	require.NotNil(t, st.Size)
	f.drainEvents()

	// The lease ends: reset.
	require.NoError(t, tgt.ResetTarget(ctx))
	vm := nextVM(t, hv)
	assert.NotEmpty(t, vm.spec.Kernel, "the pod's image boots again, not the flashed root")
	assert.Empty(t, vm.spec.BIOS, "the flashed bios is gone")
	assert.Equal(t, memory, vm.spec.MemoryMiB, "the pod's memory, not the lease's")
	st = vmStateFile(t, dir)
	assert.Empty(t, st.Flashed)
	assert.Empty(t, st.FlashedImage)
	assert.Nil(t, st.Size)
	assert.False(t, st.PoweredOff, "powered on")
	assert.Empty(t, flashDirFiles(t, dir), "nothing of the lease's flashes is left")
	assert.NoFileExists(t, overlay, "the pod's image (kernel and initrd) has no disk: the flashed root's is gone")
	for _, d := range vm.spec.Disks {
		assert.NotContains(t, d.Path, exporter.FlashDirName, "no disk of the lease's flashes")
	}
	assert.True(t, hasEvent(f.drainEvents(), "Normal Reset VM reset to the pod's definition"))
	f.wait(pod.UID, 10*time.Second, "Running after the reset", running)

	// A reset of a pod as it was defined resets again (a fresh disk) and
	// answers once the VM started.
	require.NoError(t, tgt.ResetTarget(ctx))
	nextVM(t, hv)
	assert.Empty(t, flashDirFiles(t, dir))
	f.deleteFakePod(t, pod)
	f.assertNoHolds(t)
}
