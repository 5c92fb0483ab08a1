package exporter

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
)

// TestLeaseHooks: the pod's lease settings become the exporter's hooks,
// each step with what its action needs.
func TestLeaseHooks(t *testing.T) {
	ls := podspec.LeaseSettings{AfterLease: &podspec.LeaseHookSettings{Timeout: time.Minute, OnFailure: v1alpha1.LeaseHookEndLease,
		Actions: []v1alpha1.LeaseHookStep{
			{Action: v1alpha1.LeaseHookExec, Command: []string{"/bin/sh", "-c", "true"}},
			{Action: v1alpha1.LeaseHookFlash, Flash: &v1alpha1.LeaseHookFlashSpec{Image: "reg.example/fw:1", Partition: "bios"}},
			{Action: v1alpha1.LeaseHookPowerOff},
		}}}
	assert.Equal(t, jumpstarter.LeaseHooks{ResetAfterLease: true, AfterLease: &jumpstarter.Hook{Timeout: time.Minute, OnFailure: jumpstarter.OnFailureEndLease,
		Actions: []jumpstarter.HookStep{
			{Action: jumpstarter.HookExec, Command: []string{"/bin/sh", "-c", "true"}},
			{Action: jumpstarter.HookFlash, Image: "reg.example/fw:1", Partition: "bios"},
			{Action: jumpstarter.HookPowerOff},
		}}}, leaseHooks(ls))
	assert.Equal(t, jumpstarter.LeaseHooks{}, leaseHooks(podspec.LeaseSettings{Keep: true}))
}
