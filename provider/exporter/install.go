package exporter

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// The pod worker's side of a flash (flash.go, target.go: the exporter's):
// what a flash request carries, what it leaves in the pod's state dir and
// state, and what a flashed pod boots. The worker calls them with no VM
// running (provider's installFlash) and when it builds a VM's spec.

// Flash is what a flash request asks the pod's worker to install: an
// image of the node's store (Image, held by Hold until the pod holds it),
// or a verified partition image written aside (Part; Hold removes it).
// Hold is released by whoever ends up not using it.
type Flash struct {
	Image *oci.Image
	Part  *Partition
	Hold  func()
	reset *resetting // a reset (reset.go), not a flash
}

// Partition is a partition image written aside and verified.
type Partition struct {
	name string // partition
	tmp  string // written aside in the flash dir (a name in it)
	rec  podstatus.FlashedPartition
}

// What names what f installs.
func (f *Flash) What() string {
	if f.reset != nil {
		return "reset"
	}
	if f.Part != nil {
		return "partition " + f.Part.name
	}
	return f.Image.Ref
}

// Release gives up f's hold (idempotent).
func (f *Flash) Release() {
	if f.Hold != nil {
		f.Hold()
		f.Hold = nil
	}
}

// Place puts f's files in place in the pod's state dir dir, whose
// writable disk is overlay: the old disk goes (a new image or root: a
// fresh disk, so state policy Retain does not keep it, even for the same
// image), a partition drops the UEFI variable store (flashed firmware
// gets a fresh one) and is renamed into the flash dir. What goes is set
// aside until the placed flash is committed (Placed.Commit, once it is
// recorded) or undone (Placed.Undo: the record could not be written), so
// a flash that fails half way leaves the disk as it was. A failure of
// Place itself undoes what it did and releases f's hold. The pod's
// worker calls it with no VM running, then Record.
func (f *Flash) Place(dir, overlay string) (*Placed, error) {
	pl := &Placed{f: f, dir: dir}
	fail := func(err error) (*Placed, error) {
		pl.Undo()
		return nil, err
	}
	if f.reset != nil {
		if err := pl.placeReset(f.reset, overlay); err != nil {
			return fail(err)
		}
		return pl, nil
	}
	pf := f.Part
	if pf == nil || pf.name == jumpstarter.PartitionRoot {
		if err := pl.setAside(overlay); err != nil {
			return fail(fmt.Errorf("flash: set the old disk aside: %w", err))
		}
	}
	if pf == nil {
		return pl, nil
	}
	if err := pl.setAside(filepath.Join(dir, qemu.UEFIVarsName)); err != nil {
		return fail(fmt.Errorf("flash %s: set the old UEFI variables aside: %w", pf.name, err))
	}
	d, err := openFlashDir(dir) // flashdir.go
	if err != nil {
		return fail(fmt.Errorf("flash %s: %w", pf.name, err))
	}
	defer d.Close()
	if err := placeFault(pf.name); err != nil {
		return fail(err)
	}
	if err := renameIn(d, pf.tmp, pf.rec.File); err != nil {
		return fail(fmt.Errorf("flash %s: %w", pf.name, err))
	}
	pl.placed = true
	_ = d.Sync()
	return pl, nil
}

// placeFault, when set (tests), fails a partition's Place after it set
// the old files aside: a flash that fails half way.
var placeFault = func(part string) error { return nil }

// asideSuffix names a file a flash set aside until it is committed.
const asideSuffix = ".pre-flash"

// Placed is a flash put in place, not yet committed: the files it
// replaced are set aside. The pod's worker owns it.
type Placed struct {
	f      *Flash
	dir    string   // the pod's state dir
	aside  []string // paths set aside (each to path+asideSuffix)
	placed bool     // the partition file was renamed into the flash dir
}

// setAside moves path to path+asideSuffix (nothing to do when it is not
// there). rename(2) moves a link itself, never what it points to.
func (pl *Placed) setAside(path string) error {
	if err := os.Rename(path, path+asideSuffix); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	pl.aside = append(pl.aside, path)
	return nil
}

// Commit drops what the flash replaced (its record was written).
func (pl *Placed) Commit() {
	for _, p := range pl.aside {
		_ = os.Remove(p + asideSuffix)
	}
	pl.aside = nil
	if pl.placed {
		pl.f.Hold = nil // the file is the pod's now
	}
	if pl.f.reset != nil {
		emptyFlashDir(pl.dir)
	}
}

// Undo puts back what the flash replaced and takes the flash's file out
// again (its record could not be written): the disk is as it was. The
// flash's hold is released. Errors are best effort: each is reported to
// the log by the caller through the flash's error.
func (pl *Placed) Undo() error {
	var errs []error
	if pl.placed {
		pf := pl.f.Part
		if d, err := openFlashDir(pl.dir); err == nil {
			if err := renameIn(d, pf.rec.File, pf.tmp); err != nil {
				errs = append(errs, err)
			}
			d.Close()
		} else {
			errs = append(errs, err)
		}
		pl.placed = false
	}
	for i := len(pl.aside) - 1; i >= 0; i-- {
		p := pl.aside[i]
		if err := os.Rename(p+asideSuffix, p); err != nil {
			errs = append(errs, fmt.Errorf("put %s back: %w", p, err))
		}
	}
	pl.aside = nil
	pl.f.Release()
	return errors.Join(errs...)
}

