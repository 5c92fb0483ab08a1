package exporter

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
)

// The pod's partitions, as upstream's QEMU driver names them (flash, dump
// and flash_oci of the exporter's flasher; jumpstarter.DiskTarget):
//   - root: a whole disk image (raw or qcow2, no backing or data file). A
//     flashed root is what the VM boots from then on, through its firmware
//     and the image's own bootloader, whatever the pod's image was (a
//     kernel+initrd artifact included); every start makes the pod's usual
//     overlay over it (state policy Retain keeps that overlay), so the
//     flashed file itself is never written by the guest and dump returns
//     it byte for byte. Not flashed: the pod's image's disk.
//   - bios: a raw firmware file QEMU loads with -bios. Not flashed: QEMU's
//     SeaBIOS.
//   - OVMF_CODE.fd, OVMF_VARS.fd: raw UEFI firmware and its variable store
//     template; either one flashed makes the VM boot through UEFI (the
//     node's OVMF file for the other). Not flashed: the node's OVMF.
//
// A flash writes the image aside (a temporary file in the pod's flash
// dir), fsyncs it and checks it; only then does the pod's worker power the
// VM off, rename it into place as <partition>-<digest>, record it in
// status.json (VM and agent restarts keep it) and power the VM on again
// if it was on. A failed flash removes its temporary file and touches
// nothing else. The pod shows a flashed root as its container's imageID
// (flash/root@sha256:...), and every flash as a Flashed event.

// FlashDirName is the directory of a pod's state dir holding its flashed
// partitions.
const FlashDirName = "flash"

// Partition size limits of the node.
const (
	// firmwareMaxBytes bounds bios and OVMF partitions.
	firmwareMaxBytes = 16 << 20
	// flashFreeReserve is left free on the state dir's filesystem by a
	// root flash (the node's own reserved ephemeral-storage default).
	flashFreeReserve = 1 << 30
	// flashedRootRef is the image reference a flashed root shows as.
	flashedRootRef = "flash/root"
)

var _ jumpstarter.DiskTarget = (*Target)(nil)

func validPartition(part string) error {
	for _, n := range jumpstarter.Partitions {
		if part == n {
			return nil
		}
	}
	return fmt.Errorf("%w: invalid partition name %q", jumpstarter.ErrInvalidArgument, part)
}

// PartitionLimit: root may hold what the state dir's filesystem has free
// beyond a reserve and beyond what flashes in progress hold
// (diskspace.go), and at most the pod's ephemeral-storage limit when it
// has one (the flashed root is the pod's disk, as set_disk_size's bound);
// firmware partitions 16 MiB.
func (t *Target) PartitionLimit(part string) (int64, error) {
	if err := validPartition(part); err != nil {
		return 0, err
	}
	if part != jumpstarter.PartitionRoot {
		return firmwareMaxBytes, nil
	}
	limit, err := nodeDisk.available(t.pod.Dir(), flashFreeReserve)
	if err != nil {
		return 0, err
	}
	if limit <= 0 {
		return 0, fmt.Errorf("the node has no room for a root image (its state dir's free space, less %d MiB kept in reserve and what flashes in progress hold, is used up)", flashFreeReserve>>20)
	}
	if cs := t.pod.Pod().Spec.Containers; len(cs) > 0 {
		if q, ok := cs[0].Resources.Limits[corev1.ResourceEphemeralStorage]; ok {
			limit = min(limit, q.Value())
		}
	}
	return limit, nil
}

