package jumpstarter

import (
	"bytes"
	"io"
	"testing"
	"time"

	"github.com/ulikunitz/xz"
)

// BenchmarkFlashDecodeLimits: an xz image (32 MiB, half random, xz -1,
// 4 MiB blocks) decoded as a flash decodes it, with the limits on
// (autoDecompress: xzGuard over every block and stream, the partition's
// limitReader) against the same decoder with none (xz.NewReader alone,
// what a flash did before the guard walked every block). Each iteration
// decodes once each way, which goes first alternating; x-of-unlimited is the ratio of the
// totals.
func BenchmarkFlashDecodeLimits(b *testing.B) {
	raw := make([]byte, 32<<20)
	for i := 0; i < len(raw)/2; i++ {
		raw[i] = byte(uint32(i)*2654435761>>13) ^ byte(i>>7)
	}
	copy(raw[len(raw)/2:], bytes.Repeat([]byte("a flashed disk image "), len(raw)/2/21+1))
	img := xzCLI(b, raw, "-1", "--block-size=4MiB")
	var limited, unlimited time.Duration
	b.SetBytes(int64(len(raw)))
	b.ResetTimer()
	withLimits := func() time.Duration {
		t0 := time.Now()
		if err := decodeAll(img, 1<<30); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0)
	}
	without := func() time.Duration {
		t0 := time.Now()
		zr, err := xz.NewReader(bytes.NewReader(img))
		if err != nil {
			b.Fatal(err)
		}
		if _, err := io.Copy(io.Discard, zr); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0)
	}
	for i := range b.N {
		if i%2 == 0 { // either goes first as often
			limited += withLimits()
			unlimited += without()
		} else {
			unlimited += without()
			limited += withLimits()
		}
	}
	b.ReportMetric(float64(limited.Milliseconds())/float64(b.N), "limited-ms/op")
	b.ReportMetric(float64(unlimited.Milliseconds())/float64(b.N), "unlimited-ms/op")
	b.ReportMetric(limited.Seconds()/unlimited.Seconds(), "x-of-unlimited")
}