// Record makes the placed flash the one the VM boots from now on in the
// pod's state st: a new image replaces a flashed root; a partition is
// added to st.Flashed (copied, never changed in place: copies of the
// state share the map), and a flashed root replaces the pod's image.
// podImageGoes: the pod's hold on its image goes (a flash of root);
// stale is a file to remove once the state is written ("": none). Pure
// but for its input.
func (f *Flash) Record(dir string, st *podstatus.VMState) (podImageGoes bool, stale string) {
	if f.reset != nil {
		recordReset(st)
		return false, ""
	}
	if img := f.Image; img != nil {
		ref := podspec.ImageID(img)
		st.FlashedImage = ref
		st.ImageDigest = img.Digest
		st.ImageID = ref
		return false, dropFlashedRoot(dir, st) // the image replaces a flashed root
	}
	pf := f.Part
	old := st.Flashed[pf.name]
	fl := make(map[string]podstatus.FlashedPartition, len(st.Flashed)+1)
	for k, v := range st.Flashed {
		fl[k] = v
	}
	fl[pf.name] = pf.rec
	st.Flashed = fl
	if pf.name == jumpstarter.PartitionRoot {
		// The pod's image is no longer what the VM boots: its hold goes.
		podImageGoes = true
		st.FlashedImage = ""
		st.ImageDigest = pf.rec.Digest
		st.ImageID = flashedRootRef + "@" + pf.rec.Digest
	}
	if old.File != "" && old.File != pf.rec.File {
		stale = filepath.Join(dir, FlashDirName, old.File)
	}
	return podImageGoes, stale
}

// Unrecord undoes Record on st: the fields Record sets are taken back
// from before (the state as it was), the rest of st (changed meanwhile by
// other owners) is kept. Pure.
func (f *Flash) Unrecord(st *podstatus.VMState, before podstatus.VMState) {
	st.FlashedImage = before.FlashedImage
	st.ImageDigest = before.ImageDigest
	st.ImageID = before.ImageID
	st.Flashed = before.Flashed
	if f.reset != nil {
		st.Size = before.Size
	}
}

// Flashed is the event message of an installed flash.
func (f *Flash) Flashed() string {
	if f.reset != nil {
		return resetMessage(f.reset)
	}
	if pf := f.Part; pf != nil {
		return fmt.Sprintf("Partition %s replaced by a flashed %s image (%s, %d bytes); the VM boots it from now on", pf.name, pf.rec.Format, pf.rec.Digest, pf.rec.Size)
	}
	return fmt.Sprintf("VM disk replaced by image %s (%s); it boots from it from now on", f.Image.Ref, f.Image.Digest)
}

// RecordError is the error of a flash whose state could not be written.
func (f *Flash) RecordError(err error) error {
	if f.reset != nil {
		return fmt.Errorf("reset: record it in the pod's state dir: %w", err)
	}
	if pf := f.Part; pf != nil {
		return fmt.Errorf("flash %s: record it in the pod's state dir: %w", pf.name, err)
	}
	return fmt.Errorf("flash: record the new image in the pod's state dir: %w", err)
}

// dropFlashedRoot forgets a flashed root (flash_oci onto root replaces
// it) and returns its file ("": none).
func dropFlashedRoot(dir string, st *podstatus.VMState) (file string) {
	fr, ok := st.Flashed[jumpstarter.PartitionRoot]
	if !ok {
		return ""
	}
	fl := make(map[string]podstatus.FlashedPartition, len(st.Flashed))
	for k, v := range st.Flashed {
		if k != jumpstarter.PartitionRoot {
			fl[k] = v
		}
	}
	st.Flashed = fl
	return filepath.Join(dir, FlashDirName, fr.File)
}

// FlashedRoot is the image a flashed root boots as, for the pod with
// state dir dir and state st (nil: not flashed): its disk is the flashed
// file, with no kernel.
func FlashedRoot(dir string, st podstatus.VMState) *oci.Image {
	fr, ok := st.Flashed[jumpstarter.PartitionRoot]
	if !ok {
		return nil
	}
	return &oci.Image{Ref: flashedRootRef, Digest: fr.Digest, Disk: filepath.Join(dir, FlashDirName, fr.File), DiskFormat: fr.Format}
}

// IsFlashedRoot: img is a flashed root, not an image of the store.
func IsFlashedRoot(img *oci.Image) bool { return img.Ref == flashedRootRef }

// ApplyFlashedFirmware boots through the flashed firmware partitions
// flashed (of the pod with state dir dir): OVMF files make the VM UEFI
// (the node's OVMF, uefiCode and uefiVars, for the one not flashed), else
// a flashed bios is loaded with -bios.
func ApplyFlashedFirmware(dir string, flashed map[string]podstatus.FlashedPartition, uefiCode, uefiVars string, spec *qemu.Spec) {
	path := func(part string) string {
		if f, ok := flashed[part]; ok {
			return filepath.Join(dir, FlashDirName, f.File)
		}
		return ""
	}
	code, vars := path(jumpstarter.PartitionOVMFCode), path(jumpstarter.PartitionOVMFVars)
	if code != "" || vars != "" {
		spec.Firmware = qemu.FirmwareUEFI
		if code == "" {
			code = uefiCode
			spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(code))
		}
		if vars == "" {
			vars = uefiVars
			spec.AllowedDirs = append(spec.AllowedDirs, filepath.Dir(vars))
		}
		spec.UEFICode, spec.UEFIVarsTemplate = code, vars
		return
	}
	if b := path(jumpstarter.PartitionBIOS); b != "" {
		spec.Firmware, spec.BIOS = qemu.FirmwareBIOS, b
		spec.UEFICode, spec.UEFIVarsTemplate = "", ""
	}
}