// WritePartition writes img aside, checks it and has the worker install it.
func (t *Target) WritePartition(ctx context.Context, part string, img io.Reader, progress func(string)) error {
	if progress == nil {
		progress = func(string) {}
	}
	limit, err := t.PartitionLimit(part)
	if err != nil {
		return err
	}
	d, err := openFlashDir(t.pod.Dir()) // flashdir.go
	if err != nil {
		return fmt.Errorf("flash %s: %w", part, err)
	}
	defer d.Close()
	f, err := createIn(d, "."+part+".tmp-")
	if err != nil {
		return fmt.Errorf("flash %s: %w", part, err)
	}
	tmp := filepath.Base(f.Name())
	remove := func() { _ = unix.Unlinkat(int(d.Fd()), tmp, 0) }
	defer f.Close()
	fail := func(err error) error {
		remove()
		return err
	}
	hold := nodeDisk.hold(t.pod.Dir(), flashFreeReserve) // diskspace.go
	defer hold.release()
	h := sha256.New()
	n, err := writeSparse(f, img, h, limit, hold)
	if err != nil {
		return fail(err)
	}
	if err := f.Sync(); err != nil {
		return fail(fmt.Errorf("flash %s: sync: %w", part, err))
	}
	digest := "sha256:" + hex.EncodeToString(h.Sum(nil))
	format, err := checkPartitionImage(ctx, part, f, limit)
	if err != nil {
		return fail(err)
	}
	progress(fmt.Sprintf("received %d bytes (%s, %s)", n, format, digest))
	pf := &Partition{name: part, tmp: tmp, rec: podstatus.FlashedPartition{
		File: part + "-" + strings.TrimPrefix(digest, "sha256:")[:12], Digest: digest, Size: n, Format: format}}
	if t.Powered() {
		progress("powering off, installing and powering on")
	}
	dir := t.pod.Dir()
	err = t.pod.Flash(ctx, &Flash{Part: pf, Hold: func() { removeIn(dir, tmp) }})
	if err != nil {
		t.pod.Event(corev1.EventTypeWarning, "FlashFailed", fmt.Sprintf("Flash of partition %s: %v", part, err))
		return err
	}
	return nil
}

// Buffers of a flash in flight (writeSparse): flashBuffers of flashBlock
// bytes, the most a flash holds beyond what the transport buffers.
const (
	flashBlock   = 1 << 20
	flashBuffers = 4
	// flashWriteback starts the disk's writeback every this many bytes
	// written through the page cache, so the final fsync has little left
	// to wait for.
	flashWriteback = 16 << 20
	// directAlign is the alignment of O_DIRECT writes (buffer, offset and
	// length): the page size, a multiple of every disk's logical block.
	directAlign = 4096
)

// flashChunk is one block of the image on its way to the hash and the file.
type flashChunk struct {
	b    []byte
	off  int64
	left atomic.Int32 // stages still using b
}

// writeSparse copies r into f (at most limit bytes), hashing every byte
// and seeking over all-zero blocks so a mostly empty disk image stays
// sparse. Reading (the transfer, its decoding) runs on the caller's
// goroutine, hashing and writing on one goroutine each, over flashBuffers
// blocks that go round: a slower disk or hash holds the reader
// (back-pressure), and memory stays bounded. Blocks go to the disk with
// O_DIRECT where the file system takes it (see flashWriter). Errors of r
// are returned as they are (they say what the transfer did); errors of f
// name the file.
func writeSparse(f *os.File, r io.Reader, h hash.Hash, limit int64, hold *diskHold) (int64, error) {
	free := make(chan *flashChunk, flashBuffers)
	for range flashBuffers {
		free <- &flashChunk{b: alignedBlock(flashBlock)}
	}
	fw := newFlashWriter(f)
	fw.hold = hold
	defer fw.close()
	// Each stage's channel holds every block: sends never wait.
	toHash := make(chan *flashChunk, flashBuffers)
	toWrite := make(chan *flashChunk, flashBuffers)
	done := func(c *flashChunk) {
		if c.left.Add(-1) == 0 {
			free <- c
		}
	}
	var werr error                // the writer's, read after wg.Wait
	failed := make(chan struct{}) // closed by the writer on error
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for c := range toHash {
			h.Write(c.b)
			done(c)
		}
	}()
	go func() {
		defer wg.Done()
		for c := range toWrite {
			if werr == nil {
				if werr = fw.write(c.b, c.off); werr != nil {
					close(failed)
				}
			}
			done(c)
		}
	}()
	var n int64
	var rerr error
	for rerr == nil {
		var c *flashChunk
		select {
		case c = <-free:
		case <-failed:
		}
		if c == nil {
			break
		}
		k, err := io.ReadFull(r, c.b[:cap(c.b)])
		switch {
		case k > 0 && n+int64(k) > limit:
			rerr = fmt.Errorf("%w: the image is larger than the partition may hold (%d bytes: the pod's ephemeral-storage limit or the node's free space when the flash began)", jumpstarter.ErrInvalidArgument, limit)
		case k > 0:
			c.b, c.off = c.b[:k], n
			c.left.Store(2)
			toHash <- c
			toWrite <- c
			n += int64(k)
			c = nil
		}
		if c != nil {
			free <- c
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if rerr == nil {
			rerr = err
		}
	}
	close(toHash)
	close(toWrite)
	wg.Wait()
	switch {
	case werr != nil:
		return n, werr
	case rerr != nil:
		return n, rerr
	case n == 0:
		return 0, fmt.Errorf("%w: the image is empty", jumpstarter.ErrInvalidArgument)
	}
	if err := f.Truncate(n); err != nil {
		return n, fmt.Errorf("write %s: %w", f.Name(), err)
	}
	return n, nil
}

