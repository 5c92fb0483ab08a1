package testutil

import (
	"bufio"
	"context"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// BareBoot is the baseline of the boot benchmarks: it starts qemu-system
// with args (which must put the serial console on stdout, e.g.
// "-serial stdio") and returns the time until a console line contains marker.
// QEMU runs in its own process group and is killed before returning.
func BareBoot(tb testing.TB, qemuBinary, marker string, args ...string) time.Duration {
	tb.Helper()
	SkipIfShort(tb, "QEMU")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	start := time.Now()
	cmd := exec.CommandContext(ctx, qemuBinary, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatalf("start bare %s: %v", qemuBinary, err)
	}
	defer func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	}()
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if strings.Contains(sc.Text(), marker) {
			return time.Since(start)
		}
	}
	tb.Fatalf("bare QEMU exited without the boot marker %q: %v", marker, sc.Err())
	return 0
}
