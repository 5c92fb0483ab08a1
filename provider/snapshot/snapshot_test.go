package snapshot

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/types"
)

func snapSpec() qemu.Spec {
	return qemu.Spec{
		Name: "default.vm-a", Arch: qemu.ArchX86_64, Accelerator: qemu.AccelTCG, Machine: "q35", CPUs: 1, MemoryMiB: 128,
		Kernel: "/img/sha256-1/vmlinuz", Initrd: "/img/sha256-1/initrd", Cmdline: "console=ttyS0 quiet", Network: true,
		StateDir: "/state/vms/a", AllowedDirs: []string{"/img"},
		Disks: []qemu.Disk{{Path: "/state/vms/a/disk.qcow2", Format: qemu.FormatQCOW2}},
	}
}

func TestSnapshotKey(t *testing.T) {
	base := snapshotKey(snapSpec(), "sha256:1", "QEMU emulator version 7.2.22", nil)
	assert.Len(t, base, 40)

	// Per-VM parts do not change the key.
	same := snapSpec()
	same.Name, same.StateDir = "other.vm-b", "/state/vms/b"
	same.Disks[0].Path = "/state/vms/b/disk.qcow2"
	same.Forwards = []qemu.PortForward{{HostPort: 1234, GuestPort: 80}}
	same.MAC = "52:54:00:aa:bb:cc"
	same.RunAs = &qemu.User{UID: 107, GID: 107}
	assert.Equal(t, base, snapshotKey(same, "sha256:1", "QEMU emulator version 7.2.22", nil))

	// Everything a restore depends on does.
	changes := map[string]func(*qemu.Spec){
		"machine":     func(s *qemu.Spec) { s.Machine = "pc" },
		"cpus":        func(s *qemu.Spec) { s.CPUs = 2 },
		"memory":      func(s *qemu.Spec) { s.MemoryMiB = 256 },
		"accelerator": func(s *qemu.Spec) { s.Accelerator = qemu.AccelKVM },
		"cmdline":     func(s *qemu.Spec) { s.Cmdline += " x=1" },
		"firmware": func(s *qemu.Spec) {
			s.Firmware = qemu.FirmwareUEFI
			s.UEFICode, s.UEFIVarsTemplate = "/f/code", "/f/vars"
		},
		"balloon":     func(s *qemu.Spec) { s.Memory.FreePageReporting = true },
		"no network":  func(s *qemu.Spec) { s.Network = false },
		"no disk":     func(s *qemu.Spec) { s.Disks = nil },
		"disk format": func(s *qemu.Spec) { s.Disks[0].Format = qemu.FormatRaw },
	}
	seen := map[string]string{base: "base"}
	for name, f := range changes {
		s := snapSpec()
		f(&s)
		k := snapshotKey(s, "sha256:1", "QEMU emulator version 7.2.22", nil)
		assert.NotContains(t, seen, k, "%s must change the key (same as %s)", name, seen[k])
		seen[k] = name
	}
	for name, k := range map[string]string{
		"image":    snapshotKey(snapSpec(), "sha256:2", "QEMU emulator version 7.2.22", nil),
		"qemu":     snapshotKey(snapSpec(), "sha256:1", "QEMU emulator version 8.2.0", nil),
		"firmware": snapshotKey(snapSpec(), "sha256:1", "QEMU emulator version 7.2.22", []string{"/f/code 10 20"}),
	} {
		assert.NotContains(t, seen, k, "%s must change the key", name)
		seen[k] = name
	}
	assert.Equal(t, "52:54:00:"+base[0:2]+":"+base[2:4]+":"+base[4:6], snapshotMAC(base))
	s := snapSpec()
	s.MAC = snapshotMAC(base)
	s.StateDir = "/state/vms/a"
	assert.NoError(t, s.Validate(), "the key's MAC is a valid MAC")
}