// alignedBlock is n bytes starting on a directAlign boundary.
func alignedBlock(n int) []byte {
	b := make([]byte, n+directAlign)
	skip := (directAlign - int(uintptr(unsafe.Pointer(&b[0]))%directAlign)) % directAlign
	return b[skip : skip+n : skip+n]
}

// flashWriter writes an image's blocks into its file (the writer
// goroutine of writeSparse owns it). Aligned runs go through a second
// descriptor opened with O_DIRECT: straight from the block to the disk,
// without the page cache's copy and dirty-page accounting, which cost
// the kernel several times the CPU of the copy itself at a flash's pace,
// and with nothing left for the final fsync but metadata. The unaligned
// tail of an image, and everything on a file system that refuses
// O_DIRECT (tmpfs), go through the page cache, whose writeback starts
// every flashWriteback bytes.
type flashWriter struct {
	f, direct *os.File
	synced    int64     // written through the page cache up to here
	hold      *diskHold // the disk space it writes (nil: not counted)
}

func newFlashWriter(f *os.File) *flashWriter {
	fw := &flashWriter{f: f}
	// The same file again (never its name, which a link could redirect).
	if d, err := os.OpenFile(fmt.Sprintf("/proc/self/fd/%d", f.Fd()), os.O_WRONLY|unix.O_DIRECT, 0); err == nil {
		fw.direct = d
	}
	return fw
}

func (fw *flashWriter) close() {
	if fw.direct != nil {
		fw.direct.Close()
	}
}

// write writes b at off, skipping its all-zero pages.
func (fw *flashWriter) write(b []byte, off int64) error {
	var zeros [directAlign]byte
	for i := 0; i < len(b); {
		end := min(i+len(zeros), len(b))
		if bytes.Equal(b[i:end], zeros[:end-i]) {
			i = end
			continue
		}
		// a run of non-zero pages
		run := end
		for run < len(b) {
			e := min(run+len(zeros), len(b))
			if bytes.Equal(b[run:e], zeros[:e-run]) {
				break
			}
			run = e
		}
		if err := fw.writeAt(b[i:run], off+int64(i)); err != nil {
			if errors.Is(err, jumpstarter.ErrInvalidArgument) {
				return err // no room for the image
			}
			return fmt.Errorf("write %s: %w", fw.f.Name(), err)
		}
		i = run
	}
	return nil
}

