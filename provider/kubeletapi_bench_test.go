package provider

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// BenchmarkConsoleLogsTail measures `kubectl logs --tail=100` of a full
// console (4 MiB in console.log.1 + 4 MiB in console.log, the default cap)
// against the baseline qemu.TailConsole on the same files, alternating in
// the same run. x-of-baseline = logs / TailConsole.
func BenchmarkConsoleLogsTail(b *testing.B) {
	dir := b.TempDir()
	var line bytes.Buffer
	for i := 0; line.Len() < 4<<20; i++ {
		fmt.Fprintf(&line, "[%8d.000000] guest console line number %d with some text\n", i, i)
	}
	for _, n := range []string{consoleRotatedName, qemu.ConsoleLogName} {
		if err := os.WriteFile(filepath.Join(dir, n), line.Bytes(), 0o600); err != nil {
			b.Fatal(err)
		}
	}
	ours := func() int {
		rc, err := ConsoleLogs(context.Background(), ConsoleLogSource{Dir: dir, Pod: "ns/p"}, api.ContainerLogOpts{Tail: 100})
		if err != nil {
			b.Fatal(err)
		}
		n, err := io.Copy(io.Discard, rc)
		rc.Close()
		if err != nil {
			b.Fatal(err)
		}
		return int(n)
	}
	base := func() int {
		out, err := qemu.TailConsole(dir, 100)
		if err != nil {
			b.Fatal(err)
		}
		return len(out)
	}
	if a, c := ours(), base(); a != c {
		b.Fatalf("logs gave %d bytes, TailConsole %d", a, c)
	}
	var tOurs, tBase time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		ours()
		t1 := time.Now()
		base()
		tOurs += t1.Sub(t0)
		tBase += time.Since(t1)
	}
	b.ReportMetric(float64(tOurs.Microseconds())/float64(b.N)/1000, "ms/logs")
	b.ReportMetric(float64(tBase.Microseconds())/float64(b.N)/1000, "ms/baseline")
	b.ReportMetric(float64(tOurs)/float64(tBase), "x-of-baseline")
}