func TestDecideSnapshot(t *testing.T) {
	const me, other types.UID = "me", "other"
	for _, c := range []struct {
		published, afterFailed bool
		creator                types.UID
		want                   snapshotAction
	}{
		{true, false, "", snapRestore},
		{true, false, other, snapRestore},
		{true, true, "", snapBoot}, // the snapshot could not be discarded
		{false, false, "", snapCreate},
		{false, true, "", snapCreate}, // after a failed restore: the new creator
		{false, false, me, snapCreate},
		{false, false, other, snapBoot}, // one creator per key
	} {
		assert.Equal(t, c.want, decideSnapshot(c.published, c.afterFailed, c.creator, me), "%+v", c)
	}
}

func TestSnapshotClaimOneCreator(t *testing.T) {
	var s Store
	var wg sync.WaitGroup
	wins := make(chan types.UID, 20)
	for i := 0; i < 20; i++ {
		wg.Add(1)
		go func(uid types.UID) {
			defer wg.Done()
			if s.claim("k", uid) {
				wins <- uid
			}
		}(types.UID(rune('a' + i)))
	}
	wg.Wait()
	close(wins)
	var got []types.UID
	for u := range wins {
		got = append(got, u)
	}
	require.Len(t, got, 1, "exactly one creator")
	assert.Equal(t, got[0], s.creator("k"))
	s.release("k", "not-the-owner")
	assert.Equal(t, got[0], s.creator("k"), "only the owner releases")
	s.release("k", got[0])
	assert.Empty(t, s.creator("k"))
	assert.True(t, s.claim("k", "z"))
}

func TestReadSnapshot(t *testing.T) {
	dir := t.TempDir()
	_, ok := Read(dir)
	assert.False(t, ok, "empty dir")
	require.NoError(t, os.WriteFile(filepath.Join(dir, StateFile), []byte("12345"), 0o400))
	_, ok = Read(dir)
	assert.False(t, ok, "no meta.json: not published")
	require.NoError(t, os.WriteFile(filepath.Join(dir, MetaFile), []byte(`{"stateBytes":4}`), 0o444))
	_, ok = Read(dir)
	assert.False(t, ok, "state of another size (truncated or grown)")
	require.NoError(t, os.Remove(filepath.Join(dir, MetaFile)))
	require.NoError(t, os.WriteFile(filepath.Join(dir, MetaFile), []byte(`{"stateBytes":5,"disk":true}`), 0o444))
	_, ok = Read(dir)
	assert.False(t, ok, "disk missing")
	require.NoError(t, os.WriteFile(filepath.Join(dir, DiskFile), nil, 0o444))
	m, ok := Read(dir)
	assert.True(t, ok)
	assert.Equal(t, int64(5), m.StateBytes)

	u := &Use{key: "k", kdir: dir}
	require.NoError(t, Discard(u))
	_, err := os.Stat(dir)
	assert.True(t, os.IsNotExist(err), "discarded")
	assert.NoError(t, Discard(u), "discarding twice is fine")
	left, _ := os.ReadDir(filepath.Dir(dir))
	for _, e := range left {
		assert.False(t, strings.Contains(e.Name(), ".bad-"), "no trash left: %s", e.Name())
	}
}

func TestQEMUVersionCached(t *testing.T) {
	dir := t.TempDir()
	bin := filepath.Join(dir, "fake-qemu")
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\necho 'QEMU emulator version 7.2.99'\necho Copyright\n"), 0o755))
	var s Store
	v, err := s.qemuVersion(context.Background(), bin)
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(v, "7.2.99 ("+bin+" "), v)
	_, err = s.qemuVersion(context.Background(), filepath.Join(dir, "missing"))
	assert.Error(t, err)
	require.NoError(t, os.WriteFile(bin, []byte("#!/bin/sh\nexit 3\n"), 0o755))
	_, err = s.qemuVersion(context.Background(), bin)
	assert.Error(t, err, "a changed binary is asked again")
}