func (fw *flashWriter) writeAt(p []byte, off int64) error {
	if err := fw.hold.use(int64(len(p))); err != nil {
		return err
	}
	if fw.direct != nil && off%directAlign == 0 && len(p)%directAlign == 0 &&
		uintptr(unsafe.Pointer(&p[0]))%directAlign == 0 {
		_, err := fw.direct.WriteAt(p, off)
		if !errors.Is(err, unix.EINVAL) {
			return err
		}
		fw.direct.Close() // this file system refuses it after all
		fw.direct = nil
	}
	if _, err := fw.f.WriteAt(p, off); err != nil {
		return err
	}
	if end := off + int64(len(p)); end-fw.synced >= flashWriteback {
		// Best effort: the final fsync reports what fails.
		_ = unix.SyncFileRange(int(fw.f.Fd()), fw.synced, end-fw.synced, unix.SYNC_FILE_RANGE_WRITE)
		fw.synced = end
	}
	return nil
}

// checkPartitionImage is the node's rule for what a partition may hold:
// root a raw or qcow2 disk (qemu-img's view) with no backing or external
// data file and a virtual size within the limit; firmware raw bytes.
func checkPartitionImage(ctx context.Context, part string, f *os.File, limit int64) (string, error) {
	info, err := inspectUpload(ctx, f) // inspect.go
	if err != nil {
		return "", fmt.Errorf("%w: partition %s: qemu-img cannot read the image: %v", jumpstarter.ErrInvalidArgument, part, err)
	}
	if part != jumpstarter.PartitionRoot {
		if info.Format != string(qemu.FormatRaw) {
			return "", fmt.Errorf("%w: partition %s holds raw firmware, not a %s image", jumpstarter.ErrInvalidArgument, part, info.Format)
		}
		return info.Format, nil
	}
	switch qemu.DiskFormat(info.Format) {
	case qemu.FormatRaw, qemu.FormatQCOW2:
	default:
		return "", fmt.Errorf("%w: partition root: format %s is not bootable here (raw or qcow2; convert with qemu-img convert -O qcow2)", jumpstarter.ErrInvalidArgument, info.Format)
	}
	if info.BackingFile != "" {
		return "", fmt.Errorf("%w: partition root: the qcow2 image names a backing file (%q); flash a self-contained image", jumpstarter.ErrInvalidArgument, info.BackingFile)
	}
	if info.FormatSpecific.Data.DataFile != "" {
		return "", fmt.Errorf("%w: partition root: the qcow2 image names an external data file; flash a self-contained image", jumpstarter.ErrInvalidArgument)
	}
	if info.VirtualSize > limit {
		return "", fmt.Errorf("%w: partition root: the image's virtual size (%d bytes) is larger than the partition may hold (%d bytes: the pod's ephemeral-storage limit or the node's free space)", jumpstarter.ErrInvalidArgument, info.VirtualSize, limit)
	}
	return info.Format, nil
}

// ReadPartition opens what the partition holds: for root the disk as the
// guest left it (dump.go), for the others and for a name with
// jumpstarter.FlashedPrefix the flashed file, or the node's default (the
// pod's image's disk for root, the node's OVMF).
func (t *Target) ReadPartition(ctx context.Context, part string) (io.ReadCloser, int64, error) {
	flashedOnly := strings.HasPrefix(part, jumpstarter.FlashedPrefix)
	part = strings.TrimPrefix(part, jumpstarter.FlashedPrefix)
	if err := validPartition(part); err != nil {
		return nil, 0, err
	}
	if part == jumpstarter.PartitionRoot && !flashedOnly {
		return t.readGuestDisk(ctx) // dump.go
	}
	return t.readFlashed(ctx, part)
}

