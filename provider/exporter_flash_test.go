package provider

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

func diskBytes(t *testing.T, n int) []byte {
	b := make([]byte, n)
	_, err := rand.Read(b[:n/4])
	require.NoError(t, err)
	copy(b[n/2:], bytes.Repeat([]byte("partition "), n/20)) // a zero quarter stays sparse
	return b
}

func flashDirFiles(t *testing.T, dir string) []string {
	es, err := os.ReadDir(filepath.Join(dir, exporter.FlashDirName))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// TestFlashPartitionsFake: the VM as a jumpstarter.DiskTarget against the
// fake hypervisor (real qemu-img): a flashed root replaces the pod's
// kernel+initrd boot by a firmware boot of the flashed disk (the running
// VM is powered off and on for it), the pod shows it, dump returns it byte
// for byte, firmware partitions change the firmware the next start uses, a
// failed or refused flash touches nothing, the flash survives an agent
// restart, and flash_oci onto root replaces it again.
func TestFlashPartitionsFake(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img inspects flashed images")
	ctx := context.Background()
	stateDir := t.TempDir()
	hv := newFakeHypervisor()
	fw := t.TempDir()
	code, vars := filepath.Join(fw, "OVMF_CODE.fd"), filepath.Join(fw, "OVMF_VARS.fd")
	require.NoError(t, os.WriteFile(code, bytes.Repeat([]byte{0xc0}, 64<<10), 0o644))
	require.NoError(t, os.WriteFile(vars, bytes.Repeat([]byte{0xa5}, 16<<10), 0o644))
	f1 := newFakeVMHarness(t, stateDir, hv, 20*time.Millisecond)
	f1.vms.cfg.UEFICode, f1.vms.cfg.UEFIVars = code, vars
	pod := podFor("u-flash", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, f1.vms.CreatePod(ctx, pod))
	vm1 := nextVM(t, hv)
	f1.wait(pod.UID, 10*time.Second, "Running", running)
	assert.NotEmpty(t, vm1.spec.Kernel, "the pod's image boots a kernel")
	dir := f1.dir(pod.UID)
	tgt := exporter.NewTarget(f1.vms.exporterNode(), podExporter{run: f1.vms.runOf(pod.UID)})

	root := diskBytes(t, 3<<20)
	sum := sha256.Sum256(root)
	digest := "sha256:" + hex.EncodeToString(sum[:])

	t.Run("FailedFlashTouchesNothing", func(t *testing.T) {
		err := tgt.WritePartition(ctx, "root", &testutil.BrokenReader{R: bytes.NewReader(root[:1<<20]), Err: errors.New("the client's resource stream ended abnormally")}, nil)
		require.Error(t, err)
		assert.Contains(t, err.Error(), "ended abnormally")
		// qcow2 with a backing file: refused by the node's rules
		q := filepath.Join(t.TempDir(), "b.qcow2")
		out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/hostname", "-F", "raw", q).CombinedOutput()
		require.NoError(t, err, "%s", out)
		qb, err := os.ReadFile(q)
		require.NoError(t, err)
		err = tgt.WritePartition(ctx, "root", bytes.NewReader(qb), nil)
		require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "backing file")
		err = tgt.WritePartition(ctx, "bios", bytes.NewReader(qb), nil)
		require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
		assert.Contains(t, err.Error(), "holds raw firmware, not a qcow2 image")
		firmwareMaxBytes, err := tgt.PartitionLimit("bios")
		require.NoError(t, err)
		err = tgt.WritePartition(ctx, "bios", bytes.NewReader(make([]byte, firmwareMaxBytes+1)), nil)
		require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
		_, err = tgt.PartitionLimit("boot")
		require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)

		assert.Empty(t, flashDirFiles(t, dir), "no temporary file left")
		_, ended := vm1.Exit()
		assert.False(t, ended, "the VM kept running")
		assert.Empty(t, vmStateFile(t, dir).Flashed)
		noVMStarted(t, hv, 100*time.Millisecond, "a failed flash restarts nothing")
	})

	t.Run("FlashRootWhileRunning", func(t *testing.T) {
		var lines []string
		require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(root), func(l string) { lines = append(lines, l) }))
		assert.Contains(t, strings.Join(lines, "\n"), "received 3145728 bytes (raw, "+digest+")")
		_, ended := vm1.Exit()
		assert.True(t, ended, "powered off for the switch")
		vm2 := nextVM(t, hv)
		assert.Empty(t, vm2.spec.Kernel, "a flashed root boots through the firmware")
		assert.Equal(t, qemu.FirmwareBIOS, vm2.spec.Firmware)
		require.NotEmpty(t, vm2.spec.Disks)
		info, err := qemu.InspectImage(ctx, vm2.spec.Disks[0].Path)
		require.NoError(t, err)
		assert.Equal(t, filepath.Join(dir, exporter.FlashDirName, "root-"+digest[7:19]), info.BackingFile, "the disk is an overlay of the flashed root")
		p := f1.wait(pod.UID, 10*time.Second, "Running flashed", running)
		assert.Equal(t, "flash/root@"+digest, p.Status.ContainerStatuses[0].ImageID, "the pod shows what it boots")
		st := vmStateFile(t, dir)
		assert.Equal(t, podstatus.FlashedPartition{File: "root-" + digest[7:19], Digest: digest, Size: 3 << 20, Format: "raw"}, st.Flashed["root"])
		assert.True(t, hasEvent(f1.drainEvents(), "Normal Flashed Partition root replaced"))

		rc, size, err := tgt.ReadPartition(ctx, "flashed:root") // root: refused while the VM runs
		require.NoError(t, err)
		back, err := io.ReadAll(rc)
		rc.Close()
		require.NoError(t, err)
		assert.Equal(t, int64(len(root)), size)
		assert.True(t, bytes.Equal(root, back), "dump returns the flashed bytes")
		fi, err := os.Stat(filepath.Join(dir, exporter.FlashDirName, st.Flashed["root"].File))
		require.NoError(t, err)
		assert.Equal(t, int64(3<<20), fi.Size())
	})

	t.Run("FirmwarePartitions", func(t *testing.T) {
		require.NoError(t, tgt.PowerOff(ctx))
		bios := bytes.Repeat([]byte{0x55, 0xaa}, 128<<10)
		require.NoError(t, tgt.WritePartition(ctx, "bios", bytes.NewReader(bios), nil))
		noVMStarted(t, hv, 100*time.Millisecond, "flashing a powered-off VM leaves it off")
		require.NoError(t, tgt.PowerOn(ctx))
		vm := nextVM(t, hv)
		assert.Equal(t, qemu.FirmwareBIOS, vm.spec.Firmware)
		assert.Equal(t, filepath.Join(dir, exporter.FlashDirName, vmStateFile(t, dir).Flashed["bios"].File), vm.spec.BIOS)

		// OVMF vars flashed: UEFI with the node's code and the flashed vars.
		newVars := bytes.Repeat([]byte{0x77}, 16<<10)
		require.NoError(t, tgt.WritePartition(ctx, "OVMF_VARS.fd", bytes.NewReader(newVars), nil))
		vm = nextVM(t, hv)
		assert.Equal(t, qemu.FirmwareUEFI, vm.spec.Firmware)
		assert.Equal(t, code, vm.spec.UEFICode)
		assert.Equal(t, filepath.Join(dir, exporter.FlashDirName, vmStateFile(t, dir).Flashed["OVMF_VARS.fd"].File), vm.spec.UEFIVarsTemplate)
		assert.Empty(t, vm.spec.BIOS)
		assert.Empty(t, vm.spec.Kernel)

		rc, _, err := tgt.ReadPartition(ctx, "OVMF_CODE.fd")
		require.NoError(t, err)
		b, _ := io.ReadAll(rc)
		rc.Close()
		assert.Equal(t, 64<<10, len(b), "not flashed: the node's OVMF code")
		rc, _, err = tgt.ReadPartition(ctx, "OVMF_VARS.fd")
		require.NoError(t, err)
		b, _ = io.ReadAll(rc)
		rc.Close()
		assert.True(t, bytes.Equal(newVars, b))
	})

	t.Run("ReflashRootRemovesOld", func(t *testing.T) {
		before := vmStateFile(t, dir).Flashed["root"].File
		root2 := diskBytes(t, 1<<20)
		require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(root2), nil))
		nextVM(t, hv)
		after := vmStateFile(t, dir).Flashed["root"].File
		assert.NotEqual(t, before, after)
		files := flashDirFiles(t, dir)
		assert.NotContains(t, files, before, "the replaced file is gone")
		assert.Contains(t, files, after)
		assert.Len(t, files, 3, "root, bios, OVMF vars: %v", files)
		root = root2
	})

	t.Run("SurvivesAgentRestart", func(t *testing.T) {
		rec := f1.rec(pod.UID)
		f1.cancel()
		waitWorkerDone(t, rec)
		f2 := newFakeVMHarness(t, stateDir, hv, 20*time.Millisecond)
		f2.vms.cfg.UEFICode, f2.vms.cfg.UEFIVars = code, vars
		_, err := f2.vms.Recover(ctx)
		require.NoError(t, err)
		_, err = f2.vms.GetPod(ctx, pod.Namespace, pod.Name) // the library confirms the pod
		require.NoError(t, err)
		tgt2 := exporter.NewTarget(f2.vms.exporterNode(), podExporter{run: f2.vms.runOf(pod.UID)})
		require.NoError(t, tgt2.PowerOff(ctx))
		require.NoError(t, tgt2.PowerOn(ctx))
		vm := nextVM(t, hv)
		assert.Empty(t, vm.spec.Kernel)
		info, err := qemu.InspectImage(ctx, vm.spec.Disks[0].Path)
		require.NoError(t, err)
		assert.Equal(t, filepath.Join(dir, exporter.FlashDirName, vmStateFile(t, dir).Flashed["root"].File), info.BackingFile)
		rc, _, err := tgt2.ReadPartition(ctx, "flashed:root")
		require.NoError(t, err)
		b, _ := io.ReadAll(rc)
		rc.Close()
		assert.True(t, bytes.Equal(root, b), "the flashed root after the restart")

		// flash_oci onto root: the OCI image boots again, the flashed file goes.
		require.NoError(t, tgt2.Flash(ctx, "reg.example/os:2", nil))
		vm = nextVM(t, hv)
		assert.NotEmpty(t, vm.spec.Kernel, "the OCI image's kernel boots")
		st := vmStateFile(t, dir)
		assert.NotContains(t, st.Flashed, "root")
		assert.Contains(t, st.FlashedImage, "reg.example/os@sha256:")
		assert.Len(t, flashDirFiles(t, dir), 2, "bios and OVMF vars stay")
		f2.deleteFakePod(t, pod)
	})
}

