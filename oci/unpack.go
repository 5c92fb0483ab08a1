package oci

import (
	"archive/tar"
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"strings"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// decompress wraps r to undo comp. The returned closer releases decoder state.
func decompress(r io.Reader, comp Compression) (io.Reader, func(), error) {
	switch comp {
	case CompressionNone:
		return r, func() {}, nil
	case CompressionGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, nil, withKind(ErrHostileContent, "gzip header: %w", err)
		}
		return zr, func() { _ = zr.Close() }, nil
	case CompressionZstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(2))
		if err != nil {
			return nil, nil, withKind(ErrHostileContent, "zstd header: %w", err)
		}
		return zr, zr.Close, nil
	case CompressionXz:
		zr, err := xz.NewReader(bufio.NewReaderSize(r, 1<<20))
		if err != nil {
			return nil, nil, withKind(ErrHostileContent, "xz header: %w", err)
		}
		return zr, func() {}, nil
	}
	return nil, nil, fmt.Errorf("unknown compression %q", comp)
}

// writeLimited copies r into a new file at dst, failing with ErrTooLarge
// beyond limit bytes. The file is synced and made read-only.
func writeLimited(dst string, r io.Reader, limit int64) (int64, error) {
	f, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644)
	if err != nil {
		return 0, fmt.Errorf("create %s: %w", dst, err)
	}
	defer f.Close()
	n, err := io.Copy(f, io.LimitReader(r, limit+1))
	if err != nil {
		var ke *kindError
		if errors.As(err, &ke) {
			return n, err
		}
		return n, withKind(ErrHostileContent, "write %s: malformed or truncated data: %w", path.Base(dst), err)
	}
	if n > limit {
		return n, withKind(ErrTooLarge, "%s exceeds the limit of %d bytes", path.Base(dst), limit)
	}
	if err := f.Sync(); err != nil {
		return n, fmt.Errorf("sync %s: %w", dst, err)
	}
	if err := f.Chmod(0o444); err != nil {
		return n, fmt.Errorf("chmod %s: %w", dst, err)
	}
	return n, f.Close()
}

// safeTarPath validates a tar entry name and returns it cleaned, relative,
// without a leading "./". Absolute names and ".." components are hostile.
func safeTarPath(name string) (string, error) {
	if name == "" {
		return "", withKind(ErrHostileContent, "tar entry with an empty name")
	}
	if strings.HasPrefix(name, "/") {
		return "", withKind(ErrHostileContent, "tar entry %q has an absolute path", name)
	}
	for _, part := range strings.Split(name, "/") {
		if part == ".." {
			return "", withKind(ErrHostileContent, "tar entry %q contains \"..\"", name)
		}
	}
	if strings.ContainsRune(name, 0) || strings.Contains(name, `\`) {
		return "", withKind(ErrHostileContent, "tar entry %q has a forbidden character", name)
	}
	return strings.TrimPrefix(path.Clean(name), "./"), nil
}

// checkTarLink rejects links whose targets leave the layer root.
func checkTarLink(h *tar.Header, clean string) error {
	switch h.Typeflag {
	case tar.TypeSymlink:
		if h.Linkname == "" || strings.HasPrefix(h.Linkname, "/") {
			return withKind(ErrHostileContent, "symlink %q points to absolute path %q", h.Name, h.Linkname)
		}
		target := path.Join(path.Dir(clean), h.Linkname)
		if target == ".." || strings.HasPrefix(target, "../") {
			return withKind(ErrHostileContent, "symlink %q -> %q escapes the image", h.Name, h.Linkname)
		}
	case tar.TypeLink:
		if _, err := safeTarPath(h.Linkname); err != nil {
			return withKind(ErrHostileContent, "hard link %q -> %q escapes the image", h.Name, h.Linkname)
		}
	}
	return nil
}

// tarDisk is the disk file found in a containerDisk layer.
type tarDisk struct {
	Name string // path inside the layer, e.g. disk/fedora.qcow2
	Size int64  // bytes written to dst (after decompression)
}

// extractContainerDisk scans a tar stream, validating every entry, and writes
// the single regular file under disk/ to dst (decompressing .xz/.zst/.gz).
// found is false when the layer holds no disk file.
func extractContainerDisk(r io.Reader, dst string, limit int64) (d tarDisk, found bool, err error) {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return d, found, nil
		}
		if err != nil {
			return d, found, withKind(ErrHostileContent, "read tar: %w", err)
		}
		clean, err := safeTarPath(h.Name)
		if err != nil {
			return d, found, err
		}
		if err := checkTarLink(h, clean); err != nil {
			return d, found, err
		}
		switch h.Typeflag {
		case tar.TypeChar, tar.TypeBlock, tar.TypeFifo:
			return d, found, withKind(ErrHostileContent, "tar entry %q is a device or fifo", h.Name)
		}
		dir, base := path.Split(clean)
		if dir != "disk/" || strings.HasPrefix(base, ".wh.") {
			continue
		}
		if h.Typeflag != tar.TypeReg && h.Typeflag != tar.TypeRegA {
			return d, found, withKind(ErrHostileContent, "containerDisk entry %q must be a regular file, is type %q", h.Name, string(h.Typeflag))
		}
		if found && d.Name != clean {
			return d, found, withKind(ErrUnsupportedArtifact, "containerDisk holds two disk files: %s and %s", d.Name, clean)
		}
		_ = os.Remove(dst) // a later entry replaces an earlier one
		_, comp, _ := roleFromTitle(base)
		dr, done, err := decompress(tr, comp)
		if err != nil {
			return d, found, fmt.Errorf("%s: %w", h.Name, err)
		}
		n, err := writeLimited(dst, dr, limit)
		done()
		if err != nil {
			return d, found, fmt.Errorf("containerDisk %s: %w", h.Name, err)
		}
		d, found = tarDisk{Name: clean, Size: n}, true
	}
}

// qcow2 header fields we inspect.
const (
	qcow2Magic              = "QFI\xfb"
	qcow2IncompatExtDataBit = 1 << 2
)

// diskFormat sniffs a disk file: "qcow2" or "raw". qcow2 images that name a
// backing file or an external data file are hostile (QEMU would open a host
// path the image chose).
func diskFormat(p string) (string, error) {
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	hdr := make([]byte, 104)
	n, _ := io.ReadFull(f, hdr)
	if n < 4 || string(hdr[:4]) != qcow2Magic {
		return "raw", nil
	}
	if n < 72 {
		return "", withKind(ErrHostileContent, "truncated qcow2 header")
	}
	version := binary.BigEndian.Uint32(hdr[4:8])
	if backing := binary.BigEndian.Uint64(hdr[8:16]); backing != 0 {
		return "", withKind(ErrHostileContent, "qcow2 disk names a backing file; images must be self-contained")
	}
	if version >= 3 && n >= 80 {
		if incompat := binary.BigEndian.Uint64(hdr[72:80]); incompat&qcow2IncompatExtDataBit != 0 {
			return "", withKind(ErrHostileContent, "qcow2 disk uses an external data file; images must be self-contained")
		}
	}
	return "qcow2", nil
}
