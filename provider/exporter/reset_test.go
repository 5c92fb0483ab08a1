package exporter

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// A reset under the state policy Retain keeps the disk when nothing
// changed what it is over; a flash or a disk size does not keep it.
func TestResetKeepsDisk(t *testing.T) {
	root := map[string]podstatus.FlashedPartition{"root": {File: "root-1"}}
	bios := map[string]podstatus.FlashedPartition{"bios": {File: "bios-1"}}
	for _, c := range []struct {
		name   string
		policy v1alpha1.StatePolicy
		st     podstatus.VMState
		want   bool
	}{
		{"Disabled: fresh", v1alpha1.StatePolicyDisabled, podstatus.VMState{}, false},
		{"unset: fresh", "", podstatus.VMState{}, false},
		{"Retain: kept", v1alpha1.StatePolicyRetain, podstatus.VMState{}, true},
		{"Retain, flashed bios only: kept", v1alpha1.StatePolicyRetain, podstatus.VMState{Flashed: bios}, true},
		{"Retain, memory size: kept", v1alpha1.StatePolicyRetain, podstatus.VMState{Size: &podstatus.VMSize{MemoryBytes: 1 << 30}}, true},
		{"Retain, flashed image: fresh", v1alpha1.StatePolicyRetain, podstatus.VMState{FlashedImage: "reg/os@sha256:1"}, false},
		{"Retain, flashed root: fresh", v1alpha1.StatePolicyRetain, podstatus.VMState{Flashed: root}, false},
		{"Retain, disk size set: fresh", v1alpha1.StatePolicyRetain, podstatus.VMState{Size: &podstatus.VMSize{DiskBytes: 1 << 30}}, false},
	} {
		assert.Equal(t, c.want, ResetKeepsDisk(c.policy, c.st), c.name)
	}
}

// A reset whose record cannot be written (Undo) leaves the disk, the UEFI
// variables and the flash dir as they were; a committed one drops them.
func TestResetPlaceUndoCommit(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, MakeFlashDir(dir))
	overlay := filepath.Join(dir, "disk.qcow2")
	vars := filepath.Join(dir, qemu.UEFIVarsName)
	flashed := filepath.Join(dir, FlashDirName, "bios-1")
	for _, p := range []string{overlay, vars, flashed} {
		require.NoError(t, os.WriteFile(p, []byte(p), 0o600))
	}
	st := podstatus.VMState{FlashedImage: "reg/os@sha256:1", ImageDigest: "sha256:1",
		Flashed: map[string]podstatus.FlashedPartition{"bios": {File: "bios-1"}}, Size: &podstatus.VMSize{MemoryBytes: 1 << 30}}
	before := st

	f := NewReset(false)
	assert.True(t, f.IsReset())
	assert.Equal(t, "reset", f.What())
	assert.Equal(t, "Reset", f.Reason())
	pl, err := f.Place(dir, overlay)
	require.NoError(t, err)
	assert.NoFileExists(t, overlay, "set aside")
	goes, stale := f.Record(dir, &st)
	assert.False(t, goes)
	assert.Empty(t, stale)
	assert.Equal(t, podstatus.VMState{ImageDigest: "sha256:1"}, st, "the pod's own definition; the digest stays for the next start's hold")
	f.Unrecord(&st, before)
	assert.Equal(t, before, st, "the record as it was")
	require.NoError(t, pl.Undo())
	for _, p := range []string{overlay, vars, flashed} {
		b, err := os.ReadFile(p)
		require.NoError(t, err, "%s is back", p)
		assert.Equal(t, p, string(b))
	}

	f = NewReset(false)
	pl, err = f.Place(dir, overlay)
	require.NoError(t, err)
	f.Record(dir, &st)
	pl.Commit()
	for _, p := range []string{overlay, vars, flashed} {
		assert.NoFileExists(t, p)
	}
	es, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range es {
		assert.NotContains(t, e.Name(), asideSuffix, "nothing set aside is left")
	}

	// keepDisk: the disk and the UEFI variables stay.
	for _, p := range []string{overlay, vars} {
		require.NoError(t, os.WriteFile(p, []byte(p), 0o600))
	}
	pl, err = NewReset(true).Place(dir, overlay)
	require.NoError(t, err)
	pl.Commit()
	assert.FileExists(t, overlay)
	assert.FileExists(t, vars)
}
