package podspec

import (
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
)

// A pod whose image is v1alpha1.EmptyDiskImage boots an empty root disk
// under the firmware (no kernel): its size is the container's
// ephemeral-storage, nothing is pulled for it, and the disk is there for
// a Jumpstarter lease holder to flash.

// IsEmptyDisk: the plan boots an empty root disk, not an image.
func (p Plan) IsEmptyDisk() bool { return p.Image == v1alpha1.EmptyDiskImage }

// emptyDiskBytes is the empty disk's size: the container's
// ephemeral-storage limit, else its request. Problems go to bad.
func emptyDiskBytes(c corev1.Container, f string, bad func(field, format string, a ...any)) int64 {
	field := f + ".resources.limits[ephemeral-storage]"
	q, ok := c.Resources.Limits[corev1.ResourceEphemeralStorage]
	if !ok {
		field = f + ".resources.requests[ephemeral-storage]"
		q, ok = c.Resources.Requests[corev1.ResourceEphemeralStorage]
	}
	switch {
	case !ok:
		bad(f+".resources", "image %s boots an empty disk of the container's ephemeral-storage limit (or request): set one", v1alpha1.EmptyDiskImage)
	default:
		if err := v1alpha1.EmptyDiskSizeError(q); err != nil {
			bad(field, "%v", err)
			return 0
		}
		return q.Value()
	}
	return 0
}

// validateEmptyDisk refuses what an empty disk cannot do: it has no
// kernel (no command line, no microvm, which boots a kernel only) and no
// OS to reach a readiness point (no memory snapshot start).
func validateEmptyDisk(ann map[string]string, plan Plan, bad func(field, format string, a ...any)) {
	why := "image " + v1alpha1.EmptyDiskImage + " boots an empty disk under the firmware"
	if _, ok := ann[AnnotationKernelCmdline]; ok {
		bad("metadata.annotations["+AnnotationKernelCmdline+"]", "%s: it has no kernel to pass a command line to", why)
	}
	if plan.SnapshotStart {
		bad("metadata.annotations["+AnnotationStartFromSnapshot+"]", "%s: no OS reaches a readiness point to snapshot", why)
	}
	if plan.Machine == "microvm" {
		bad("metadata.annotations["+AnnotationMachine+"]", "%s: machine microvm boots a kernel only (use q35 or pc)", why)
	}
}
