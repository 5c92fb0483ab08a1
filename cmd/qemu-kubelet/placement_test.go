package main

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// TestVMPlacementFallsBack: where the VMs' parent cgroup cannot be made
// (here a root that is no cgroup filesystem, as for an agent that may not
// write the host's), the agent still starts its VMs, at vmNice; mode Own
// keeps each VM's own cgroup, without the weight.
func TestVMPlacementFallsBack(t *testing.T) {
	root := t.TempDir()
	p := vmPlacement(context.Background(), config.VMCgroupConfig{Root: root, Parent: "qemu-kubelet", CPUWeight: 100}, 10)
	assert.Nil(t, p.Cgroup, "mode Inherit: the agent's cgroup")
	assert.Equal(t, 10, p.Nice)
	assert.Contains(t, p.Why, root, "the log line says why")

	p = vmPlacement(context.Background(), config.VMCgroupConfig{Own: true, Root: root, Parent: "qemu-kubelet", CPUWeight: 100}, 10)
	require.NotNil(t, p.Cgroup, "mode Own: each VM in its own cgroup still")
	assert.Equal(t, qemu.Cgroup{Root: root, Parent: "qemu-kubelet"}, *p.Cgroup, "no weight")
	assert.Equal(t, 10, p.Nice)
	assert.Contains(t, p.Why, "no CPU cgroup for the VMs")

	p = vmPlacement(context.Background(), config.VMCgroupConfig{Root: root, Parent: "qemu-kubelet", CPUWeight: 0}, 7)
	assert.Nil(t, p.Cgroup)
	assert.Equal(t, 7, p.Nice, "cpuWeight 0: vmNice")
}
