package exporter

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// Resizing a VM through its pod's Jumpstarter exporter (`j resize memory
// 2G`, `j resize disk 20G`: set_memory_size, set_disk_size):
//   - the size is checked at the call against the pod's limits
//     (resources.limits memory, ephemeral-storage) and what the node can
//     give (memory: allocatable less what the other VMs claim; disk: free
//     space where the pod's disk lives), and refused there with the reason;
//   - an accepted size is recorded in status.json before the call returns
//     (VMState.Size), so VM restarts and agent restarts keep it, and it
//     applies at every VM start from then on (power on, restart): RAM of
//     that size, the disk grown to it (never shrunk);
//   - the VM's claim on node memory is the larger of its memory request and
//     the size set (admission of later pods counts it);
//   - the pod shows it as condition podstatus.ConditionVMResized.

var _ jumpstarter.Resizer = (*Target)(nil)

// SetMemorySize checks bytes against the pod and the node (under the
// admission lock, so no pod is admitted against the old claim meanwhile),
// records it and shows it on the pod.
func (t *Target) SetMemorySize(ctx context.Context, bytes int64) error {
	err := t.pod.SetSize(ctx, func(pod *corev1.Pod, node podspec.NodeCapacity, others []*corev1.Pod) error {
		return refused(podspec.CheckMemorySize(pod, bytes, node, others))
	}, func(s *podstatus.VMSize) { s.MemoryBytes = int64(podspec.MemoryMiB(bytes)) << 20 })
	return t.sizeResult(ctx, "memory", bytes, err)
}

// SetDiskSize checks bytes against the image's disk, the pod's limit and
// the node's free space, records it and shows it on the pod.
func (t *Target) SetDiskSize(ctx context.Context, bytes int64) error {
	bytes = (bytes + 511) &^ 511 // qemu-img sizes are whole sectors
	f, err := t.diskFacts(ctx)
	if err == nil {
		err = t.pod.SetSize(ctx, func(pod *corev1.Pod, _ podspec.NodeCapacity, _ []*corev1.Pod) error {
			return refused(podspec.CheckDiskSize(pod, bytes, f))
		}, func(s *podstatus.VMSize) { s.DiskBytes = bytes })
	}
	return t.sizeResult(ctx, "disk", bytes, err)
}

// refused makes a size check's error the call's InvalidArgument.
func refused(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%w: %w", jumpstarter.ErrInvalidArgument, err)
}

// diskFacts reads what CheckDiskSize needs: the disk the VM boots (a
// flashed root, else its image's, from the node's cache: it ran), the
// pod's overlay, the free space (less what flashes in progress hold).
func (t *Target) diskFacts(ctx context.Context) (podspec.DiskFacts, error) {
	plan, st := t.pod.Record()
	dir := t.pod.Dir()
	ref := plan.Image
	if st.FlashedImage != "" {
		ref = st.FlashedImage
	}
	f := podspec.DiskFacts{SnapshotStart: plan.SnapshotStart}
	img := OwnRoot(dir, plan, st) // a flashed root or the empty disk is the disk the VM boots
	if img == nil {
		if t.node.Images == nil {
			return f, errors.New("disk size: this node has no image store")
		}
		var err error
		img, err = t.node.Images.Pull(ctx, ref, oci.PullOptions{Policy: oci.PullNever})
		if err != nil {
			return f, fmt.Errorf("disk size: the image %s the VM boots is not in the node's cache: %w", ref, err)
		}
	}
	if img.Disk == "" {
		return f, nil
	}
	f.HasDisk = true
	info, err := qemu.InspectImage(ctx, img.Disk)
	if err != nil {
		return f, fmt.Errorf("disk size: %w", err)
	}
	f.CurrentBytes = info.VirtualSize
	overlay := t.pod.Overlay()
	if _, err := os.Stat(overlay); err == nil {
		if oi, err := qemu.InspectImage(ctx, overlay); err == nil {
			f.CurrentBytes = max(f.CurrentBytes, oi.VirtualSize)
		}
	}
	// What flashes in progress hold is not free (diskspace.go).
	free, err := nodeDisk.available(dir, 0)
	if err != nil {
		return f, fmt.Errorf("disk size: %w", err)
	}
	f.FreeBytes = free
	return f, nil
}

// sizeResult shows an accepted size on the pod (condition, event) and logs
// the outcome.
func (t *Target) sizeResult(ctx context.Context, what string, bytes int64, err error) error {
	log := klog.FromContext(ctx).WithValues("pod", klog.KObj(t.pod.Pod()))
	if err != nil {
		log.Info("VM resize refused", "what", what, "bytes", bytes, "err", err.Error())
		return err
	}
	log.Info("VM resized for the next power on", "what", what, "bytes", bytes)
	t.pod.Event(corev1.EventTypeNormal, podstatus.ReasonResized, fmt.Sprintf("VM %s will be %s from its next power on (Jumpstarter set_%s_size)", what, podspec.BytesOf(bytes), what))
	t.pod.Changed()
	return nil
}
