package jumpstarter

import (
	"bufio"
	"bytes"
	"compress/bzip2"
	"errors"
	"fmt"
	"io"

	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/ulikunitz/xz"
)

// Decoders of flashed images. A lease holder chooses the bytes, so every
// decoder is bounded before it allocates: zstd frames may ask for a window
// of at most zstdMaxWindow (klauspost's decoder checks every frame's
// header), xz blocks for an LZMA2 dictionary of at most xzMaxDict (xzGuard
// checks every block header of every stream before the decoder sees it);
// gzip and bzip2 decode in a fixed few hundred KiB. What a decoder may
// produce is bounded by the partition's limit (limitReader) and its time
// by the transfer's (ResourceOptions.TransferTimeout).
const (
	zstdMaxWindow = 32 << 20
	xzMaxDict     = 64 << 20
)

// decoder decodes enc (a content encoding the exporter accepted).
func decoder(enc string, r io.Reader) (io.Reader, error) {
	switch enc {
	case EncodingGzip:
		zr, err := gzip.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("gzip: %w", err)
		}
		return &decodeErrs{r: zr, name: enc}, nil
	case EncodingXZ:
		g := &xzGuard{r: r, maxDict: xzMaxDict, need: 12}
		zr, err := xz.NewReader(g)
		if err != nil {
			if g.err != nil {
				return nil, g.err
			}
			return nil, fmt.Errorf("%w: xz: %v", ErrInvalidArgument, err)
		}
		return &decodeErrs{r: zr, name: enc, guard: g}, nil
	case EncodingBZ2:
		return &decodeErrs{r: bzip2.NewReader(r), name: enc}, nil
	case EncodingZstd:
		zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
			zstd.WithDecoderMaxWindow(zstdMaxWindow), zstd.WithDecoderMaxMemory(zstdMaxWindow))
		if err != nil {
			return nil, fmt.Errorf("zstd: %w", err)
		}
		return &decodeErrs{r: zr, name: enc, close: zr.Close}, nil
	}
	return nil, fmt.Errorf("%w: content encoding %q", ErrInvalidArgument, enc)
}

// decodeErrs names the codec in errors and turns a truncated stream's
// io.EOF-like end into an error (a decoder that ends early is corrupt
// input, never a complete image).
type decodeErrs struct {
	r     io.Reader
	name  string
	close func()
	guard *xzGuard // the xz stream's, whose refusal is the error
}

func (d *decodeErrs) Read(p []byte) (int, error) {
	n, err := d.r.Read(p)
	var se *sourceError
	switch {
	case err == nil || errors.Is(err, io.EOF) || errors.As(err, &se):
		return n, err
	case d.guard != nil && d.guard.err != nil:
		return n, d.guard.err
	case errors.Is(err, io.ErrUnexpectedEOF):
		return n, fmt.Errorf("%w: the %s stream is truncated", ErrInvalidArgument, d.name)
	}
	return n, fmt.Errorf("%w: the %s stream is corrupt: %v", ErrInvalidArgument, d.name, err)
}

func (d *decodeErrs) Close() error {
	if d.close != nil {
		d.close()
	}
	return nil
}

// signatures are upstream's COMPRESSION_SIGNATURES.
var signatures = []struct {
	magic []byte
	enc   string
}{
	{[]byte{0x1f, 0x8b, 0x08}, EncodingGzip},
	{xzMagic, EncodingXZ},
	{[]byte{0x42, 0x5a, 0x68}, EncodingBZ2},
	{[]byte{0x28, 0xb5, 0x2f, 0xfd}, EncodingZstd},
}

// autoDecompress detects a compressed image by its first bytes and
// decodes it; other bytes pass unchanged (format "raw"). An empty source
// is refused.
func autoDecompress(r io.Reader) (io.Reader, string, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(8)
	if len(head) == 0 {
		if err == nil || errors.Is(err, io.EOF) {
			return nil, "", fmt.Errorf("%w: the image is empty", ErrInvalidArgument)
		}
		return nil, "", err
	}
	for _, sg := range signatures {
		if bytes.HasPrefix(head, sg.magic) {
			d, err := decoder(sg.enc, br)
			if err != nil {
				return nil, "", err
			}
			return d, sg.enc, nil
		}
	}
	return br, "raw", nil
}

