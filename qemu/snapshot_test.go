package qemu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestSaveStateAndRestore: a booted VM's state is saved while it keeps
// running afterwards; a VM started with Incoming from it runs the guest
// without booting it (console input echoed, no boot marker); a VM of
// another shape, or a file that is not a migration stream, fails Start with
// QEMU's reason and leaves no QEMU behind.
func TestSaveStateAndRestore(t *testing.T) {
	testutil.SkipIfShort(t, "boots VMs under QEMU")
	spec := testSpec(t, "acpi")
	spec.MemoryMiB, spec.Network = 128, true
	spec.MAC = "52:54:00:01:02:03"
	src := startVM(t, spec, newStateDir(t))
	waitBoot(t, src)
	snapDir := t.TempDir()
	path := filepath.Join(snapDir, "state")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	stoppedRan := false
	saved, err := src.SaveState(ctx, path, func() error {
		st, err := src.RunState(ctx)
		if err != nil || st != "postmigrate" {
			t.Errorf("whileStopped: run state %q (%v), want postmigrate", st, err)
		}
		stoppedRan = true
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Size() != saved.Bytes || saved.Bytes < 1<<20 {
		t.Fatalf("saved %d bytes, file %v (%v)", saved.Bytes, fi, err)
	}
	if !stoppedRan || saved.Paused <= 0 {
		t.Errorf("whileStopped ran %v, paused %s", stoppedRan, saved.Paused)
	}
	if left, _ := filepath.Glob(filepath.Join(snapDir, ".*")); len(left) > 0 {
		t.Errorf("temp files left: %v", left)
	}
	if st, err := src.RunState(ctx); err != nil || st != "running" {
		t.Errorf("source after save: %q (%v), want running", st, err)
	}
	echo := func(vm *VM, line string) {
		t.Helper()
		con, err := vm.AttachConsole(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer con.Close()
		if _, err := con.Write([]byte(line + "\n")); err != nil {
			t.Fatal(err)
		}
		testutil.ReadUntil(t, con, "QK-ECHO: "+line, 30*time.Second)
	}
	echo(src, "source-after-save")

	restored := spec
	restored.Name, restored.Incoming = "restored", path
	restored.AllowedDirs = append(restored.AllowedDirs, snapDir)
	restored.Nice = 6 // as a node with vmNice restores: -S and -incoming together
	dst := startVM(t, restored, newStateDir(t))
	if st, err := dst.RunState(ctx); err != nil || st != "running" {
		t.Fatalf("restored VM: %q (%v), want running", st, err)
	}
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", dst.Pid()))
	for _, f := range tasks {
		if n := threadNice(t, f); n != 6 {
			t.Errorf("restored VM thread %s: nice %d, want 6", f, n)
		}
	}
	restored.Nice = 0
	echo(dst, "hello-restored")
	if b, _ := dst.Console(); strings.Contains(string(b), bootMarker) {
		t.Errorf("the restored VM booted: %s", b)
	}

	other := restored
	other.Name, other.MemoryMiB = "other-size", 256
	dir := newStateDir(t)
	if vm, err := Start(ctx, other, dir); err == nil {
		killVM(vm)
		t.Fatal("a 256 MiB VM loaded a 128 MiB VM's state")
	} else if !strings.Contains(err.Error(), "QEMU exited") || !strings.Contains(err.Error(), "load of migration failed") {
		t.Errorf("error does not say why: %v", err)
	}
	if pid, err := readPidfile(dir); err == nil && qemuAlive(pid, dir) {
		t.Errorf("QEMU %d left running", pid)
	}

	garbage := filepath.Join(snapDir, "garbage")
	if err := os.WriteFile(garbage, []byte(strings.Repeat("x", 4096)), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := restored
	bad.Name, bad.Incoming = "garbage", garbage
	if vm, err := Start(ctx, bad, newStateDir(t)); err == nil {
		killVM(vm)
		t.Fatal("garbage loaded")
	} else if !strings.Contains(err.Error(), "Not a migration stream") {
		t.Errorf("error does not say why: %v", err)
	}
}