// TestFlashRootWithinEphemeralStorageLimit: a pod's ephemeral-storage
// limit bounds its flashed root as it bounds set_disk_size: an image (or a
// qcow2's virtual size) over it is refused and leaves nothing behind.
func TestFlashRootWithinEphemeralStorageLimit(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img inspects flashed images")
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-flash-lim", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Resources.Limits = corev1.ResourceList{corev1.ResourceEphemeralStorage: resource.MustParse("4Mi")}
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	dir := f.dir(pod.UID)
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})

	lim, err := tgt.PartitionLimit("root")
	require.NoError(t, err)
	assert.Equal(t, int64(4<<20), lim)
	fwLim, err := tgt.PartitionLimit("bios")
	require.NoError(t, err)
	assert.Equal(t, int64(16<<20), fwLim, "firmware partitions keep their own bound")

	err = tgt.WritePartition(ctx, "root", bytes.NewReader(diskBytes(t, 5<<20)), nil)
	require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
	assert.Contains(t, err.Error(), "larger than the partition may hold (4194304 bytes:")

	q := filepath.Join(t.TempDir(), "big.qcow2")
	out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", q, "64M").CombinedOutput()
	require.NoError(t, err, "%s", out)
	qb, err := os.ReadFile(q)
	require.NoError(t, err)
	require.Less(t, len(qb), 4<<20, "the qcow2 file itself is small")
	err = tgt.WritePartition(ctx, "root", bytes.NewReader(qb), nil)
	require.ErrorIs(t, err, jumpstarter.ErrInvalidArgument)
	assert.Contains(t, err.Error(), "virtual size (67108864 bytes) is larger than the partition may hold (4194304 bytes")

	assert.Empty(t, flashDirFiles(t, dir), "nothing left behind")
	assert.Empty(t, vmStateFile(t, dir).Flashed)

	require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(diskBytes(t, 3<<20)), nil), "an image within the limit is flashed")
	assert.Contains(t, vmStateFile(t, dir).Flashed, "root")
}

// TestFlashedRootCountsInEphemeralStorage: the stats summary's pod
// ephemeral storage is what the pod's state dir holds, so a flashed root
// (which replaces the overlay) counts there with the blocks it allocated.
func TestFlashedRootCountsInEphemeralStorage(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img inspects flashed images")
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-flash-du", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	used := func() int64 {
		t.Helper()
		for _, ps := range f.vms.samplePods() {
			if ps.Pod.UID == pod.UID {
				require.NotNil(t, ps.Disk, "the pod's disk usage is sampled")
				return ps.Disk.Used
			}
		}
		t.Fatalf("pod %s not sampled", pod.UID)
		return 0
	}
	before := used()
	img := diskBytes(t, 8<<20) // a quarter of it zeros: a hole in the flashed file
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})
	require.NoError(t, tgt.WritePartition(ctx, "root", bytes.NewReader(img), nil))
	nextVM(t, hv) // powered on again on the flashed root
	f.wait(pod.UID, 10*time.Second, "Running", running)
	grown := used() - before
	assert.GreaterOrEqual(t, grown, int64(6<<20), "the flashed root's allocated blocks count")
	assert.Less(t, grown, int64(8<<20), "its hole does not")
}