var xzMagic = []byte{0xfd, 0x37, 0x7a, 0x58, 0x5a, 0x00}

// xzState is where xzGuard is in the xz container format.
type xzState int

const (
	xzStreamHeader xzState = iota // 12 bytes
	xzBlockOrIndex                // 1 byte: a block header's size, or 0 for the index
	xzBlockHeader                 // the rest of the block header
	xzChunk                       // an LZMA2 chunk's control byte
	xzChunkPlain                  // an uncompressed chunk's size (2 bytes)
	xzChunkLZMA                   // an LZMA chunk's sizes (and properties)
	xzIndexCount                  // the index's record count (a varint)
	xzIndexRecords                // the records (varints)
	xzFooter                      // the stream footer (12 bytes)
	xzPadding                     // stream padding (4 zero bytes at a time) or a next stream
)

// xzGuard passes an xz file to the decoder while it walks the file's
// container (stream headers, block headers, LZMA2 chunk headers, index,
// footer, padding, next streams) by the sizes those headers state,
// without decoding anything. A block whose LZMA2 dictionary exceeds
// maxDict (or whose filters the decoder lacks) fails the read that holds
// its header, so the decoder never sees it and never allocates for it:
// the bound holds for every block of every concatenated stream. Corrupt
// structure is left to the decoder to report where the walk cannot go on.
type xzGuard struct {
	r       io.Reader
	maxDict int64
	err     error

	st     xzState
	buf    []byte // bytes of the header being gathered
	need   int    // len(buf) wanted before step
	skip   int64  // bytes to pass unread (chunk data, checks, padding)
	check  int64  // check size of the current stream
	comp   int64  // compressed bytes of the current block
	idx    int64  // index bytes so far
	left   uint64 // index varints still to come
	vshift uint   // shift of the varint being read
	count  uint64
}

func (g *xzGuard) Read(p []byte) (int, error) {
	if g.err != nil {
		return 0, g.err
	}
	n, err := g.r.Read(p)
	if serr := g.scan(p[:n]); serr != nil {
		g.err = serr
		return 0, serr
	}
	return n, err
}

// scan follows p through the container.
func (g *xzGuard) scan(p []byte) error {
	for len(p) > 0 {
		if g.skip > 0 {
			k := min(g.skip, int64(len(p)))
			g.skip -= k
			p = p[k:]
			continue
		}
		k := min(g.need-len(g.buf), len(p))
		g.buf = append(g.buf, p[:k]...)
		p = p[k:]
		if len(g.buf) < g.need {
			return nil
		}
		if err := g.step(); err != nil {
			return err
		}
	}
	return nil
}

// xzCheckSizes are the check sizes by check ID (xz file format 2.1.1.2).
var xzCheckSizes = [16]int64{0, 4, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32, 64, 64, 64}

