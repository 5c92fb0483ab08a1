package provider

import (
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
	p := VMPlacement(config.VMCgroupConfig{Root: root, Parent: "qemu-kubelet", CPUWeight: 100}, 10)
	assert.Nil(t, p.Cgroup, "mode Inherit: the agent's cgroup")
	assert.Equal(t, 10, p.Nice)
	assert.Contains(t, p.Why, root, "the log line says why")

	p = VMPlacement(config.VMCgroupConfig{Own: true, Root: root, Parent: "qemu-kubelet", CPUWeight: 100}, 10)
	require.NotNil(t, p.Cgroup, "mode Own: each VM in its own cgroup still")
	assert.Equal(t, qemu.Cgroup{Root: root, Parent: "qemu-kubelet"}, *p.Cgroup, "no weight")
	assert.Equal(t, 10, p.Nice)
	assert.Contains(t, p.Why, "no CPU cgroup for the VMs")

	p = VMPlacement(config.VMCgroupConfig{Root: root, Parent: "qemu-kubelet", CPUWeight: 0}, 7)
	assert.Nil(t, p.Cgroup)
	assert.Equal(t, 7, p.Nice, "cpuWeight 0: vmNice")
}

// TestVMSettingsOfApply: every node-wide VM setting of a resolved node
// configuration reaches the VMsConfig the agent starts its VMs with.
func TestVMSettingsOfApply(t *testing.T) {
	root := t.TempDir()
	cfg := &config.Node{
		QEMUBinary:         "/opt/qemu/bin/qemu-system-x86_64",
		EmulatedKernelArgs: []string{"tsc=reliable"},
		CPUModels:          map[qemu.Accelerator]string{qemu.AccelTCG: "x86-64-v2"},
		VMNice:             7,
		VMCgroup:           config.VMCgroupConfig{Root: root, Parent: "qemu-kubelet", CPUWeight: 0},
		VMUser:             config.VMUserConfig{UID: 4242, GID: 4243},
		Features:           &config.FeatureConfig{},
	}
	cfg.VMMemory.TCGTranslationBufferMiB = 16
	cfg.VMMemory.FreePageReporting = true
	cfg.VMMemory.PageMerging = true
	cfg.VMMemory.Overhead = 96 << 20
	var c VMsConfig
	VMSettingsOf(cfg).Apply(&c)
	assert.Equal(t, cfg.QEMUBinary, c.QEMUBinary)
	assert.Equal(t, qemu.MemoryTuning{TCGTranslationBufferMiB: 16, FreePageReporting: true, MemMerge: true}, c.Memory)
	assert.Equal(t, int64(96<<20), c.VMOverhead)
	assert.Equal(t, cfg.EmulatedKernelArgs, c.EmulatedKernelArgs)
	assert.Equal(t, cfg.CPUModels, c.CPUModels)
	assert.Equal(t, 7, c.VMNice, "cpuWeight 0: vmNice")
	assert.Nil(t, c.VMCgroup)
	require.NotNil(t, c.VMUser)
	assert.Equal(t, qemu.User{UID: 4242, GID: 4243}, *c.VMUser)
	assert.Same(t, cfg.Features, c.Features)
}
