// Package testutil holds the few helpers the project's tests share: finding
// the repository root, picking loopback ports and the host address, and
// stopping out-of-process test fixtures before `go test -timeout` kills the
// test binary. Standard library only, so that every package (including qemu
// and oci, which know nothing of Kubernetes) may use it.
package testutil

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"strings"
	"syscall"
	"testing"
	"time"
)

// RepoRoot walks up from the working directory to the directory holding
// go.mod.
func RepoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// MustRepoRoot is RepoRoot failing the test on error.
func MustRepoRoot(tb testing.TB) string {
	tb.Helper()
	root, err := RepoRoot()
	if err != nil {
		tb.Fatal(err)
	}
	return root
}

// FreePort returns a TCP port that was free on 127.0.0.1 a moment ago.
func FreePort(tb testing.TB) int {
	tb.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("pick a free loopback port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// HostIPv4 is the host's first non-loopback, non-link-local IPv4 address.
// The API server refuses to proxy to kubelets on loopback addresses, so a
// test node's kubelet API must listen there.
func HostIPv4(tb testing.TB) string {
	tb.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		tb.Fatal(err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() && !ipn.IP.IsLinkLocalUnicast() {
			return ipn.IP.String()
		}
	}
	tb.Fatal("no non-loopback IPv4 address: the API server does not proxy to loopback kubelets")
	return ""
}

// GuardCleanup runs stop on SIGINT/SIGTERM and shortly before
// `go test -timeout` would kill the binary (deferred cleanup does not run
// then), then exits. Fixtures in their own process groups would otherwise
// outlive the test. The returned function disarms it.
func GuardCleanup(name string, stop func()) (disarm func()) {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	var deadline <-chan time.Time
	if f := flag.Lookup("test.timeout"); f != nil {
		if d, err := time.ParseDuration(f.Value.String()); err == nil && d > 30*time.Second {
			deadline = time.After(d - 15*time.Second)
		}
	}
	done := make(chan struct{})
	go func() {
		select {
		case s := <-sig:
			fmt.Fprintf(os.Stderr, "%s: %v: stopping test fixtures\n", name, s)
		case <-deadline:
			fmt.Fprintf(os.Stderr, "%s: test timeout is near: stopping test fixtures; goroutines:\n", name)
			_ = pprof.Lookup("goroutine").WriteTo(os.Stderr, 2)
		case <-done:
			return
		}
		stop()
		os.Exit(1)
	}()
	return func() { signal.Stop(sig); close(done) }
}

// SkipIfShort skips tb under `go test -short` (make unit): the test needs
// a real QEMU, registry or control plane, named by what. Such tests run in
// `make test`.
func SkipIfShort(tb testing.TB, what string) {
	tb.Helper()
	if testing.Short() {
		tb.Skipf("needs %s: skipped under -short", what)
	}
}

// ReadUntil reads r until what it read contains want and returns it; it
// fails tb if want does not show within d (or r ends first).
func ReadUntil(tb testing.TB, r io.Reader, want string, d time.Duration) string {
	tb.Helper()
	got := make(chan string, 1)
	go func() {
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			b.Write(buf[:n])
			if strings.Contains(b.String(), want) || err != nil {
				got <- b.String()
				return
			}
		}
	}()
	select {
	case s := <-got:
		if !strings.Contains(s, want) {
			tb.Fatalf("stream ended before %q; read %q", want, s)
		}
		return s
	case <-time.After(d):
		tb.Fatalf("no %q within %s", want, d)
		return ""
	}
}
