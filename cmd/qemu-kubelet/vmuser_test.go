package main

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
)

// TestVMUserSearch: the VMs' user may search (only search) the state dir,
// its vms dir and a guest architecture's directories; a state dir under a
// directory that user cannot search stops the agent with the directory
// named.
func TestVMUserSearch(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to chown")
	}
	top, err := os.MkdirTemp("", "qk-vmuser-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(top) })
	require.NoError(t, os.Chmod(top, 0o711))
	state := filepath.Join(top, "state")
	require.NoError(t, os.Mkdir(state, 0o750))
	arm := &config.Node{StateDir: filepath.Join(state, config.GuestArchDirName, "arm64")}
	cfg := &config.Node{StateDir: state, VMUser: config.VMUserConfig{UID: 107, GID: 108}, GuestArchitectures: []*config.Node{arm}}
	require.NoError(t, vmUserSearch(cfg))
	for _, d := range []string{state, filepath.Join(state, "vms"), filepath.Join(state, "arch"), arm.StateDir, filepath.Join(arm.StateDir, "vms")} {
		fi, err := os.Stat(d)
		require.NoError(t, err)
		if st := fi.Sys().(*syscall.Stat_t); st.Uid != 0 || st.Gid != 108 || fi.Mode().Perm() != 0o710 {
			t.Errorf("%s: %d:%d %v, want 0:108 search only for the group", d, st.Uid, st.Gid, fi.Mode().Perm())
		}
	}

	// QEMU as the agent: nothing changes.
	own := filepath.Join(top, "own")
	require.NoError(t, os.Mkdir(own, 0o700))
	require.NoError(t, vmUserSearch(&config.Node{StateDir: own, VMUser: config.VMUserConfig{UID: 0, GID: 0}}))
	fi, err := os.Stat(own)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), fi.Mode().Perm())

	require.NoError(t, os.Chmod(top, 0o700))
	err = vmUserSearch(cfg)
	if err == nil || !strings.Contains(err.Error(), "QEMU runs as uid 107 gid 108 and must reach the VM directories") || !strings.Contains(err.Error(), top+" (mode -rwx------, owner 0:0) is not searchable") {
		t.Fatalf("state dir under a closed directory: %v", err)
	}
}
