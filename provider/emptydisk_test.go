package provider

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// TestEmptyDiskFlashAndResetFake: a pod of the empty-disk image against
// the fake hypervisor (real qemu-img) boots a sparse qcow2 of its
// ephemeral-storage under the firmware, with nothing pulled or held; a
// stop of it (a flash's, a shutdown's, a delete's) quits QEMU at once; a
// flash of root replaces it; a reset returns to it; the disk size check,
// a dump and a flashed:root read see it.
func TestEmptyDiskFlashAndResetFake(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img makes the empty disk and its overlay")
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-empty", v1alpha1.EmptyDiskImage, corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Resources.Requests = podtest.RL("ephemeral-storage", "32Mi")
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	vm1 := nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	dir := f.dir(pod.UID)
	empty := filepath.Join(dir, exporter.EmptyDiskFileName)
	overlay := filepath.Join(dir, OverlayFileName)
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})

	// The empty disk: 32 MiB of qcow2 under the overlay, no kernel.
	assertBoots := func(vm *fakeVM, base, what string) {
		t.Helper()
		assert.Empty(t, vm.spec.Kernel, "%s: booted by the firmware", what)
		require.NotEmpty(t, vm.spec.Disks, what)
		assert.Equal(t, overlay, vm.spec.Disks[0].Path, what)
		info, err := qemu.InspectImage(ctx, overlay)
		require.NoError(t, err)
		assert.Equal(t, base, info.BackingFile, "%s: the overlay's base", what)
	}
	assertBoots(vm1, empty, "first start")
	info, err := qemu.InspectImage(ctx, empty)
	require.NoError(t, err)
	assert.Equal(t, "qcow2", info.Format)
	assert.Equal(t, int64(32<<20), info.VirtualSize)
	assert.Less(t, info.ActualSize, int64(32<<20), "sparse")
	st := vmStateFile(t, dir)
	assert.True(t, strings.HasPrefix(st.ImageID, v1alpha1.EmptyDiskImage+"@sha256:"), st.ImageID)
	pulls, holds, _ := f.imgs.counts()
	assert.Zero(t, pulls, "nothing pulled for an empty disk")
	assert.Zero(t, holds, "nothing of the store held")

	// The disk size check sees the empty disk's size.
	err = tgt.SetDiskSize(ctx, 16<<20)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "Shrinking disk is not supported")

	// A flash of root replaces it; the flash's stop is at once.
	require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(diskBytes(t, 1<<20)), nil))
	vm2 := nextVM(t, hv)
	require.NotEmpty(t, vm1.stopOptions())
	assert.True(t, vm1.stopOptions()[0].NoACPI, "the empty disk's VM is quit at once, no ACPI wait")
	st = vmStateFile(t, dir)
	require.Contains(t, st.Flashed, "root")
	assertBoots(vm2, filepath.Join(dir, exporter.FlashDirName, st.Flashed["root"].File), "flashed root")
	assert.False(t, exporter.BootsEmptyDisk(st), "a flashed root is not the empty disk")

	// A reset returns to the empty disk.
	require.NoError(t, tgt.ResetTarget(ctx))
	vm3 := nextVM(t, hv)
	assertBoots(vm3, empty, "after the reset")
	st = vmStateFile(t, dir)
	assert.Empty(t, st.Flashed)
	assert.True(t, exporter.BootsEmptyDisk(st), st.ImageID)
	f.wait(pod.UID, 10*time.Second, "Running after the reset", running)

	// A shutdown (the graceful power off) quits at once too.
	require.NoError(t, tgt.Shutdown(ctx))
	require.NotEmpty(t, vm3.stopOptions())
	assert.True(t, vm3.stopOptions()[0].NoACPI, "shutdown of the empty disk's VM: at once")

	// A dump and a flashed:root read are the empty disk.
	for _, part := range []string{"root", "flashed:root"} {
		rc, _, err := tgt.ReadPartition(ctx, part)
		require.NoError(t, err, part)
		out := filepath.Join(t.TempDir(), "dump")
		b, err := io.ReadAll(rc)
		rc.Close()
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(out, b, 0o600))
		info, err := qemu.InspectImage(ctx, out)
		require.NoError(t, err, part)
		assert.Equal(t, int64(32<<20), info.VirtualSize, part)
	}

	// A delete quits at once.
	require.NoError(t, tgt.PowerOn(ctx))
	vm4 := nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running after power on", running)
	f.drainEvents()
	f.deleteFakePod(t, pod)
	require.NotEmpty(t, vm4.stopOptions())
	assert.True(t, vm4.stopOptions()[0].NoACPI, "delete of the empty disk's VM: at once")
	assert.True(t, hasEvent(f.drainEvents(), "Normal Killing Stopping VM at once (it boots an empty disk"))
	pulls, _, _ = f.imgs.counts()
	assert.Zero(t, pulls)
	f.assertNoHolds(t)
}
