package exporter

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// The empty root disk of a pod whose image is v1alpha1.EmptyDiskImage
// (podspec.Plan.IsEmptyDisk): a sparse qcow2 of the plan's size in the
// pod's state dir, made at the first start, under the pod's overlay as an
// image's disk is. It boots under the firmware (no kernel). A flash of
// root replaces it as it replaces an image; a reset returns to it (a
// fresh overlay over it). Nothing of the image store is pulled or held.

// EmptyDiskFileName is the empty root disk in the pod's state dir.
const EmptyDiskFileName = "empty-disk.qcow2"

// EmptyDisk is the image an empty-disk pod with state dir dir and a disk
// of size bytes boots as. Its digest names the size (a sha256 of the
// image name and the size: the same size, the same digest).
func EmptyDisk(dir string, size int64) *oci.Image {
	sum := sha256.Sum256(fmt.Appendf(nil, "%s %d", v1alpha1.EmptyDiskImage, size))
	return &oci.Image{Ref: v1alpha1.EmptyDiskImage, Digest: fmt.Sprintf("sha256:%x", sum),
		Disk: filepath.Join(dir, EmptyDiskFileName), DiskFormat: string(qemu.FormatQCOW2)}
}

// IsEmptyDisk: img is a pod's empty disk, not an image of the store.
func IsEmptyDisk(img *oci.Image) bool { return img.Ref == v1alpha1.EmptyDiskImage }

// OwnRoot is the root disk the pod (state dir dir, plan and state st)
// boots when it is not an image of the node's store: a flashed root,
// else its empty disk (unless an image was flashed over it). nil: the
// pod boots its image (or the one flashed) from the store.
func OwnRoot(dir string, plan podspec.Plan, st podstatus.VMState) *oci.Image {
	if img := FlashedRoot(dir, st); img != nil {
		return img
	}
	if st.FlashedImage == "" && plan.IsEmptyDisk() {
		return EmptyDisk(dir, plan.EmptyDiskBytes)
	}
	return nil
}

// EnsureEmptyDisk makes the empty disk img (EmptyDisk's) of size bytes
// unless it is there already (an earlier run's: it is never written, the
// overlay over it is).
func EnsureEmptyDisk(ctx context.Context, img *oci.Image, size int64) error {
	if _, err := os.Stat(img.Disk); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("empty disk: %w", err)
	}
	if err := qemu.CreateScratchDisk(ctx, img.Disk, size); err != nil {
		return fmt.Errorf("empty disk: %w", err)
	}
	return nil
}

// BootsEmptyDisk: the pod's VM (state st) booted its empty disk, not a
// flashed root or an image: no guest answers the ACPI power button, so a
// stop quits QEMU at once. Pure.
func BootsEmptyDisk(st podstatus.VMState) bool {
	return strings.HasPrefix(st.ImageID, v1alpha1.EmptyDiskImage+"@")
}
