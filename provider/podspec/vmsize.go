package podspec

import (
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Sizes set through a pod's Jumpstarter exporter (set_memory_size,
// set_disk_size): what the node can give, decided at the call. The
// executor (provider/exporter/vmsize.go) gathers the facts and records the size.

// MemoryMiB rounds bytes up to whole MiB: the one rounding of a VM's
// memory (the pod's, Translate; a size set through the exporter).
func MemoryMiB(bytes int64) int { return int((bytes + (1<<20 - 1)) >> 20) }

// WithMemoryClaim is pod as admission counts it: its memory request raised
// to memoryBytes (the RAM set through the Jumpstarter exporter; 0: none)
// when that is larger. pod is copied only when changed. Pure.
func WithMemoryClaim(pod *corev1.Pod, memoryBytes int64) *corev1.Pod {
	if memoryBytes == 0 || len(pod.Spec.Containers) == 0 {
		return pod
	}
	want := int64(MemoryMiB(memoryBytes)) << 20
	req := pod.Spec.Containers[0].Resources.Requests[corev1.ResourceMemory]
	if req.Value() >= want {
		return pod
	}
	c := pod.DeepCopy()
	if c.Spec.Containers[0].Resources.Requests == nil {
		c.Spec.Containers[0].Resources.Requests = corev1.ResourceList{}
	}
	c.Spec.Containers[0].Resources.Requests[corev1.ResourceMemory] = *resource.NewQuantity(want, resource.BinarySI)
	return c
}

// BytesOf prints n bytes as a binary quantity (2Gi).
func BytesOf(n int64) string { return resource.NewQuantity(n, resource.BinarySI).String() }

// CheckMemorySize decides whether the node can give pod's VM bytes of RAM
// from its next start: at least QEMU's minimum, at most the pod's memory
// limit (when it has one), and fitting the node's allocatable memory next
// to others (the other active pods, as admission counts them). The error
// says which bound (the caller refuses the size with it). Pure.
func CheckMemorySize(pod *corev1.Pod, bytes int64, node NodeCapacity, others []*corev1.Pod) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("memory %s: %s", BytesOf(bytes), fmt.Sprintf(format, a...))
	}
	mib := MemoryMiB(bytes)
	if min := qemu.DefaultLimits().MinMemoryMiB; mib < min {
		return bad("below the %d MiB a VM needs", min)
	}
	if bytes > maxMemory.Value() {
		return bad("above the %s a VM may have", maxMemory.String())
	}
	if len(pod.Spec.Containers) > 0 {
		if lim, ok := pod.Spec.Containers[0].Resources.Limits[corev1.ResourceMemory]; ok && int64(mib)<<20 > lim.Value() {
			return bad("over the pod's memory limit %s (spec.containers[0].resources.limits.memory)", lim.String())
		}
	}
	alloc, ok := node.Allocatable[corev1.ResourceMemory]
	if !ok {
		return nil
	}
	claim := VMRequests(WithMemoryClaim(pod, bytes), node.VMOverhead)[corev1.ResourceMemory]
	var used resource.Quantity
	for _, o := range others {
		if o.UID == pod.UID {
			continue
		}
		used.Add(VMRequests(o, node.VMOverhead)[corev1.ResourceMemory])
	}
	total := used.DeepCopy()
	total.Add(claim)
	if total.Cmp(alloc) > 0 {
		return bad("the node cannot give it: allocatable %s, claimed by the other VMs %s, this VM would claim %s (its memory and QEMU's own)",
			BytesOf(alloc.Value()), BytesOf(used.Value()), BytesOf(claim.Value()))
	}
	return nil
}

// DiskFacts is what CheckDiskSize needs to know of a VM's disk.
type DiskFacts struct {
	// HasDisk: the image the VM boots has a disk (not kernel and initrd only).
	HasDisk bool
	// CurrentBytes is the disk's virtual size now (the larger of the
	// image's and the pod's overlay's).
	CurrentBytes int64
	// FreeBytes is the free space of the file system holding the pod's disk.
	FreeBytes int64
	// SnapshotStart: the pod starts from memory snapshots.
	SnapshotStart bool
}

// CheckDiskSize decides whether the VM's disk can be bytes from its next
// start: the image has a disk, it is not shrunk, the pod's
// ephemeral-storage limit (when set) and the node's free space hold it
// (upstream's checks, made at the call rather than at power on). Pure.
func CheckDiskSize(pod *corev1.Pod, bytes int64, f DiskFacts) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("disk %s: %s", BytesOf(bytes), fmt.Sprintf(format, a...))
	}
	switch {
	case !f.HasDisk:
		return bad("the VM has no disk (its image boots a kernel and initrd only)")
	case f.SnapshotStart:
		return bad("the pod starts from memory snapshots (%s), which hold the disk's size", AnnotationStartFromSnapshot)
	case bytes < f.CurrentBytes:
		return bad("Shrinking disk is not supported: current %s", BytesOf(f.CurrentBytes))
	}
	if len(pod.Spec.Containers) > 0 {
		if lim, ok := pod.Spec.Containers[0].Resources.Limits[corev1.ResourceEphemeralStorage]; ok && bytes > lim.Value() {
			return bad("over the pod's ephemeral-storage limit %s (spec.containers[0].resources.limits)", lim.String())
		}
	}
	if bytes > f.FreeBytes {
		return bad("Not enough disk space: the node has %s free", BytesOf(f.FreeBytes))
	}
	return nil
}
