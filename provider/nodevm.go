package provider

import (
	"os"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// NodeVMSettings is what a node's configuration decides for every VM the
// node starts: the VMsConfig fields the agent (cmd/qemu-kubelet) and any
// test or benchmark that wants a node configured as the agent configures
// one take from the same place.
type NodeVMSettings struct {
	QEMUBinary         string
	Memory             qemu.MemoryTuning
	VMOverhead         int64
	EmulatedKernelArgs []string
	CPUModels          map[qemu.Accelerator]string
	Placement          qemu.CPUPlacement
	VMUser             *qemu.User
	Features           *config.FeatureConfig
}

// VMSettingsOf maps a node configuration to its VMs' settings; the CPU
// placement is VMPlacement's (it prepares the VMs' parent cgroup).
func VMSettingsOf(cfg *config.Node) NodeVMSettings {
	return NodeVMSettings{
		QEMUBinary: cfg.QEMUBinary,
		Memory: qemu.MemoryTuning{
			TCGTranslationBufferMiB: cfg.VMMemory.TCGTranslationBufferMiB,
			FreePageReporting:       cfg.VMMemory.FreePageReporting,
			MemMerge:                cfg.VMMemory.PageMerging,
		},
		VMOverhead:         cfg.VMMemory.Overhead,
		EmulatedKernelArgs: cfg.EmulatedKernelArgs,
		CPUModels:          cfg.CPUModels,
		Placement:          VMPlacement(cfg.VMCgroup, cfg.VMNice),
		VMUser:             VMUserOf(cfg.VMUser),
		Features:           cfg.Features,
	}
}

// Apply sets c's node-wide VM fields from s.
func (s NodeVMSettings) Apply(c *VMsConfig) {
	c.QEMUBinary = s.QEMUBinary
	c.Memory = s.Memory
	c.VMOverhead = s.VMOverhead
	c.EmulatedKernelArgs = s.EmulatedKernelArgs
	c.CPUModels = s.CPUModels
	c.VMNice, c.VMCgroup = s.Placement.Nice, s.Placement.Cgroup
	c.VMUser = s.VMUser
	c.Features = s.Features
}

// VMPlacement decides, once per agent, how the VMs are kept below the
// agent on the CPU (qemu.PlaceCPU): a CPU cgroup of lower weight, its
// parent prepared (a failure, e.g. an unprivileged agent, falls back to
// vmNice), or vmNice. Why is in the result's Why.
func VMPlacement(c config.VMCgroupConfig, nice int) qemu.CPUPlacement {
	return qemu.PlaceCPU(qemu.PlacementInput{
		Base: qemu.Cgroup{Root: c.Root, Parent: c.Parent, Namespace: c.Namespace},
		Own:  c.Own, Weight: c.CPUWeight, Nice: nice,
	})
}

// VMUserOf is the user QEMU starts as: nil when it is the agent's own (a
// non-root agent, or vmUser 0:0 under a root agent).
func VMUserOf(u config.VMUserConfig) *qemu.User {
	if u.UID == uint32(os.Geteuid()) && u.GID == uint32(os.Getegid()) {
		return nil
	}
	return &qemu.User{UID: u.UID, GID: u.GID}
}
