package exporter

import (
	"bytes"
	"crypto/sha256"
	"os"
	"testing"
	"time"
)

// BenchmarkFlashWriteLimits: a 64 MiB image written by writeSparse into
// a file of the state dir's file system, with the disk-space hold of a
// flash (diskspace.go: statfs and the ledger every 64 MiB, a count per
// write) against without. Each iteration writes once each way, which
// goes first alternating; x-of-unlimited is the ratio of the totals.
func BenchmarkFlashWriteLimits(b *testing.B) {
	img := make([]byte, 64<<20)
	for i := range img {
		img[i] = byte(i%251) | 1
	}
	dir := b.TempDir()
	write := func(limited bool) time.Duration {
		f, err := os.CreateTemp(dir, "img-")
		if err != nil {
			b.Fatal(err)
		}
		defer os.Remove(f.Name())
		defer f.Close()
		var hold *diskHold
		if limited {
			hold = nodeDisk.hold(dir, 0)
			defer hold.release()
		}
		t0 := time.Now()
		if _, err := writeSparse(f, bytes.NewReader(img), sha256.New(), 1<<40, hold); err != nil {
			b.Fatal(err)
		}
		return time.Since(t0)
	}
	var limited, unlimited time.Duration
	b.SetBytes(int64(len(img)))
	b.ResetTimer()
	for i := range b.N {
		if i%2 == 0 {
			limited += write(true)
			unlimited += write(false)
		} else {
			unlimited += write(false)
			limited += write(true)
		}
	}
	b.ReportMetric(float64(limited.Milliseconds())/float64(b.N), "limited-ms/op")
	b.ReportMetric(float64(unlimited.Milliseconds())/float64(b.N), "unlimited-ms/op")
	b.ReportMetric(limited.Seconds()/unlimited.Seconds(), "x-of-unlimited")
}
