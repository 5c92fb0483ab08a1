package exporter

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"syscall"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"golang.org/x/sys/unix"
)

// dump root: the disk as the guest left it. The pod's disk is its qcow2
// overlay over the root it boots (a flashed root, or its image's disk);
// dump reads the two as one image (qemu-img convert), in the root's own
// format (a raw root dumps raw, a qcow2 root qcow2), into a file of the
// flash dir that is unlinked once written, and streams that. The VM must
// be powered off: a running guest changes the disk under the read, so
// dump refuses (flashed:root, the flashed file, can be dumped any time).
// The overlay is read without taking QEMU's image lock, so a power on
// during the read is never blocked by it; instead the overlay's identity
// and times are compared before and after, and a dump that saw the disk
// change (a power on, a flash) fails, saying so. A pod whose VM never ran
// since its root was flashed (or at all) has no overlay: dump root is
// then the root itself.

// ErrVMRunning is dump root refused while the VM runs.
var ErrVMRunning = fmt.Errorf("%w: the VM is running and its disk changes as the guest writes: power it off first (power off), or dump %sroot for what was flashed", jumpstarter.ErrInvalidArgument, jumpstarter.FlashedPrefix)

// convertMaxAddressSpace bounds qemu-img convert's address space (it reads
// an overlay QEMU's user could write); its I/O threads reserve stacks and
// malloc arenas, so the bound is wider than for qemu-img info on uploads,
// and the arenas are capped (MALLOC_ARENA_MAX).
const convertMaxAddressSpace = 4 << 30

// readGuestDisk opens the pod's disk as the guest left it (see above).
func (t *Target) readGuestDisk(ctx context.Context) (io.ReadCloser, int64, error) {
	if t.vm() != nil {
		return nil, 0, fmt.Errorf("dump root: %w", ErrVMRunning)
	}
	overlay := t.pod.Overlay()
	before, err := diskIdentity(overlay)
	if errors.Is(err, os.ErrNotExist) {
		return t.readFlashed(ctx, jumpstarter.PartitionRoot) // no run since it was flashed
	}
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	base, err := t.rootBase(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	info, err := qemu.InspectImage(ctx, overlay)
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	if err := checkOverlay(info, base); err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	bi, err := os.Stat(base.Disk)
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	hold := nodeDisk.hold(t.pod.Dir(), flashFreeReserve) // diskspace.go
	defer hold.release()
	// At most what both files hold (the copy keeps holes as holes).
	if err := hold.use(info.ActualSize + bi.Size()); err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	d, err := openFlashDir(t.pod.Dir()) // flashdir.go
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	defer d.Close()
	f, err := createIn(d, ".dump-root-")
	if err != nil {
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	// Once converted, the file is ours alone: unlinked, read through f.
	defer func() { _ = unix.Unlinkat(int(d.Fd()), fileName(f), 0) }()
	fail := func(err error) (io.ReadCloser, int64, error) {
		f.Close()
		return nil, 0, fmt.Errorf("dump root: %w", err)
	}
	if err := convertDisk(ctx, overlay, qemu.DiskFormat(base.DiskFormat), f.Name()); err != nil {
		return fail(err)
	}
	after, err := diskIdentity(overlay)
	if err != nil || after != before || t.vm() != nil {
		return fail(fmt.Errorf("%w: the VM's disk changed while it was read (powered on, or flashed): dump it again once the VM is off", jumpstarter.ErrInvalidArgument))
	}
	return sized(f, jumpstarter.PartitionRoot) // flash.go
}

// rootBase is the root the VM boots: a flashed root or its empty disk,
// else its image's disk (from the node's cache, as it ran).
func (t *Target) rootBase(ctx context.Context) (*oci.Image, error) {
	plan, st := t.pod.Record()
	if img := OwnRoot(t.pod.Dir(), plan, st); img != nil {
		return img, nil
	}
	ref := plan.Image
	if st.FlashedImage != "" {
		ref = st.FlashedImage
	}
	if t.node.Images == nil {
		return nil, errors.New("this node has no image store")
	}
	img, err := t.node.Images.Pull(ctx, ref, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil, fmt.Errorf("the image %s the VM boots is not in the node's cache: %w", ref, err)
	}
	if img.Disk == "" {
		return nil, fmt.Errorf("%w: the VM boots a kernel and initrd (%s): it has no root disk to dump", jumpstarter.ErrInvalidArgument, ref)
	}
	return img, nil
}

// checkOverlay: the overlay is a qcow2 image over base alone (what the
// node made it), so the read follows no other file its header could name.
// Pure.
func checkOverlay(info qemu.ImageInfo, base *oci.Image) error {
	switch {
	case info.Format != string(qemu.FormatQCOW2):
		return fmt.Errorf("the VM's disk is a %s image, not the qcow2 overlay the node made: not read", info.Format)
	case info.FormatSpecific.Data.DataFile != "":
		return errors.New("the VM's disk names an external data file, which the node never makes: not read")
	case info.BackingFile != base.Disk:
		return fmt.Errorf("%w: the VM's disk was left over %s, not the root it boots now (%s): power the VM on and off to dump it, or dump %sroot", jumpstarter.ErrInvalidArgument, info.BackingFile, base.Disk, jumpstarter.FlashedPrefix)
	}
	return nil
}

// diskID is what changes when a file is written, replaced or renamed.
type diskID struct {
	dev, ino    uint64
	size        int64
	mtime, ctim unix.Timespec
}

func diskIdentity(path string) (diskID, error) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return diskID{}, &os.PathError{Op: "stat", Path: path, Err: err}
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return diskID{}, fmt.Errorf("%s is not a regular file: not read", path)
	}
	return diskID{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctim: st.Ctim}, nil
}

// convertTool is qemu-img (tests wrap it).
var convertTool = qemu.QEMUImgBinary

// convertDisk writes the overlay and its backing file as one image of
// format (raw or qcow2) into out, with qemu-img under an address-space
// limit; the overlay is read without its lock (-U): readGuestDisk checks
// it did not change.
func convertDisk(ctx context.Context, overlay string, format qemu.DiskFormat, out string) error {
	if format != qemu.FormatRaw && format != qemu.FormatQCOW2 {
		format = qemu.FormatQCOW2
	}
	script := fmt.Sprintf(`ulimit -v %d && exec "$0" "$@"`, convertMaxAddressSpace>>10)
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", script, convertTool, "convert", "-q", "-U", "-f", "qcow2", "-O", string(format), overlay, out)
	cmd.Env = append(os.Environ(), "MALLOC_ARENA_MAX=2")
	var stderr limitedBuffer // inspect.go
	stderr.max = 64 << 10
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(stderr.String())
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ProcessState != nil && !ee.ProcessState.Exited() {
			if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
				msg = fmt.Sprintf("killed by %s (qemu-img converts with at most %d MiB of address space) %s", ws.Signal(), convertMaxAddressSpace>>20, msg)
			}
		}
		return fmt.Errorf("qemu-img convert: %w: %s", err, msg)
	}
	return nil
}

// fileName is f's name in its directory.
func fileName(f *os.File) string {
	n := f.Name()
	return n[strings.LastIndexByte(n, '/')+1:]
}
