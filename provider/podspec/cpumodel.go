package podspec

import "github.com/qemu-kubelet/qemu-kubelet/qemu"

// CPUModel is the guest CPU model (qemu.Spec.CPUModel) of a pod's VM run
// under accel: the pod's (AnnotationCPUModel), else the node's for that
// accelerator (node: the configuration's cpuModel), else "", which
// qemu.Args turns into qemu.DefaultCPUModel. Pure.
func CPUModel(plan Plan, accel qemu.Accelerator, node map[qemu.Accelerator]string) string {
	if plan.CPUModel != "" {
		return plan.CPUModel
	}
	return node[accel]
}