// readFlashed opens what was flashed onto part, or the node's default.
func (t *Target) readFlashed(ctx context.Context, part string) (io.ReadCloser, int64, error) {
	plan, st := t.pod.Record()
	fp, flashed := st.Flashed[part]
	if st.FlashedImage != "" {
		plan.Image, plan.PullPolicy = st.FlashedImage, oci.PullIfNotPresent
	}
	var path string
	switch {
	case flashed:
		d, err := openFlashDir(t.pod.Dir())
		if err != nil {
			return nil, 0, fmt.Errorf("partition %s: %w", part, err)
		}
		defer d.Close()
		f, err := openIn(d, fp.File)
		if err != nil {
			return nil, 0, fmt.Errorf("partition %s: %w", part, err)
		}
		return sized(f, part)
	case part == jumpstarter.PartitionRoot:
		img := OwnRoot(t.pod.Dir(), plan, st) // the empty disk (a flashed root was flashed)
		if img == nil {
			img = t.presentImage(ctx, plan)
		}
		if img == nil {
			return nil, 0, fmt.Errorf("the VM's image %s is not on the node (power the VM on to pull it)", plan.Image)
		}
		if img.Disk == "" {
			return nil, 0, fmt.Errorf("%w: the VM boots a kernel and initrd (%s): it has no root disk to dump", jumpstarter.ErrInvalidArgument, plan.Image)
		}
		path = img.Disk
	case part == jumpstarter.PartitionBIOS:
		return nil, 0, fmt.Errorf("%w: nothing was flashed onto bios: the VM boots QEMU's built-in SeaBIOS", jumpstarter.ErrInvalidArgument)
	case part == jumpstarter.PartitionOVMFCode:
		path = t.node.UEFICode
	case part == jumpstarter.PartitionOVMFVars:
		path = t.node.UEFIVars
	}
	if path == "" {
		return nil, 0, fmt.Errorf("%w: nothing was flashed onto %s and the node has no OVMF", jumpstarter.ErrInvalidArgument, part)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, fmt.Errorf("partition %s: %w", part, err)
	}
	return sized(f, part)
}

// sized is f with its size.
func sized(f *os.File, part string) (io.ReadCloser, int64, error) {
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("partition %s: %w", part, err)
	}
	return f, fi.Size(), nil
}

// flashOCIPartition pulls ref (as flash does, with opts) and writes its
// disk onto a firmware partition.
func (t *Target) flashOCIPartition(ctx context.Context, ref, part string, opts oci.PullOptions, progress func(string)) error {
	if progress == nil {
		progress = func(string) {}
	}
	limit, err := t.PartitionLimit(part)
	if err != nil {
		return err
	}
	if t.node.Images == nil {
		return errors.New("flash: this node has no image store")
	}
	ref = strings.TrimPrefix(strings.TrimSpace(ref), "oci://")
	progress(fmt.Sprintf("pulling %s", ref))
	t0 := time.Now()
	img, err := t.node.Images.Pull(ctx, ref, flashPullOptions(opts, progress)) // target.go
	if err != nil {
		return fmt.Errorf("flash %s: %w", ref, err)
	}
	progress(fmt.Sprintf("pulled %s (%s) in %s", ref, img.Digest, time.Since(t0).Round(time.Millisecond)))
	if img.Disk == "" {
		return fmt.Errorf("%w: image %s has no disk to flash onto %s", jumpstarter.ErrInvalidArgument, ref, part)
	}
	hold, err := t.node.Images.Acquire(img.Digest)
	if err != nil {
		return fmt.Errorf("flash %s: hold the image: %w", ref, err)
	}
	defer hold()
	f, err := os.Open(img.Disk)
	if err != nil {
		return fmt.Errorf("flash %s: %w", ref, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > limit {
		return fmt.Errorf("%w: image %s's disk (%d bytes) is larger than partition %s may hold (%d bytes)", jumpstarter.ErrInvalidArgument, ref, fi.Size(), part, limit)
	}
	return t.WritePartition(ctx, part, f, progress)
}

// presentImage is the image of plan when the node has it and its pull
// policy lets it be used without a pull (nil: not).
func (t *Target) presentImage(ctx context.Context, plan podspec.Plan) *oci.Image {
	if plan.PullPolicy == oci.PullAlways || t.node.Images == nil {
		return nil
	}
	img, err := t.node.Images.Pull(ctx, plan.Image, oci.PullOptions{Policy: oci.PullNever})
	if err != nil {
		return nil
	}
	return img
}
