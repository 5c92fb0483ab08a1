package jumpstarter

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"hash/crc32"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/ulikunitz/xz"
)

// Hostile images for the decoders (decode.go): each is refused with a
// clear error before its decoder allocates what the image asks for. The
// memory a decode costs is measured twice: the bytes the Go heap handed
// out (runtime.MemStats.TotalAlloc, which counts a dictionary the moment
// it is allocated, touched or not) and the process's peak resident set
// (VmHWM, reset through /proc/self/clear_refs).

// xzCLI compresses b with the xz command and its args.
func xzCLI(t testing.TB, b []byte, args ...string) []byte {
	t.Helper()
	cmd := exec.Command("xz", append([]string{"-c", "-T1"}, args...)...)
	cmd.Stdin = bytes.NewReader(b)
	out, err := cmd.Output()
	require.NoError(t, err, "xz (Debian's xz-utils)")
	return out
}

// xzBlockOffsets are the offsets of the blocks of the single xz stream s,
// read from its index (found through the footer's backward size).
func xzBlockOffsets(t testing.TB, s []byte) []int {
	t.Helper()
	footer := s[len(s)-12:]
	require.Equal(t, "YZ", string(footer[10:]))
	idx := s[len(s)-12-(int(binary.LittleEndian.Uint32(footer[4:8]))+1)*4:]
	require.Equal(t, byte(0), idx[0], "index indicator")
	pos := 1
	varint := func() int {
		v, n := binary.Uvarint(idx[pos:])
		require.Positive(t, n)
		pos += n
		return int(v)
	}
	var offs []int
	off := 12
	for range varint() {
		offs = append(offs, off)
		unpadded := varint()
		varint() // uncompressed size
		off += (unpadded + 3) &^ 3
	}
	return offs
}

// setXZDict rewrites the LZMA2 dictionary size code of the block header
// at off (and its CRC32): the data stays valid, the declared dictionary
// is what an unguarded decoder allocates.
func setXZDict(t testing.TB, s []byte, off int, code byte) {
	t.Helper()
	h := s[off:]
	size := (int(h[0]) + 1) * 4
	flags := h[1]
	pos := 2
	for _, bit := range []byte{0x40, 0x80} {
		if flags&bit != 0 {
			_, n := binary.Uvarint(h[pos:])
			pos += n
		}
	}
	require.Equal(t, []byte{0x21, 0x01}, h[pos:pos+2], "one LZMA2 filter")
	h[pos+2] = code
	binary.LittleEndian.PutUint32(h[size-4:], crc32.ChecksumIEEE(h[:size-4]))
}

// Dictionary size codes (xz's LZMA2 properties).
const (
	dict256MiB = 32
	dict1GiB   = 36
)

// memUse measures what f allocates on the heap and how far it raises the
// process's peak resident set.
func memUse(t testing.TB, f func()) (alloc, peak uint64) {
	t.Helper()
	runtime.GC()
	// 5 resets the peak resident set to the current one (proc(5)).
	require.NoError(t, os.WriteFile("/proc/self/clear_refs", []byte("5"), 0))
	hwm0 := vmHWM(t)
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	f()
	runtime.ReadMemStats(&m1)
	hwm := vmHWM(t)
	if hwm < hwm0 { // the kernel's counters lag by a few pages
		hwm = hwm0
	}
	return m1.TotalAlloc - m0.TotalAlloc, hwm - hwm0
}

func vmHWM(t testing.TB) uint64 {
	b, err := os.ReadFile("/proc/self/status")
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc/self/status")
	return 0
}

// decodeAll decodes img as a flash does (signature detection, the
// partition's limit) and returns the error that ended it.
func decodeAll(img []byte, limit int64) error {
	r, _, err := autoDecompress(bytes.NewReader(img))
	if err != nil {
		return err
	}
	_, err = io.Copy(io.Discard, &limitReader{r: r, left: limit, limit: limit, part: PartitionRoot})
	return err
}

// decodeBudget is what one decode may cost: the largest dictionary or
// window allowed, and change.
const decodeBudget = xzMaxDict + 32<<20

func TestXZBombs(t *testing.T) {
	data := bytes.Repeat([]byte("a tenant's image "), 3<<20/17) // ~3 MiB, 3 blocks of 1 MiB
	multi := xzCLI(t, data, "--block-size=1MiB", "--lzma2=preset=1,dict=1MiB")
	offs := xzBlockOffsets(t, multi)
	require.Len(t, offs, 3, "a multi-block stream")
	require.NoError(t, decodeAll(multi, 1<<30), "the stream as xz wrote it decodes")

	// The second block declares a 256 MiB dictionary: the first block
	// header (all the old guard read) is fine.
	bomb := bytes.Clone(multi)
	setXZDict(t, bomb, offs[1], dict256MiB)
	// Unguarded, the decoder allocates the declared dictionary: the
	// measurement below would see the bomb.
	alloc, _ := memUse(t, func() {
		zr, err := xz.NewReader(bytes.NewReader(bomb))
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, zr)
		require.NoError(t, err)
	})
	require.GreaterOrEqual(t, alloc, uint64(256<<20), "an unguarded decoder allocates the declared dictionary")

	var err error
	alloc, peak := memUse(t, func() { err = decodeAll(bomb, 1<<30) })
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "an xz block needs a 256 MiB dictionary (at most 64 MiB")
	assert.Less(t, alloc, uint64(decodeBudget), "heap allocated by the refused decode")
	assert.Less(t, peak, uint64(decodeBudget), "peak resident set growth")

	// A tiny stream, then a second stream declaring a 1 GiB dictionary.
	second := xzCLI(t, data[:1<<20], "--lzma2=preset=1,dict=1MiB")
	setXZDict(t, second, xzBlockOffsets(t, second)[0], dict1GiB)
	concat := append(xzCLI(t, []byte("first stream")), second...)
	alloc, peak = memUse(t, func() { err = decodeAll(concat, 1<<30) })
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "an xz block needs a 1024 MiB dictionary")
	assert.Less(t, alloc, uint64(decodeBudget))
	assert.Less(t, peak, uint64(decodeBudget))

	// Stream padding between streams, then a bomb, is still seen.
	padded := append(append(xzCLI(t, []byte("first stream")), 0, 0, 0, 0, 0, 0, 0, 0), second...)
	err = decodeAll(padded, 1<<30)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "1024 MiB dictionary")
}

