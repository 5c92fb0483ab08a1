package qemu

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

func TestFlattenDisk(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	data := make([]byte, 1<<20)
	copy(data[4096:], "base data")
	if err := os.WriteFile(base, data, 0o600); err != nil {
		t.Fatal(err)
	}
	ov := filepath.Join(dir, "ov.qcow2")
	if err := CreateOverlay(ctx, base, FormatRaw, ov, 0); err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "flat.qcow2")
	// A copy left by an interrupted call is replaced.
	if err := os.WriteFile(dst+".tmp", []byte("half"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := FlattenDisk(ctx, ov, dst); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(dst + ".tmp"); !os.IsNotExist(err) {
		t.Fatalf("temporary copy left: %v", err)
	}
	info, err := InspectImage(ctx, dst)
	if err != nil {
		t.Fatal(err)
	}
	if info.Format != "qcow2" || info.BackingFile != "" || info.VirtualSize != 1<<20 {
		t.Fatalf("flattened disk %+v: want a standalone 1 MiB qcow2", info)
	}
	// The base's data is in the copy: it reads the same without the base.
	if err := os.Remove(base); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out.raw")
	if _, err := runTool(ctx, QEMUImgBinary, "convert", "-O", "raw", dst, out); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	if string(got[4096:4096+9]) != "base data" {
		t.Fatalf("flattened disk lost the base's data: %q", got[4096:4096+9])
	}

	if err := FlattenDisk(ctx, ov, dst); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("over an existing copy: %v", err)
	}
	if err := FlattenDisk(ctx, filepath.Join(dir, "nope.qcow2"), filepath.Join(dir, "x.qcow2")); err == nil || !strings.Contains(err.Error(), "nope.qcow2") {
		t.Fatalf("missing source: %v", err)
	}
}
