package provider

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
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
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})

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

// TestFakeVMResizeThroughWorker: a size set through the exporter
// (set_memory_size) is a request its worker serves (opResize): recorded in
// status.json before the call returns, refused with the reason when the
// pod's limit does not hold it (nothing changed), served while the VM runs
// and while it is off, and the next start boots with it.
func TestFakeVMResizeThroughWorker(t *testing.T) {
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond)
	pod := podFor("u-resize", "reg.example/os:1", corev1.RestartPolicyAlways, nil) // memory limit 256Mi
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	vm1 := nextVM(t, hv)
	assert.Equal(t, 256, vm1.spec.MemoryMiB, "the pod's memory limit")
	f.wait(pod.UID, 10*time.Second, "Running", running)
	rec := f.rec(pod.UID)
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})

	err := tgt.SetMemorySize(ctx, 512<<20)
	require.Error(t, err, "over the pod's memory limit")
	assert.Contains(t, err.Error(), "over the pod's memory limit 256Mi")
	assert.Nil(t, rec.stateCopy().Size, "a refused size changes nothing")

	require.NoError(t, tgt.SetMemorySize(ctx, 100<<20+1), "while the VM runs")
	size := rec.stateCopy().Size
	require.NotNil(t, size)
	assert.Equal(t, int64(101<<20), size.MemoryBytes, "rounded up to MiB")
	b, err := os.ReadFile(filepath.Join(f.dir(pod.UID), StatusFileName))
	require.NoError(t, err)
	assert.Contains(t, string(b), `"memoryBytes": 105906176`, "in status.json before the call returns")
	_, ended := vm1.Exit()
	assert.False(t, ended, "the running VM is not touched")

	require.NoError(t, tgt.PowerOff(ctx))
	f.wait(pod.UID, 5*time.Second, "PoweredOff", func(p *corev1.Pod) bool { return waitingReason(p) == podstatus.ReasonPoweredOff })
	require.NoError(t, tgt.SetMemorySize(ctx, 128<<20), "while the VM is off")
	require.NoError(t, tgt.PowerOn(ctx))
	vm2 := nextVM(t, hv)
	assert.Equal(t, 128, vm2.spec.MemoryMiB, "the next start boots with the size set last")
	p := f.wait(pod.UID, 5*time.Second, "VMResized applied", func(p *corev1.Pod) bool {
		c := podCond(p, podstatus.ConditionVMResized)
		return c != nil && c.Reason == podstatus.ReasonResizeApplied
	})
	assert.Equal(t, corev1.ConditionTrue, podCond(p, podstatus.ConditionVMResized).Status)
}

// TestFakeVMResizeCountsOtherPods: a resize is checked against the node's
// allocatable memory with the other active pods' claims counted (the
// worker reads them under admission's lock: podSet.admitting): a size the
// node can give only without the other pod is refused, naming its claim;
// the size that fills the node exactly is recorded.
func TestFakeVMResizeCountsOtherPods(t *testing.T) {
	ctx := context.Background()
	hv := newFakeHypervisor()
	f := newFakeVMHarness(t, t.TempDir(), hv, 20*time.Millisecond, func(c *VMsConfig) {
		c.Allocatable = func() corev1.ResourceList { return podtest.RL("cpu", "8", "memory", "640Mi", "pods", "10") }
	})
	other := podFor("u-other", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	other.Spec.Containers[0].Resources.Requests = podtest.RL("memory", "256Mi")
	pod := podFor("u-grow", "reg.example/os:1", corev1.RestartPolicyAlways, nil)
	pod.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: podtest.RL("cpu", "1", "memory", "64Mi")}
	require.NoError(t, f.vms.CreatePod(ctx, other))
	f.wait(other.UID, 10*time.Second, "other Running", running)
	require.NoError(t, f.vms.CreatePod(ctx, pod))
	f.wait(pod.UID, 10*time.Second, "Running", running)
	tgt := exporter.NewTarget(f.vms.exporterNode(), podExporter{run: f.vms.runOf(pod.UID)})

	err := tgt.SetMemorySize(ctx, 512<<20)
	require.Error(t, err, "512Mi + the other pod's 256Mi is over the node's 640Mi")
	assert.Contains(t, err.Error(), "claimed by the other VMs 256Mi")
	assert.Nil(t, f.rec(pod.UID).stateCopy().Size, "a refused size changes nothing")

	require.NoError(t, tgt.SetMemorySize(ctx, 384<<20), "384Mi + 256Mi fills the node exactly")
	size := f.rec(pod.UID).stateCopy().Size
	require.NotNil(t, size)
	assert.Equal(t, int64(384<<20), size.MemoryBytes)
}
