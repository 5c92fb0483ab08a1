package provider

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/provider/guest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
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
	for _, n := range []string{guest.ConsoleRotatedName, qemu.ConsoleLogName} {
		if err := os.WriteFile(filepath.Join(dir, n), line.Bytes(), 0o600); err != nil {
			b.Fatal(err)
		}
	}
	ours := func() int {
		rc, err := guest.ConsoleLogs(context.Background(), guest.ConsoleLogSource{Dir: dir, Pod: "ns/p"}, api.ContainerLogOpts{Tail: 100})
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

// BenchmarkPortForwardConnect measures one `kubectl port-forward`
// connection as the provider serves it (runtime forward added, guest accept
// awaited through QEMU's connection table, HTTP GET to the test image's
// server, forward removed) against the baseline: the same GET through a
// forward set at VM start, in the same run, alternating, on one real TCG VM.
// x-of-baseline = provider / start-time forward.
func BenchmarkPortForwardConnect(b *testing.B) {
	img := vmtest.BuildTestImages(b)
	cmdline, err := os.ReadFile(filepath.Join(img, "cmdline"))
	if err != nil {
		b.Fatal(err)
	}
	hostPort, err := qemu.FreeLoopbackPort()
	if err != nil {
		b.Fatal(err)
	}
	dir := b.TempDir()
	vmtest.ReapQEMU(b, dir)
	ctx := context.Background()
	vm, err := qemu.Start(ctx, qemu.Spec{Name: "pfbench", CPUs: 1, MemoryMiB: 256,
		Kernel: filepath.Join(img, "vmlinuz"), Initrd: filepath.Join(img, "initramfs-acpi.cpio.gz"), Cmdline: strings.TrimSpace(string(cmdline)),
		Network: true, Forwards: []qemu.PortForward{{HostPort: hostPort, GuestPort: 8080}}, AllowedDirs: []string{img}}, dir)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { vm.Kill(); _, _ = vm.Wait(ctx) })
	bctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	if err := vm.WaitConsole(bctx, vmtest.BootMarker); err != nil {
		b.Fatal(err)
	}
	get := func(c net.Conn) {
		defer c.Close()
		c.SetDeadline(time.Now().Add(30 * time.Second)) //nolint:errcheck
		if _, err := c.Write([]byte("GET / HTTP/1.0\r\n\r\n")); err != nil {
			b.Fatal(err)
		}
		body, err := io.ReadAll(c)
		if err != nil || !bytes.Contains(body, []byte("QK-HTTP-OK")) {
			b.Fatalf("GET through the forward: %v %q", err, body)
		}
	}
	ours := func() {
		client, server := net.Pipe()
		done := make(chan error, 1)
		go func() { done <- guest.ForwardGuestPort(ctx, vm, 8080, server) }()
		get(client)
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	}
	base := func() {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", hostPort))
		if err != nil {
			b.Fatal(err)
		}
		get(c)
	}
	// Warm up: the guest's server answers the first request slower.
	base()
	ours()
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
	b.ReportMetric(float64(tOurs.Microseconds())/float64(b.N)/1000, "ms/forward")
	b.ReportMetric(float64(tBase.Microseconds())/float64(b.N)/1000, "ms/baseline")
	b.ReportMetric(float64(tOurs)/float64(tBase), "x-of-baseline")
}
