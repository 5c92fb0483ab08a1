package exporter

import (
	"bytes"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// runningPod is a tenantPod whose VM runs.
type runningPod struct{ *tenantPod }

func (runningPod) VM() VM { return struct{ VM }{} }

// flashedRootPod is a tenantPod whose root was flashed with base (raw)
// and whose VM ran over it: its overlay is a fresh qcow2 over base.
func flashedRootPod(t *testing.T, base []byte) (*tenantPod, string) {
	pod := newTenantPod(t)
	require.NoError(t, MakeFlashDir(pod.dir))
	basePath := filepath.Join(pod.dir, FlashDirName, "root-0123456789ab")
	require.NoError(t, os.WriteFile(basePath, base, 0o600))
	pod.state.Flashed = map[string]podstatus.FlashedPartition{
		jumpstarter.PartitionRoot: {File: "root-0123456789ab", Digest: "sha256:0123456789ab", Size: int64(len(base)), Format: "raw"}}
	require.NoError(t, os.Remove(pod.Overlay()))
	require.NoError(t, qemu.CreateOverlay(context.Background(), basePath, qemu.FormatRaw, pod.Overlay(), 0))
	return pod, basePath
}

func readAll(t *testing.T, rc io.ReadCloser, size int64) []byte {
	t.Helper()
	defer rc.Close()
	b, err := io.ReadAll(rc)
	require.NoError(t, err)
	require.Equal(t, size, int64(len(b)), "the size said")
	return b
}

// TestDumpRootIsTheDiskAsTheGuestLeftIt: dump root of a VM that is off is
// its overlay over the flashed root as one image (the bytes written
// through the overlay included, in the root's raw format); flashed:root is
// the flashed file as it was; a running VM, an overlay over another file,
// and a disk that changes during the read are refused, clearly; a pod
// whose VM has not run since the flash has no overlay and dumps the root.
func TestDumpRootIsTheDiskAsTheGuestLeftIt(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	ctx := context.Background()
	base := bytes.Repeat([]byte("flashed  root.\n\x00"), 4<<20/16)
	pod, basePath := flashedRootPod(t, base)
	out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x5a 1M 64k", pod.Overlay()).CombinedOutput()
	require.NoError(t, err, "%s", out) // what the guest wrote
	tgt := NewTarget(&Node{}, pod)

	rc, size, err := tgt.ReadPartition(ctx, jumpstarter.PartitionRoot)
	require.NoError(t, err)
	got := readAll(t, rc, size)
	want := append([]byte(nil), base...)
	copy(want[1<<20:], bytes.Repeat([]byte{0x5a}, 64<<10))
	assert.Equal(t, len(want), len(got), "raw, the virtual size")
	assert.True(t, bytes.Equal(want, got), "the guest's bytes over the flashed root")
	left, err := os.ReadDir(filepath.Join(pod.dir, FlashDirName))
	require.NoError(t, err)
	assert.Len(t, left, 1, "the converted copy is gone from the flash dir (only the flashed root): %v", left)

	rc, size, err = tgt.ReadPartition(ctx, jumpstarter.FlashedPrefix+jumpstarter.PartitionRoot)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(base, readAll(t, rc, size)), "flashed:root is what was flashed")

	_, _, err = NewTarget(&Node{}, runningPod{pod}).ReadPartition(ctx, jumpstarter.PartitionRoot)
	require.ErrorIs(t, err, ErrVMRunning)
	assert.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
	assert.Contains(t, err.Error(), "power it off first")
	rc, size, err = NewTarget(&Node{}, runningPod{pod}).ReadPartition(ctx, "flashed:root")
	require.NoError(t, err, "what was flashed can be dumped while the VM runs")
	readAll(t, rc, size)

	// The disk changes while it is read (a power on writes it): refused.
	script := filepath.Join(t.TempDir(), "qemu-img")
	require.NoError(t, os.WriteFile(script, []byte("#!/bin/sh\ntouch -d '+1 hour' "+pod.Overlay()+"\nexec "+qemu.QEMUImgBinary+" \"$@\"\n"), 0o755))
	convertTool = script
	_, _, err = tgt.ReadPartition(ctx, jumpstarter.PartitionRoot)
	convertTool = qemu.QEMUImgBinary
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the VM's disk changed while it was read")
	left, err = os.ReadDir(filepath.Join(pod.dir, FlashDirName))
	require.NoError(t, err)
	assert.Len(t, left, 1, "a failed dump leaves no file behind")

	// An overlay over a file other than the root the VM boots is not read.
	other := filepath.Join(t.TempDir(), "other.raw")
	require.NoError(t, os.WriteFile(other, []byte("a node file"), 0o600))
	require.NoError(t, os.Remove(pod.Overlay()))
	require.NoError(t, qemu.CreateOverlay(ctx, other, qemu.FormatRaw, pod.Overlay(), 0))
	_, _, err = tgt.ReadPartition(ctx, jumpstarter.PartitionRoot)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "the VM's disk was left over "+other+", not the root it boots now ("+basePath+")")

	// No run since the flash: no overlay, the root itself.
	require.NoError(t, os.Remove(pod.Overlay()))
	rc, size, err = tgt.ReadPartition(ctx, jumpstarter.PartitionRoot)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(base, readAll(t, rc, size)))
}
