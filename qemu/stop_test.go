package qemu

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStopNoACPI: with NoACPI a guest that would answer the power button
// never sees it: QEMU is told to quit at once and the exit is classified
// killed with a reason that names the immediate stop, not an ACPI timeout.
func TestStopNoACPI(t *testing.T) {
	dir := newStateDir(t)
	vm := startVM(t, testSpec(t, "acpi"), dir)
	waitBoot(t, vm)
	events := vm.Events(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	ex, err := vm.Stop(ctx, StopOptions{NoACPI: true, Keep: []string{ConsoleLogName}})
	if err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if ex.Class != ExitKilled || ex.ExitCode != ExitCodeKilled || !strings.Contains(ex.Reason, "at once") || strings.Contains(ex.Reason, "ACPI") {
		t.Fatalf("exit %+v, want killed, stopped at once", ex)
	}
	for ev := range events {
		if _, ok := ev.(Powerdown); ok {
			t.Errorf("event %#v: NoACPI must not press the power button", ev)
		}
	}
	b, err := os.ReadFile(filepath.Join(dir, ConsoleLogName))
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), "QK-ACPI-POWERDOWN") {
		t.Fatalf("guest saw the power button; console:\n%s", b)
	}
}
