package jumpstarter

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// Partitions of upstream's QEMU flasher (QemuFlasher, Qemu.validate_partition).
const (
	PartitionRoot     = "root"
	PartitionBIOS     = "bios"
	PartitionOVMFCode = "OVMF_CODE.fd"
	PartitionOVMFVars = "OVMF_VARS.fd"
)

// Partitions lists every partition name flash, flash_oci and dump take.
var Partitions = []string{PartitionRoot, PartitionBIOS, PartitionOVMFCode, PartitionOVMFVars}

// DiskTarget is a Target whose partitions can be written from a byte
// stream and read back: the flasher's flash(handle, partition) and
// dump(handle, partition).
// The exporter asks Config.Target for it; a Target without it answers
// those calls Unimplemented. Methods may be called concurrently; the
// implementation serialises what must be.
type DiskTarget interface {
	// PartitionLimit is the most bytes partition may hold (the image as
	// decompressed). A partition the target does not have fails with
	// ErrInvalidArgument.
	PartitionLimit(partition string) (int64, error)
	// WritePartition makes everything read from img the partition's
	// content. It writes aside and installs only once img returned io.EOF
	// and the content passed the target's checks; any other error from img
	// (the client stopped, a corrupt or oversized image, ctx) leaves the
	// target exactly as it was: power state, what it boots, nothing
	// half-written that a later boot would use. A running target is
	// powered off for the switch and on again. progress gets
	// human-readable lines.
	WritePartition(ctx context.Context, partition string, img io.Reader, progress func(string)) error
	// ReadPartition opens what the partition holds for reading (size
	// bytes): for root, the disk as the guest left it (a running target
	// refuses); for the others, and for FlashedPrefix+partition, what was
	// flashed there, the node's default when nothing was.
	ReadPartition(ctx context.Context, partition string) (rc io.ReadCloser, size int64, err error)
}

// FlashedPrefix before a partition name asks dump for what was flashed
// there (the node's default when nothing was) rather than what the guest
// left: "flashed:root".
const FlashedPrefix = "flashed:"

// dumpPartitionArg is dump's partition argument: a partition, or one with
// FlashedPrefix.
func dumpPartitionArg(v any) (string, error) {
	if p, ok := v.(string); ok && strings.HasPrefix(p, FlashedPrefix) {
		if _, err := partitionArg(strings.TrimPrefix(p, FlashedPrefix)); err == nil {
			return p, nil
		}
	}
	p, err := partitionArg(v)
	if err != nil {
		return "", fmt.Errorf("%w; dump also takes each with the prefix %q, for what was flashed there", err, FlashedPrefix)
	}
	return p, nil
}

// partitionArg is a call's partition argument: null or "root" is root.
func partitionArg(v any) (string, error) {
	if v == nil {
		return PartitionRoot, nil
	}
	p, ok := v.(string)
	if ok {
		for _, n := range Partitions {
			if p == n {
				return p, nil
			}
		}
	}
	return "", fmt.Errorf("%w: invalid partition name: %s (root, bios, OVMF_CODE.fd or OVMF_VARS.fd)", ErrInvalidArgument, describeArg(v))
}

func (s *server) diskTarget() (DiskTarget, error) {
	dt, ok := s.e.cfg.Target.(DiskTarget)
	if !ok {
		return nil, fmt.Errorf("%w: this target cannot be flashed from a file or dumped", ErrUnsupported)
	}
	return dt, nil
}

// flashResource is flash(source, partition) with a resource handle: the
// resource, decoded by its content encoding and then by signature (gzip,
// xz, bz2, zstd, as upstream's AutoDecompressIterator), bounded by the
// partition's limit, streamed into the target.
func (s *server) flashResource(ctx context.Context, d *driver, args []any) error {
	dt, err := s.diskTarget()
	if err != nil {
		return err
	}
	part, err := partitionArg(arg(args, 1))
	if err != nil {
		return err
	}
	limit, err := dt.PartitionLimit(part)
	if err != nil {
		return err
	}
	release, err := s.e.transferSlot(ctx, "flash", nil) // limits.go
	if err != nil {
		return fmt.Errorf("flash %s: %w", part, err)
	}
	defer release()
	ctx, cancel := context.WithTimeout(ctx, s.e.cfg.Resources.withDefaults().TransferTimeout)
	defer cancel()
	src, what, err := s.openSource(ctx, d, arg(args, 0))
	if err != nil {
		return fmt.Errorf("flash %s: %w", part, err)
	}
	defer src.Close()
	img, format, err := autoDecompress(src)
	if err != nil {
		return fmt.Errorf("flash %s from %s: %w", part, what, err)
	}
	lr := &limitReader{r: img, left: limit, limit: limit, part: part}
	s.e.log.Info("flashing", "partition", part, "source", what, "compression", format)
	line := func(sev, msg string) {
		s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "flash", Severity: sev, Message: "flash " + part + ": " + msg})
	}
	line(SeverityInfo, fmt.Sprintf("receiving the image from %s (%s)", what, format))
	meter := &ProgressLines{Verb: "received", Emit: func(l string) { line(SeverityInfo, l) }}
	err = dt.WritePartition(ctx, part, &countingReader{r: lr, update: meter.Update}, func(l string) {
		s.e.log.Info("flash: "+l, "partition", part)
		line(SeverityInfo, l)
	})
	if err != nil {
		if ferr := failure(src); ferr != nil {
			err = ferr // the transfer's own words, not a decoder's
		}
		err = fmt.Errorf("flash %s from %s: %w", part, what, err)
		line(SeverityError, "failed: "+err.Error())
		return err
	}
	s.e.log.Info("flashed", "partition", part, "bytes", limit-lr.left)
	line(SeverityInfo, fmt.Sprintf("done: %s flashed", mib(limit-lr.left)))
	return nil
}

