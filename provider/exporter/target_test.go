package exporter

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// anyPod names Pod for embedding (Pod has a method Pod).
type anyPod = Pod

// powerPod records which stop its exporter asked for.
type powerPod struct {
	anyPod // the rest is not used here
	calls  []string
}

func (p *powerPod) PowerOff(context.Context) error { p.calls = append(p.calls, "graceful"); return nil }

// nowPod can also stop the VM at once.
type nowPod struct{ powerPod }

func (p *nowPod) PowerOffNow(context.Context) error { p.calls = append(p.calls, "now"); return nil }

// TestTargetPowerOff: the power driver's off is the worker's immediate
// stop when the pod offers it, the graceful one otherwise; shutdown is
// always the graceful stop (ACPI power button within the pod's grace).
func TestTargetPowerOff(t *testing.T) {
	ctx := context.Background()
	now := &nowPod{}
	tgt := NewTarget(&Node{}, now)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"now", "graceful"}, now.calls)

	old := &powerPod{}
	tgt = NewTarget(&Node{}, old)
	require.NoError(t, tgt.PowerOff(ctx))
	require.NoError(t, tgt.Shutdown(ctx))
	assert.Equal(t, []string{"graceful", "graceful"}, old.calls, "a pod without PowerOffNow stops gracefully")
}

// execVM is a running VM whose guest agent answers GuestExec with res or
// err, recording the requests.
type execVM struct {
	VM   // the rest is not used here
	res  qemu.ExecResult
	err  error
	reqs []qemu.ExecRequest
}

func (v *execVM) GuestExec(_ context.Context, req qemu.ExecRequest) (qemu.ExecResult, error) {
	v.reqs = append(v.reqs, req)
	return v.res, v.err
}

// execPod runs vm (nil: powered off).
type execPod struct {
	anyPod
	vm *execVM
}

func (p *execPod) VM() VM {
	if p.vm == nil {
		return nil
	}
	return p.vm
}

// TestTargetGuestExec: a hook's exec step runs its argv through the
// guest agent; a guest agent that does not answer yet is the error the
// hook tries again on, anything else is not, and a powered-off VM says so.
func TestTargetGuestExec(t *testing.T) {
	ctx := context.Background()
	vm := &execVM{res: qemu.ExecResult{ExitCode: 2, Stdout: []byte("out"), Stderr: []byte("no such file")}}
	tgt := NewTarget(&Node{}, &execPod{vm: vm})
	res, err := tgt.GuestExec(ctx, []string{"/bin/ls", "-l", "/gone"})
	require.NoError(t, err)
	assert.Equal(t, jumpstarter.GuestExecResult{ExitCode: 2, Stderr: []byte("no such file")}, res)
	assert.Equal(t, []qemu.ExecRequest{{Path: "/bin/ls", Args: []string{"-l", "/gone"}}}, vm.reqs)

	vm.err = fmt.Errorf("%w on VM x: no answer to the handshake within 5s", qemu.ErrGuestAgentNotResponding)
	_, err = tgt.GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, jumpstarter.ErrGuestAgentNotReady, "a booting guest: try again")
	assert.ErrorContains(t, err, "no answer to the handshake")

	vm.err = fmt.Errorf("VM x: %w", qemu.ErrNoGuestAgentChannel)
	_, err = tgt.GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, qemu.ErrNoGuestAgentChannel)
	assert.NotErrorIs(t, err, jumpstarter.ErrGuestAgentNotReady, "no channel: trying again cannot help")

	_, err = NewTarget(&Node{}, &execPod{}).GuestExec(ctx, []string{"true"})
	require.ErrorIs(t, err, ErrVMPoweredOff)
	_, err = tgt.GuestExec(ctx, nil)
	require.ErrorContains(t, err, "no command")
}
