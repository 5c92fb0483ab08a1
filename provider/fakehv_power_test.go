package provider

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// TestFakeVMPowerOffNowAndShutdown: the exporter's power off (the pod's
// PowerOffNow) has the worker stop QEMU at once (no ACPI button, quit,
// kill after 5 s) and says so in the event and the pod's status; its
// shutdown (the pod's PowerOff) still goes through the ACPI button within
// the pod's grace.
func TestFakeVMPowerOffNowAndShutdown(t *testing.T) {
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-off-now", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	grace := int64(20)
	pod.Spec.TerminationGracePeriodSeconds = &grace
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	vm1 := nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running", running)
	f.drainEvents()
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{p: f.vms, rec: f.rec(pod.UID)})

	require.NoError(t, tgt.PowerOff(ctx))
	opts := vm1.stopOptions()
	require.Len(t, opts, 1)
	assert.True(t, opts[0].NoACPI, "power off is at once: no ACPI button")
	assert.Equal(t, 5*time.Second, opts[0].QuitGrace, "quit, kill after 5 s")
	assert.Equal(t, []string{"*"}, opts[0].Keep, "the state dir is kept")
	p := f.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
	cs := p.Status.ContainerStatuses[0]
	require.NotNil(t, cs.LastTerminationState.Terminated)
	assert.Equal(t, int32(qemu.ExitCodeKilled), cs.LastTerminationState.Terminated.ExitCode)
	assert.Equal(t, "stopped at once: QEMU told to quit", cs.LastTerminationState.Terminated.Message)
	assert.Equal(t, "powered off on request (stopped at once: QEMU told to quit); power it on to boot again", cs.State.Waiting.Message)
	evs := f.drainEvents()
	assert.True(t, hasEvent(evs, "Normal PoweringOff Powering off the VM on request at once (quit, kill after 5s)"), "events %q", evs)
	assert.NotContains(t, strings.Join(evs, "\n"), "ACPI", "no event of the power off at once talks about ACPI")

	require.NoError(t, tgt.PowerOn(ctx))
	vm2 := nextVM(t, hv)
	f.wait(pod.UID, 10*time.Second, "Running again", running)
	f.drainEvents()
	require.NoError(t, tgt.Shutdown(ctx))
	opts = vm2.stopOptions()
	require.Len(t, opts, 1)
	assert.False(t, opts[0].NoACPI, "shutdown presses the ACPI button")
	assert.Equal(t, podstatus.ACPIBudget(20*time.Second), opts[0].Grace, "within the pod's grace")
	p = f.wait(pod.UID, 5*time.Second, "PoweredOff by shutdown", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
	assert.Equal(t, int32(0), p.Status.ContainerStatuses[0].LastTerminationState.Terminated.ExitCode, "the guest powered off")
	evs = f.drainEvents()
	assert.True(t, hasEvent(evs, "Normal PoweringOff Powering off the VM on request (ACPI power button"), "events %q", evs)
	assert.NotContains(t, strings.Join(evs, "\n"), "at once")
}