// countingReader reports the bytes read so far to update (with no
// total), from the reading goroutine.
type countingReader struct {
	r      io.Reader
	n      int64
	update func(done, total int64)
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	if n > 0 {
		c.n += int64(n)
		c.update(c.n, 0)
	}
	return n, err
}

// countingWriter reports the bytes written so far, of total, to update.
type countingWriter struct {
	w      io.Writer
	n      int64
	total  int64
	update func(done, total int64)
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	if n > 0 {
		c.n += int64(n)
		c.update(c.n, c.total)
	}
	return n, err
}

// dump is dump(target, partition): the partition's bytes into the resource.
func (s *server) dump(ctx context.Context, d *driver, args []any) error {
	dt, err := s.diskTarget()
	if err != nil {
		return err
	}
	part, err := dumpPartitionArg(arg(args, 1))
	if err != nil {
		return err
	}
	release, err := s.e.transferSlot(ctx, "dump", nil) // limits.go
	if err != nil {
		return fmt.Errorf("dump %s: %w", part, err)
	}
	defer release()
	ctx, cancel := context.WithTimeout(ctx, s.e.cfg.Resources.withDefaults().TransferTimeout)
	defer cancel()
	line := func(sev, msg string) {
		s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "dump", Severity: sev, Message: "dump " + part + ": " + msg})
	}
	fail := func(err error) error {
		line(SeverityError, "failed: "+err.Error())
		return err
	}
	rc, size, err := dt.ReadPartition(ctx, part)
	if err != nil {
		return fail(fmt.Errorf("dump %s: %w", part, err))
	}
	defer rc.Close()
	w, what, err := s.openSink(ctx, d, arg(args, 0), size)
	if err != nil {
		return fail(fmt.Errorf("dump %s: %w", part, err))
	}
	line(SeverityInfo, fmt.Sprintf("sending %s to %s", mib(size), what))
	meter := &ProgressLines{Verb: "sent", Emit: func(l string) { line(SeverityInfo, l) }}
	n, err := io.Copy(&countingWriter{w: w, total: size, update: meter.Update}, rc)
	if err == nil && n != size {
		err = fmt.Errorf("the partition changed while it was read (%d bytes, expected %d)", n, size)
	}
	if err != nil {
		w.Abort(err)
		return fail(fmt.Errorf("dump %s to %s: %w", part, what, err))
	}
	if err := w.Close(); err != nil {
		return fail(fmt.Errorf("dump %s to %s: %w", part, what, err))
	}
	s.e.log.Info("dumped", "partition", part, "bytes", n, "to", what)
	line(SeverityInfo, fmt.Sprintf("done: %s sent", mib(n)))
	return nil
}

// limitReader fails once more than limit bytes were read.
type limitReader struct {
	r           io.Reader
	left, limit int64
	part        string
}

func (l *limitReader) Read(p []byte) (int, error) {
	if int64(len(p)) > l.left+1 {
		p = p[:l.left+1]
	}
	n, err := l.r.Read(p)
	if int64(n) > l.left {
		l.left = -1
		return 0, fmt.Errorf("%w: the image is larger than partition %s may hold (%d bytes)", ErrInvalidArgument, l.part, l.limit)
	}
	l.left -= int64(n)
	return n, err
}

// sourceError is a failure of the resource transfer itself (the client
// stopped, stalled, the HTTP request failed), as opposed to its content.
type sourceError struct{ err error }

func (e *sourceError) Error() string { return e.err.Error() }
func (e *sourceError) Unwrap() error { return e.err }

// failure is the transfer error a source recorded, if any: decoders may
// replace it with their own words, the call reports the source's.
func failure(r io.Reader) error {
	if f, ok := r.(interface{ failure() error }); ok {
		return f.failure()
	}
	return nil
}

// encoder encodes a dump in enc.
func encoder(enc string, w io.Writer) (io.WriteCloser, error) {
	switch enc {
	case EncodingGzip:
		return gzip.NewWriterLevel(w, gzip.BestSpeed)
	case EncodingXZ:
		return xz.NewWriter(w)
	case EncodingZstd:
		return zstd.NewWriter(w, zstd.WithEncoderConcurrency(1), zstd.WithEncoderLevel(zstd.SpeedFastest))
	}
	return nil, fmt.Errorf("%w: content encoding %q cannot be written", ErrInvalidArgument, enc)
}
