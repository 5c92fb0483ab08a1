package qemu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/stretchr/testify/require"
)

// fakeKVM points KVMDevice at a file of mode m and group gid for the test.
func fakeKVM(t *testing.T, m os.FileMode, gid int) string {
	t.Helper()
	if os.Getuid() != 0 {
		t.Skip("needs root to chown")
	}
	p := filepath.Join(t.TempDir(), "kvm")
	require.NoError(t, os.WriteFile(p, nil, m))
	require.NoError(t, os.Chmod(p, m))
	require.NoError(t, os.Lchown(p, 0, gid))
	old := KVMDevice
	KVMDevice = p
	t.Cleanup(func() { KVMDevice = old })
	return p
}

// TestCredentialKVMGroup: under KVM the VM's user gets /dev/kvm's group
// when that group may read and write it, and no other group ever.
func TestCredentialKVMGroup(t *testing.T) {
	u := &User{UID: 107, GID: 107}
	fakeKVM(t, 0o660, 36)
	c := Spec{RunAs: u, Accelerator: AccelKVM}.credential()
	require.Equal(t, uint32(107), c.Uid)
	require.Equal(t, uint32(107), c.Gid)
	require.Equal(t, []uint32{36}, c.Groups)
	require.Empty(t, Spec{RunAs: u, Accelerator: AccelTCG}.credential().Groups, "TCG: no /dev/kvm group")
	require.Nil(t, Spec{Accelerator: AccelKVM}.credential(), "no RunAs: the caller's credentials")

	fakeKVM(t, 0o600, 36)
	require.Empty(t, Spec{RunAs: u, Accelerator: AccelKVM}.credential().Groups, "a group without rw gives nothing")
	// The probe refuses KVM the VMs' user could not open, saying how to fix it.
	err := probeKVM(context.Background(), ProbeOptions{RunAs: u})
	if err == nil || !strings.Contains(err.Error(), "not usable by the VMs' uid 107 gid 107") || !strings.Contains(err.Error(), "kvm group") {
		t.Fatalf("probe with a /dev/kvm only root opens: %v", err)
	}
}

// TestReachable: search and read permission judged by owner, group (the
// primary and the supplementary ones) and other bits, as the kernel does.
func TestReachable(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to chown")
	}
	top, err := os.MkdirTemp("/tmp", "qk-reach-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o711))
	d := filepath.Join(top, "d")
	f := filepath.Join(d, "f")
	require.NoError(t, os.Mkdir(d, 0o750))
	require.NoError(t, os.WriteFile(f, []byte("x"), 0o640))
	require.NoError(t, os.Lchown(d, 0, 36))
	require.NoError(t, os.Lchown(f, 0, 36))
	user := &syscall.Credential{Uid: 107, Gid: 107}
	member := &syscall.Credential{Uid: 107, Gid: 107, Groups: []uint32{36}}
	if err := reachable(user, f, true); !errors.Is(err, errNotReachable) || !strings.Contains(err.Error(), d+" (mode -rwxr-x---, owner 0:36) is not searchable by uid 107 gid 107") {
		t.Errorf("outsider: %v", err)
	}
	require.NoError(t, reachable(member, f, true), "member of the group")
	require.NoError(t, os.Chmod(f, 0o600))
	if err := reachable(member, f, true); !errors.Is(err, errNotReachable) || !strings.Contains(err.Error(), "is not readable") {
		t.Errorf("unreadable file: %v", err)
	}
	require.NoError(t, reachable(member, d, false), "a directory needs search only")
	require.NoError(t, os.Lchown(f, 107, 107))
	require.NoError(t, reachable(member, f, true), "owner")
}

// TestProbeRunsAsUser: the probe VM runs as ProbeOptions.RunAs: its boot
// sector, in a probe dir the caller owns, is handed to that user and runs
// (under TCG here).
func TestProbeRunsAsUser(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	if os.Getuid() != 0 {
		t.Skip("needs root to start QEMU as another user")
	}
	top, err := os.MkdirTemp("/tmp", "qk-probe-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o711))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	opts := ProbeOptions{Arch: HostArch(), QEMUBinary: HostArch().Binary(), Timeout: 30 * time.Second, WorkDir: filepath.Join(top, "probe"), RunAs: &User{UID: 107, GID: 107}}
	require.NoError(t, probeGuest(ctx, opts, AccelTCG))
	fi, err := os.Stat(opts.WorkDir)
	require.NoError(t, err)
	if st := fi.Sys().(*syscall.Stat_t); st.Gid != 107 || fi.Mode().Perm() != 0o710 {
		t.Errorf("probe dir %v group %d, want 0710 group 107", fi.Mode(), st.Gid)
	}
	// A work dir the user cannot reach: the probe says so.
	require.NoError(t, os.Chmod(top, 0o700))
	err = probeGuest(ctx, opts, AccelTCG)
	if !errors.Is(err, errNotReachable) || !strings.Contains(err.Error(), top+" (mode -rwx------") {
		t.Fatalf("probe dir unreachable: %v", err)
	}
}
