package qemu

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

func TestCreateOverlayAndScratch(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	f, err := os.Create(base)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(1 << 30) // sparse 1 GiB
	f.Close()

	ov := filepath.Join(dir, "ov.qcow2")
	if err := CreateOverlay(ctx, base, "", ov, 0); err != nil {
		t.Fatal(err)
	}
	info, err := InspectImage(ctx, ov)
	if err != nil {
		t.Fatal(err)
	}
	if info.Format != "qcow2" || info.BackingFile != base || info.VirtualSize != 1<<30 {
		t.Fatalf("overlay info %+v", info)
	}
	if fi, _ := os.Stat(ov); fi.Size() > 1<<20 {
		t.Fatalf("overlay is %d bytes: not O(1)", fi.Size())
	}
	if err := CreateOverlay(ctx, base, FormatRaw, ov, 0); err == nil || !strings.Contains(err.Error(), "already exists") {
		t.Fatalf("overwriting an overlay: %v", err)
	}
	if err := CreateOverlay(ctx, filepath.Join(dir, "nope"), FormatRaw, filepath.Join(dir, "x.qcow2"), 0); err == nil || !strings.Contains(err.Error(), "nope") {
		t.Fatalf("missing base: %v", err)
	}
	big := filepath.Join(dir, "big.qcow2")
	if err := CreateOverlay(ctx, base, FormatRaw, big, 2<<30); err != nil {
		t.Fatal(err)
	}
	if info, _ := InspectImage(ctx, big); info.VirtualSize != 2<<30 {
		t.Fatalf("grown overlay virtual size %d", info.VirtualSize)
	}

	sc := filepath.Join(dir, "scratch.qcow2")
	if err := CreateScratchDisk(ctx, sc, 512<<20); err != nil {
		t.Fatal(err)
	}
	if info, _ := InspectImage(ctx, sc); info.VirtualSize != 512<<20 || info.BackingFile != "" {
		t.Fatalf("scratch %+v", info)
	}
	if err := CreateScratchDisk(ctx, filepath.Join(dir, "z.qcow2"), 0); err == nil {
		t.Fatal("zero-size scratch disk accepted")
	}
}

func TestCreateConfigDisk(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	p := filepath.Join(dir, "seed.img")
	files := map[string][]byte{
		"meta-data":         []byte("instance-id: vm1\n"),
		"user-data":         []byte("#cloud-config\n"),
		"secrets/token.txt": []byte("s3cret"),
		"vendor-data":       {},
	}
	if err := CreateConfigDisk(ctx, p, "cidata", files); err != nil {
		t.Fatal(err)
	}
	if got := listDir(t, dir); len(got) != 1 || got[0] != "seed.img" {
		t.Fatalf("files left next to the disk: %v (contents go to mcopy on stdin)", got)
	}
	if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("config disk mode %v (%v), want 0600: it may hold a Secret", fi.Mode(), err)
	}
	if out, err := exec.Command("mtype", "-i", p, "::vendor-data").CombinedOutput(); err != nil || len(out) != 0 {
		t.Fatalf("empty file: %q %v", out, err)
	}
	out, err := exec.Command("mtype", "-i", p, "::secrets/token.txt").CombinedOutput()
	if err != nil || string(out) != "s3cret" {
		t.Fatalf("read back: %q %v", out, err)
	}
	label, err := exec.Command("mlabel", "-s", "-i", p, "::").CombinedOutput()
	if err != nil || !strings.Contains(string(label), "CIDATA") {
		t.Fatalf("label: %q %v", label, err)
	}
	for name, bad := range map[string]map[string][]byte{
		"traversal": {"../x": nil},
		"absolute":  {"/etc/x": nil},
	} {
		if err := CreateConfigDisk(ctx, filepath.Join(dir, name+".img"), "cidata", bad); err == nil {
			t.Errorf("%s name accepted", name)
		}
	}
	if err := CreateConfigDisk(ctx, filepath.Join(dir, "l.img"), "way-too-long-label", files); err == nil {
		t.Error("long label accepted")
	}
	if err := CreateConfigDisk(ctx, filepath.Join(dir, "big.img"), "cfg", map[string][]byte{"x": make([]byte, ConfigDiskMaxBytes+1)}); err == nil {
		t.Error("oversized config accepted")
	}
}

// TestDiskBootAndConfigDisk boots the firmware-bootable test disk through an
// overlay (the base stays untouched), with a read-only config disk and a
// scratch disk attached.
func TestDiskBootAndConfigDisk(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	img := testImage(t)
	dir := newStateDir(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	base := filepath.Join(img, "disk.qcow2")
	before, _ := os.Stat(base)
	ov := filepath.Join(dir, "root.qcow2")
	if err := CreateOverlay(ctx, base, FormatQCOW2, ov, 0); err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "config.img")
	if err := CreateConfigDisk(ctx, cfg, "cidata", map[string][]byte{"meta-data": []byte("x")}); err != nil {
		t.Fatal(err)
	}
	scratch := filepath.Join(dir, "scratch.qcow2")
	if err := CreateScratchDisk(ctx, scratch, 64<<20); err != nil {
		t.Fatal(err)
	}
	spec := Spec{
		Name: "disk-boot", CPUs: 1, MemoryMiB: 256,
		Disks: []Disk{
			{Path: ov, Format: FormatQCOW2, Serial: "root"},
			{Path: cfg, Format: FormatRaw, ReadOnly: true, Serial: "cidata"},
			{Path: scratch, Format: FormatQCOW2, Serial: "scratch"},
		},
		AllowedDirs: []string{img},
	}
	vm := startVM(t, spec, dir)
	waitBoot(t, vm)
	ex, err := vm.Stop(ctx, StopOptions{Grace: 60 * time.Second, Keep: []string{"root.qcow2"}})
	if err != nil || ex.Class != ExitGuestShutdown {
		t.Fatalf("stop: %+v %v", ex, err)
	}
	if got := listDir(t, dir); len(got) != 1 || got[0] != "root.qcow2" {
		t.Fatalf("state dir after Stop(Keep=root.qcow2): %v", got)
	}
	after, _ := os.Stat(base)
	if !after.ModTime().Equal(before.ModTime()) || after.Size() != before.Size() {
		t.Fatal("base image was modified")
	}
}