// TestXZGuardPassesWhatXZWrites: every layout the xz command writes
// (multi-threaded blocks with sizes in their headers, checks of every
// size, concatenated and padded streams, incompressible data in stored
// chunks) decodes to its input through the guard.
func TestXZGuardPassesWhatXZWrites(t *testing.T) {
	rnd := make([]byte, 300<<10)
	for i := range rnd {
		rnd[i] = byte(i*7919>>3) ^ byte(i>>11)
	}
	text := bytes.Repeat([]byte("qemu-kubelet "), 200<<10/13)
	mixed := append(append([]byte{}, text...), rnd...)
	cases := map[string][]byte{
		"default":  xzCLI(t, mixed),
		"threaded": xzCLI(t, mixed, "-T2", "--block-size=64KiB"),
		"none":     xzCLI(t, mixed, "--check=none", "--block-size=100KiB"),
		"crc32":    xzCLI(t, mixed, "--check=crc32"),
		"sha256":   xzCLI(t, mixed, "--check=sha256", "-0"),
		"dict64":   xzCLI(t, mixed, "--lzma2=preset=1,dict=64MiB"),
	}
	for name, img := range cases {
		r, _, err := autoDecompress(bytes.NewReader(img))
		require.NoError(t, err, name)
		got, err := io.ReadAll(r)
		require.NoError(t, err, name)
		assert.True(t, bytes.Equal(mixed, got), name)
	}
	concat := append(append(append([]byte{}, cases["crc32"]...), 0, 0, 0, 0), cases["sha256"]...)
	r, _, err := autoDecompress(bytes.NewReader(concat))
	require.NoError(t, err)
	got, err := io.ReadAll(r)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(append(append([]byte{}, mixed...), mixed...), got), "concatenated streams")

	big := xzCLI(t, mixed, "--lzma2=preset=1,dict=128MiB")
	err = decodeAll(big, 1<<30)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "128 MiB dictionary")

	bcj := xzCLI(t, mixed, "--x86", "--lzma2=preset=1")
	err = decodeAll(bcj, 1<<30)
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "only LZMA2 alone is decoded here")
}

// zstdFrame is a zstd frame header asking for a window of 1<<windowLog
// bytes, with one raw last block holding data.
func zstdFrame(windowLog int, data []byte) []byte {
	f := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, byte((windowLog - 10) << 3)}
	bh := uint32(1) | uint32(len(data))<<3 // last block, raw
	f = append(f, byte(bh), byte(bh>>8), byte(bh>>16))
	return append(f, data...)
}

func TestZstdAndGzipBombs(t *testing.T) {
	require.NoError(t, decodeAll(zstdFrame(20, []byte("fine")), 1<<30), "a 1 MiB window is fine")
	var first bytes.Buffer
	w, err := zstd.NewWriter(&first)
	require.NoError(t, err)
	_, _ = w.Write([]byte("a first frame"))
	require.NoError(t, w.Close())
	for name, img := range map[string][]byte{
		"huge window":                zstdFrame(31, []byte("2 GiB window")),
		"huge window, second frame":  append(bytes.Clone(first.Bytes()), zstdFrame(31, []byte("2 GiB window"))...),
		"window just over the bound": zstdFrame(26, []byte("64 MiB window")),
	} {
		var err error
		alloc, peak := memUse(t, func() { err = decodeAll(img, 1<<30) })
		require.ErrorIs(t, err, ErrInvalidArgument, name)
		assert.Contains(t, err.Error(), "the zstd stream is corrupt: window size exceeded", name)
		assert.Less(t, alloc, uint64(decodeBudget), name)
		assert.Less(t, peak, uint64(decodeBudget), name)
	}

	// 64 MiB of zeros in a ~64 KiB gzip member (as gzip -9 writes it), flashed onto 16 MiB: the
	// output is bounded by the partition.
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	require.NoError(t, err)
	_, err = zw.Write(make([]byte, 64<<20))
	require.NoError(t, err)
	require.NoError(t, zw.Close())
	require.Less(t, gz.Len(), 1<<20)
	alloc, peak := memUse(t, func() { err = decodeAll(gz.Bytes(), 16<<20) })
	require.ErrorIs(t, err, ErrInvalidArgument)
	assert.Contains(t, err.Error(), "the image is larger than partition root may hold (16777216 bytes)")
	assert.Less(t, alloc, uint64(decodeBudget))
	assert.Less(t, peak, uint64(decodeBudget))
	assert.False(t, errors.Is(err, io.EOF))
}
