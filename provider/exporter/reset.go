package exporter

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"golang.org/x/sys/unix"
)

// The reset at a lease's end (the lease state policy Reset, the hooks'
// reset action: jumpstarter.Resetter): the pod returns to what its set
// defines. It is a flash request (Flash, install.go) that installs the
// pod's own definition: the pod's worker stops the VM if one runs, drops
// what flashes and sizes changed, and starts it again. Like a flash it is
// written to the state dir before it is answered and a failure half way
// leaves the record and the disk as they were.

var _ jumpstarter.Resetter = (*Target)(nil)

// ResetTarget returns the VM to what the pod defines (jumpstarter.Resetter):
// its image (a flashed root or image dropped), firmware (flashed bios and
// OVMF dropped), size (sizes set through the exporter undone), a fresh
// disk unless ResetKeepsDisk, and powered on. It waits for the worker's
// answer: the new VM started.
func (t *Target) ResetTarget(ctx context.Context) error {
	plan, st := t.pod.Record()
	return t.pod.Flash(ctx, NewReset(ResetKeepsDisk(plan.StatePolicy, st)))
}

// resetting is what a reset request carries.
type resetting struct {
	// keepDisk: the pod's disk (and UEFI variables) stay.
	keepDisk bool
}

// NewReset is a reset request; keepDisk keeps the pod's disk and UEFI
// variable store (ResetKeepsDisk).
func NewReset(keepDisk bool) *Flash { return &Flash{reset: &resetting{keepDisk: keepDisk}} }

// IsReset: f is a reset, not a flash.
func (f *Flash) IsReset() bool { return f.reset != nil }

// ResetKeepsDisk says whether a reset keeps the pod's disk: only under
// the state policy Retain (the set keeps disks across leases) and when
// nothing changed what the disk is over or its size (no flashed image or
// root, no disk size set); otherwise the VM boots a fresh disk over the
// pod's image, with fresh UEFI variables. Pure.
func ResetKeepsDisk(policy v1alpha1.StatePolicy, st podstatus.VMState) bool {
	if policy != v1alpha1.StatePolicyRetain || st.FlashedImage != "" {
		return false
	}
	if _, ok := st.Flashed[jumpstarter.PartitionRoot]; ok {
		return false
	}
	return st.Size == nil || st.Size.DiskBytes == 0
}

// placeReset sets aside the disk and the UEFI variables the reset drops.
func (pl *Placed) placeReset(r *resetting, overlay string) error {
	if r.keepDisk {
		return nil
	}
	if err := pl.setAside(overlay); err != nil {
		return fmt.Errorf("reset: set the old disk aside: %w", err)
	}
	if err := pl.setAside(filepath.Join(pl.dir, qemu.UEFIVarsName)); err != nil {
		return fmt.Errorf("reset: set the old UEFI variables aside: %w", err)
	}
	return nil
}

// recordReset drops from st what flashes and sizes changed: the pod boots
// its own image, firmware and size again. The image digest stays until
// the next start records the pod's (its hold follows it there). Pure.
func recordReset(st *podstatus.VMState) {
	st.FlashedImage = ""
	st.Flashed = nil
	st.Size = nil
}

// emptyFlashDir removes the files of the pod's flash dir once a reset is
// recorded (nothing refers to them any more); best effort, through the
// open dir, never following a link.
func emptyFlashDir(dir string) {
	d, err := openFlashDir(dir)
	if err != nil {
		return
	}
	defer d.Close()
	names, err := d.Readdirnames(-1)
	if err != nil {
		return
	}
	for _, n := range names {
		_ = unix.Unlinkat(int(d.Fd()), n, 0)
	}
}

// resetMessage is the event message of an installed reset.
func resetMessage(r *resetting) string {
	if r.keepDisk {
		return "VM reset to the pod's definition (image, firmware, size; disk kept by state policy Retain); it boots again"
	}
	return "VM reset to the pod's definition (image, firmware, size, a fresh disk); it boots again"
}

// Reason is the reason of the event of an installed flash or reset.
func (f *Flash) Reason() string {
	if f.reset != nil {
		return "Reset"
	}
	return "Flashed"
}
