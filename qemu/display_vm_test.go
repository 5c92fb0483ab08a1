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
