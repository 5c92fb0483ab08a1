package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
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

// nodeCapacity is what admission checks pods against.
func (p *VMs) nodeCapacity() podspec.NodeCapacity {
	return podspec.NodeCapacity{Allocatable: p.allocatable(), Accelerator: p.cfg.Accelerator, UEFI: p.cfg.UEFICode != "",
		VMOverhead: *resource.NewQuantity(p.cfg.VMOverhead, resource.BinarySI)}
}

// ---- the executor side: vmTarget as a jumpstarter.Resizer ----

var _ jumpstarter.Resizer = (*vmTarget)(nil)

// SetMemorySize checks bytes against the pod and the node (under the
// admission lock, so no pod is admitted against the old claim meanwhile),
// records it and shows it on the pod.
func (t *vmTarget) SetMemorySize(ctx context.Context, bytes int64) error {
	p, rec := t.p, t.rec
	node := p.nodeCapacity()
	p.mu.Lock()
	others := p.activePodsLocked()
	rec.mu.Lock()
	pod := rec.pod
	rec.mu.Unlock()
	err := refused(podspec.CheckMemorySize(pod, bytes, node, others))
	var old *podstatus.VMSize
	if err == nil {
		old = t.changeSize(func(s *podstatus.VMSize) { s.MemoryBytes = int64(podspec.MemoryMiB(bytes)) << 20 })
	}
	p.mu.Unlock()
	if err == nil {
		err = t.recordSize(old)
	}
	return t.sizeResult(ctx, "memory", bytes, err)
}

// SetDiskSize checks bytes against the image's disk, the pod's limit and
// the node's free space, records it and shows it on the pod.
func (t *vmTarget) SetDiskSize(ctx context.Context, bytes int64) error {
	bytes = (bytes + 511) &^ 511 // qemu-img sizes are whole sectors
	f, err := t.diskFacts(ctx)
	if err == nil {
		t.rec.mu.Lock()
		pod := t.rec.pod
		t.rec.mu.Unlock()
		err = refused(podspec.CheckDiskSize(pod, bytes, f))
	}
	if err == nil {
		err = t.recordSize(t.changeSize(func(s *podstatus.VMSize) { s.DiskBytes = bytes }))
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
// pod's overlay, the free space.
func (t *vmTarget) diskFacts(ctx context.Context) (podspec.DiskFacts, error) {
	p, rec := t.p, t.rec
	rec.mu.Lock()
	plan := rec.plan
	ref := plan.Image
	if rec.state.FlashedImage != "" {
		ref = rec.state.FlashedImage
	}
	rec.mu.Unlock()
	f := podspec.DiskFacts{SnapshotStart: plan.SnapshotStart}
	img := p.flashedRoot(rec) // exporter_flash.go: a flashed root is the disk the VM boots
	if img == nil {
		if p.cfg.Images == nil {
			return f, errors.New("disk size: this node has no image store")
		}
		var err error
		img, err = p.cfg.Images.Pull(ctx, ref, oci.PullOptions{Policy: oci.PullNever})
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
	overlay := filepath.Join(rec.dir, OverlayFileName)
	if _, err := os.Stat(overlay); err == nil {
		if oi, err := qemu.InspectImage(ctx, overlay); err == nil {
			f.CurrentBytes = max(f.CurrentBytes, oi.VirtualSize)
		}
	}
	var fs syscall.Statfs_t
	if err := syscall.Statfs(rec.dir, &fs); err != nil {
		return f, fmt.Errorf("disk size: free space of %s: %w", rec.dir, err)
	}
	f.FreeBytes = int64(fs.Bavail) * int64(fs.Bsize)
	return f, nil
}

// changeSize changes the size in memory and returns the one before (nil:
// none).
func (t *vmTarget) changeSize(change func(*podstatus.VMSize)) (old *podstatus.VMSize) {
	rec := t.rec
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.state.Size != nil {
		c := *rec.state.Size
		old = &c
	} else {
		rec.state.Size = &podstatus.VMSize{}
	}
	change(rec.state.Size)
	rec.state.Size.Changed = t.p.now().UTC()
	return old
}

// recordSize writes status.json before the call returns: a size that
// cannot be recorded is not kept (the call fails, the size is old again).
func (t *vmTarget) recordSize(old *podstatus.VMSize) error {
	rec := t.rec
	if err := rec.persist(); err != nil {
		rec.mu.Lock()
		rec.state.Size = old
		rec.mu.Unlock()
		t.p.persist(rec) // the record as it was (and the event of a failing disk)
		return fmt.Errorf("record the size in the pod's state dir: %w", err)
	}
	return nil
}

// sizeResult shows an accepted size on the pod (condition, event) and logs
// the outcome.
func (t *vmTarget) sizeResult(ctx context.Context, what string, bytes int64, err error) error {
	p, rec := t.p, t.rec
	rec.mu.Lock()
	pod := rec.pod.DeepCopy()
	rec.mu.Unlock()
	log := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod))
	if err != nil {
		log.Info("VM resize refused", "what", what, "bytes", bytes, "err", err.Error())
		return err
	}
	log.Info("VM resized for the next power on", "what", what, "bytes", bytes)
	p.event(pod, corev1.EventTypeNormal, podstatus.ReasonResized, fmt.Sprintf("VM %s will be %s from its next power on (Jumpstarter set_%s_size)", what, podspec.BytesOf(bytes), what))
	p.push(rec)
	return nil
}
