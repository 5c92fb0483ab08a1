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
}

// Partition is a partition image written aside and verified.
type Partition struct {
	name string // partition
	tmp  string // written aside in the flash dir
	rec  podstatus.FlashedPartition
}

// What names what f installs.
func (f *Flash) What() string {
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
// writable disk is overlay: the old disk goes (a new image or root:
// a fresh disk, so state policy Retain does not keep it, even for the same
// image), a partition drops the UEFI variable store (flashed firmware
// gets a fresh one) and is renamed into the flash dir. A failure releases
// f's hold and leaves the pod's state as it was. The pod's worker calls it
// with no VM running, then Record.
func (f *Flash) Place(dir, overlay string) error {
	pf := f.Part
	if pf == nil {
		if err := os.Remove(overlay); err != nil && !errors.Is(err, os.ErrNotExist) {
			f.Release()
			return fmt.Errorf("flash: remove the old disk: %w", err)
		}
		return nil
	}
	fdir := filepath.Join(dir, FlashDirName)
	if pf.name == jumpstarter.PartitionRoot {
		if err := os.Remove(overlay); err != nil && !errors.Is(err, os.ErrNotExist) {
			f.Release()
			return fmt.Errorf("flash root: remove the old disk: %w", err)
		}
	}
	if err := os.Remove(filepath.Join(dir, qemu.UEFIVarsName)); err != nil && !errors.Is(err, os.ErrNotExist) {
		f.Release()
		return fmt.Errorf("flash %s: remove the old UEFI variables: %w", pf.name, err)
	}
	if err := os.Rename(pf.tmp, filepath.Join(fdir, pf.rec.File)); err != nil {
		f.Release()
		return fmt.Errorf("flash %s: %w", pf.name, err)
	}
	f.Hold = nil // the file is the pod's now
	if d, err := os.Open(fdir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// Record makes the placed flash the one the VM boots from now on in the
// pod's state st: a new image replaces a flashed root; a partition is
// added to st.Flashed (copied, never changed in place: copies of the
// state share the map), and a flashed root replaces the pod's image.
// podImageGoes: the pod's hold on its image goes (a flash of root);
// stale is a file to remove once the state is written ("": none). Pure
// but for its input.
func (f *Flash) Record(dir string, st *podstatus.VMState) (podImageGoes bool, stale string) {
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

// Flashed is the event message of an installed flash.
func (f *Flash) Flashed() string {
	if pf := f.Part; pf != nil {
		return fmt.Sprintf("Partition %s replaced by a flashed %s image (%s, %d bytes); the VM boots it from now on", pf.name, pf.rec.Format, pf.rec.Digest, pf.rec.Size)
	}
	return fmt.Sprintf("VM disk replaced by image %s (%s); it boots from it from now on", f.Image.Ref, f.Image.Digest)
}

// RecordError is the error of a flash whose state could not be written.
func (f *Flash) RecordError(err error) error {
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
