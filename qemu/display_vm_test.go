package qemu

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestDisplayVNC: a VM with a display serves VNC on its state dir's
// socket (the RFB greeting, and a second client at once); one without
// refuses DialDisplay.
func TestDisplayVNC(t *testing.T) {
	spec := testSpec(t, "acpi")
	spec.Display = true
	dir := newStateDir(t)
	vm := startVM(t, spec, dir)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; i < 2; i++ {
		c, err := vm.DialDisplay(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(20 * time.Second))
		greet := make([]byte, 12)
		if _, err := io.ReadFull(c, greet); err != nil {
			t.Fatalf("client %d: read RFB greeting: %v", i, err)
		}
		if string(greet[:4]) != "RFB " {
			t.Fatalf("client %d: greeting %q is not RFB", i, greet)
		}
	}
	fi, err := os.Stat(filepath.Join(dir, VNCSocketName))
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("VNC socket in the state dir: %v %v", fi, err)
	}

	plain := testSpec(t, "acpi")
	vm2 := startVM(t, plain, newStateDir(t))
	if _, err := vm2.DialDisplay(ctx); err == nil {
		t.Fatal("DialDisplay on a VM without a display succeeded")
	}
}

// TestDisplaySnapshotRestore: a VM with a display (an exporter pod's
// default) saves its state and a VM of the same spec starts from it, as a
// snapshot-start pod does: it runs the guest without booting it (console
// input echoed) and its VNC server greets a client.
func TestDisplaySnapshotRestore(t *testing.T) {
	testutil.SkipIfShort(t, "boots VMs under QEMU")
	spec := testSpec(t, "acpi")
	spec.MemoryMiB, spec.Network, spec.Display = 128, true, true
	spec.MAC = "52:54:00:01:02:04"
	src := startVM(t, spec, newStateDir(t))
	waitBoot(t, src)
	snapDir := t.TempDir()
	path := filepath.Join(snapDir, "state")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if _, err := src.SaveState(ctx, path, func() error { return nil }); err != nil {
		t.Fatalf("save the state of a VM with a display: %v", err)
	}
	killVM(src)

	restored := spec
	restored.Name, restored.Incoming = "restored", path
	restored.AllowedDirs = append(restored.AllowedDirs, snapDir)
	dst := startVM(t, restored, newStateDir(t))
	if st, err := dst.RunState(ctx); err != nil || st != "running" {
		t.Fatalf("restored VM with a display: %q (%v), want running", st, err)
	}
	con, err := dst.AttachConsole(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer con.Close()
	if _, err := con.Write([]byte("hello-display\n")); err != nil {
		t.Fatal(err)
	}
	testutil.ReadUntil(t, con, "QK-ECHO: hello-display", 30*time.Second)
	c, err := dst.DialDisplay(ctx)
	if err != nil {
		t.Fatalf("the restored VM's display: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	greet := make([]byte, 12)
	if _, err := io.ReadFull(c, greet); err != nil || string(greet[:4]) != "RFB " {
		t.Fatalf("the restored VM's VNC greeting: %q (%v), want RFB", greet, err)
	}
}

// TestGrowImage grows a qcow2 image's virtual size and never shrinks it.
func TestGrowImage(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	ctx := context.Background()
	p := filepath.Join(t.TempDir(), "d.qcow2")
	if err := CreateScratchDisk(ctx, p, 64<<20); err != nil {
		t.Fatal(err)
	}
	grew, err := GrowImage(ctx, p, 256<<20)
	if err != nil || !grew {
		t.Fatalf("grow: %v %v", grew, err)
	}
	if info, _ := InspectImage(ctx, p); info.VirtualSize != 256<<20 {
		t.Fatalf("virtual size %d after growing to 256 MiB", info.VirtualSize)
	}
	grew, err = GrowImage(ctx, p, 128<<20)
	if err != nil || grew {
		t.Fatalf("shrink request: grew=%v err=%v", grew, err)
	}
	if info, _ := InspectImage(ctx, p); info.VirtualSize != 256<<20 {
		t.Fatalf("virtual size %d after a smaller request: must stay 256 MiB", info.VirtualSize)
	}
	if _, err := GrowImage(ctx, filepath.Join(t.TempDir(), "none"), 1<<20); err == nil {
		t.Fatal("growing a missing image succeeded")
	}
}
