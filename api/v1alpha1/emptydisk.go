package v1alpha1

import (
	"fmt"

	"k8s.io/apimachinery/pkg/api/resource"
)

// EmptyDiskImage, as a VM pod's container image, boots an empty root disk
// instead of an OS image: a sparse qcow2 of the container's
// ephemeral-storage limit (else its request) under the firmware, for a
// Jumpstarter lease holder to flash (upstream Jumpstarter's model of a
// virtual target). Nothing is pulled for it. docs/pods.md, "A VM with no
// OS image".
const EmptyDiskImage = "qemu-kubelet.io/empty-disk"

// Bounds of an empty disk's size: whole sectors from 1 MiB to 64 TiB.
var (
	EmptyDiskMin = resource.MustParse("1Mi")
	EmptyDiskMax = resource.MustParse("64Ti")
)

// EmptyDiskSector is the unit of an empty disk's size, in bytes.
const EmptyDiskSector = 512

// EmptyDiskSizeError says why q cannot be an empty disk's size (nil: it
// can).
func EmptyDiskSizeError(q resource.Quantity) error {
	switch {
	case q.Cmp(EmptyDiskMin) < 0 || q.Cmp(EmptyDiskMax) > 0:
		return fmt.Errorf("%s: an empty disk is %s to %s", q.String(), EmptyDiskMin.String(), EmptyDiskMax.String())
	case q.Value()%EmptyDiskSector != 0:
		return fmt.Errorf("%s: an empty disk is whole %d-byte sectors", q.String(), EmptyDiskSector)
	}
	return nil
}
