package podspec

import "github.com/qemu-kubelet/qemu-kubelet/qemu"

// VMCgroup is the cgroup of a pod's VM when the node runs each QEMU in a
// cgroup of its own (base non-nil: vmCgroup mode Own, or a CPU-only
// cgroup for its weight), else nil: the pod's CPU limit (cpuLimitMilli, Plan.CPULimitMilli) caps it, and its
// memory is capped at the guest's RAM (memoryMiB, the VM's) plus the
// node's per-VM overhead (vmMemory.overhead), the figure admission counted
// for it, so a QEMU growing past what the node accounted is ended by the
// kernel instead of pressing the host. A CPU-only cgroup (the VM in
// the agent's cgroup but for its CPU weight: base.CPUOnly) carries no
// limits, as the agent's cgroup set none. Pure.
func VMCgroup(base *qemu.Cgroup, cpuLimitMilli int64, memoryMiB int, overhead int64) *qemu.Cgroup {
	if base == nil {
		return nil
	}
	cg := *base
	if cg.CPUOnly {
		return &cg
	}
	cg.CPUMilli = cpuLimitMilli
	if overhead > 0 {
		cg.MemoryMaxBytes = int64(memoryMiB)<<20 + overhead
	}
	return &cg
}
