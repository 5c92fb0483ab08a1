package qemu

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestGuestExecRealQEMU runs commands through the test image's
// qemu-guest-agent on the VM's virtio-serial channel, and checks that a
// guest whose agent is off (qk.noagent) fails with the clear error.
func TestGuestExecRealQEMU(t *testing.T) {
	testutil.SkipIfShort(t, "boots QEMU")
	withAgent := testSpec(t, "acpi")
	withAgent.Name = "ga-on"
	noAgent := testSpec(t, "acpi")
	noAgent.Name = "ga-off"
	noAgent.Cmdline += " qk.noagent"
	dirOn := newStateDir(t)
	vm := startVM(t, withAgent, dirOn)
	off := startVM(t, noAgent, newStateDir(t))
	waitBoot(t, vm)
	waitBoot(t, off)

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	res, err := vm.GuestExec(ctx, ExecRequest{Path: "uname", Args: []string{"-m"}})
	require.NoError(t, err)
	assert.Equal(t, string(HostArch()), strings.TrimSpace(string(res.Stdout)))
	assert.Equal(t, 0, res.ExitCode)

	// The test image's init loads its modules (Debian's kernel; the
	// minimal one has them built in), then deletes their files (its root
	// file system is guest RAM); the balloon driver is registered; its
	// kernel does not account its memory to cgroups (it runs none).
	res, err = vm.GuestExec(ctx, ExecRequest{Path: "sh", Args: []string{"-c",
		"[ -e /lib/modules ] && echo module files kept; [ -d /sys/bus/virtio/drivers/virtio_balloon ] && echo virtio_balloon; grep -o cgroup.memory=nokmem /proc/cmdline"}})
	require.NoError(t, err)
	assert.Equal(t, "virtio_balloon\ncgroup.memory=nokmem\n", string(res.Stdout), "the guest's module files, the balloon driver and kernel command line")

	res, err = vm.GuestExec(ctx, ExecRequest{Path: "cat", Stdin: []byte("line one\nline two\n")})
	require.NoError(t, err)
	assert.Equal(t, "line one\nline two\n", string(res.Stdout))

	res, err = vm.GuestExec(ctx, ExecRequest{Path: "sh", Args: []string{"-c", "echo oops >&2; exit 3"}})
	require.NoError(t, err)
	assert.Equal(t, 3, res.ExitCode)
	assert.Equal(t, "oops\n", string(res.Stderr))

	_, err = vm.GuestExec(ctx, ExecRequest{Path: "/no/such/program"})
	var ge *GuestAgentError
	require.ErrorAs(t, err, &ge)

	// The channel's socket is in the state dir, not reachable by others.
	assert.FileExists(t, vm.Spec().Path(GuestAgentSocketName))

	// A re-adopted VM talks to the agent again (the old connection is
	// closed on Detach: QEMU serves one client at a time).
	vm.Detach()
	again, err := Adopt(ctx, dirOn)
	require.NoError(t, err)
	t.Cleanup(func() { killVM(again) })
	res, err = again.GuestExec(ctx, ExecRequest{Path: "uname", Args: []string{"-m"}})
	require.NoError(t, err)
	assert.Equal(t, string(HostArch()), strings.TrimSpace(string(res.Stdout)))

	start := time.Now()
	_, err = off.GuestExec(ctx, ExecRequest{Path: "uname"})
	require.ErrorIs(t, err, ErrGuestAgentNotResponding)
	assert.Contains(t, err.Error(), "guest agent not responding on VM ga-off")
	assert.Less(t, time.Since(start), DefaultGuestAgentHandshake+5*time.Second)
}