// step acts on a complete header in g.buf and says what comes next.
func (g *xzGuard) step() error {
	b := g.buf
	next := func(st xzState, need int) {
		g.st, g.need, g.buf = st, need, g.buf[:0]
	}
	corrupt := func(what string) error {
		return fmt.Errorf("%w: the xz stream is corrupt: %s", ErrInvalidArgument, what)
	}
	switch g.st {
	case xzStreamHeader:
		if !bytes.Equal(b[:6], xzMagic) {
			return corrupt("bad stream header")
		}
		g.check = xzCheckSizes[b[7]&0x0f]
		next(xzBlockOrIndex, 1)
	case xzBlockOrIndex:
		if b[0] == 0 {
			g.idx, g.vshift, g.count = 1, 0, 0
			next(xzIndexCount, 1)
			return nil
		}
		g.st, g.need = xzBlockHeader, (int(b[0])+1)*4 // keep the size byte
	case xzBlockHeader:
		if err := checkXZBlockHeader(b, g.maxDict); err != nil {
			return err
		}
		g.comp = 0
		next(xzChunk, 1)
	case xzChunk:
		g.comp++
		switch c := b[0]; {
		case c == 0: // end of the block's data: padding to 4, then its check
			g.skip = (4-g.comp%4)%4 + g.check
			next(xzBlockOrIndex, 1)
		case c == 1 || c == 2:
			next(xzChunkPlain, 2)
		case c >= 0x80:
			n := 4
			if (c>>5)&3 >= 2 {
				n++ // new properties
			}
			next(xzChunkLZMA, n)
		default:
			return corrupt(fmt.Sprintf("invalid LZMA2 chunk control byte 0x%02x", c))
		}
	case xzChunkPlain:
		size := int64(b[0])<<8 | int64(b[1]) + 1
		g.comp += 2 + size
		g.skip = size
		next(xzChunk, 1)
	case xzChunkLZMA:
		packed := int64(b[2])<<8 | int64(b[3]) + 1
		g.comp += int64(len(b)) + packed
		g.skip = packed
		next(xzChunk, 1)
	case xzIndexCount, xzIndexRecords:
		g.idx++
		if g.st == xzIndexCount {
			g.count |= uint64(b[0]&0x7f) << g.vshift
		}
		g.vshift += 7
		if b[0]&0x80 != 0 {
			if g.vshift > 63 {
				return corrupt("index varint too long")
			}
			next(g.st, 1)
			return nil
		}
		g.vshift = 0
		if g.st == xzIndexCount {
			g.left = 2 * g.count
		} else {
			g.left--
		}
		if g.left > 0 {
			next(xzIndexRecords, 1)
			return nil
		}
		g.skip = (4-g.idx%4)%4 + 4 // padding, CRC32
		next(xzFooter, 12)
	case xzFooter:
		if b[10] != 'Y' || b[11] != 'Z' {
			return corrupt("bad stream footer")
		}
		next(xzPadding, 4)
	case xzPadding:
		if bytes.Equal(b, []byte{0, 0, 0, 0}) {
			next(xzPadding, 4)
			return nil
		}
		g.st, g.need = xzStreamHeader, 12 // a concatenated stream: keep its first bytes
	}
	return nil
}

// checkXZBlockHeader refuses a block header (b, whole) whose filter chain
// is not a single LZMA2 filter with a dictionary of at most maxDict.
func checkXZBlockHeader(b []byte, maxDict int64) error {
	i := 2
	varint := func() (uint64, bool) {
		var v uint64
		for sh := 0; i < len(b) && sh <= 63; sh += 7 {
			c := b[i]
			i++
			v |= uint64(c&0x7f) << sh
			if c&0x80 == 0 {
				return v, true
			}
		}
		return 0, false
	}
	corrupt := fmt.Errorf("%w: the xz stream is corrupt: bad block header", ErrInvalidArgument)
	flags := b[1]
	if flags&0x3c != 0 {
		return corrupt
	}
	for _, bit := range []byte{0x40, 0x80} { // compressed, uncompressed size
		if flags&bit != 0 {
			if _, ok := varint(); !ok {
				return corrupt
			}
		}
	}
	if flags&0x03 != 0 {
		return fmt.Errorf("%w: the xz stream uses a filter chain of %d filters (BCJ or delta); only LZMA2 alone is decoded here: recompress with plain xz", ErrInvalidArgument, flags&0x03+1)
	}
	id, ok1 := varint()
	size, ok2 := varint()
	if !ok1 || !ok2 || size != 1 || i >= len(b)-4 {
		if ok1 && id != 0x21 {
			return fmt.Errorf("%w: the xz stream uses filter 0x%x; only LZMA2 is decoded here", ErrInvalidArgument, id)
		}
		return corrupt
	}
	if id != 0x21 {
		return fmt.Errorf("%w: the xz stream uses filter 0x%x; only LZMA2 is decoded here", ErrInvalidArgument, id)
	}
	c := b[i]
	if c > 40 {
		return corrupt
	}
	dict := int64(1)<<32 - 1
	if c < 40 {
		dict = int64(2|(c&1)) << (c/2 + 11)
	}
	if dict > maxDict {
		return fmt.Errorf("%w: an xz block needs a %d MiB dictionary (at most %d MiB: recompress with xz -6 or lower)", ErrInvalidArgument, dict>>20, maxDict>>20)
	}
	return nil
}
