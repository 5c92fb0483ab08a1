package nodestatus

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestEnableKSM(t *testing.T) {
	dir := t.TempDir()
	run := filepath.Join(dir, "run")
	if err := EnableKSM(dir, 0); err == nil || !strings.Contains(err.Error(), "cannot be read") {
		t.Fatalf("no run file: want a read error, got %v", err)
	}
	if err := os.WriteFile(run, []byte("0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := EnableKSM(dir, 0); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(run); strings.TrimSpace(string(b)) != "1" {
		t.Fatalf("run = %q, want 1", b)
	}
	// Already running: nothing written (a read-only file is fine).
	if err := os.Chmod(run, 0o444); err != nil {
		t.Fatal(err)
	}
	if err := EnableKSM(dir, 0); err != nil {
		t.Fatalf("already running: %v", err)
	}
	if os.Geteuid() != 0 { // root writes through 0444
		os.WriteFile(run, []byte("0\n"), 0o644)
		os.Chmod(run, 0o444)
		if err := EnableKSM(dir, 0); err == nil || !strings.Contains(err.Error(), "cannot start KSM") {
			t.Fatalf("read-only run: want a write error, got %v", err)
		}
	}
}

// ksmPagesToScan reaches pages_to_scan; 0 leaves it alone.
func TestEnableKSMPagesToScan(t *testing.T) {
	dir := t.TempDir()
	run, pages := filepath.Join(dir, "run"), filepath.Join(dir, "pages_to_scan")
	if err := EnableKSM(dir, 1000); err == nil || !strings.Contains(err.Error(), "cannot be read") {
		t.Fatalf("no run file: want a read error, got %v", err)
	}
	os.WriteFile(run, []byte("0\n"), 0o644)
	os.WriteFile(pages, []byte("100\n"), 0o644)
	if err := EnableKSM(dir, 0); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(pages); strings.TrimSpace(string(b)) != "100" {
		t.Fatalf("pagesToScan 0: pages_to_scan = %q, want 100 (untouched)", b)
	}
	if err := EnableKSM(dir, 1000); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(pages); strings.TrimSpace(string(b)) != "1000" {
		t.Fatalf("pages_to_scan = %q, want 1000", b)
	}
	if err := EnableKSM(filepath.Join(dir, "missing"), 1000); err == nil || !strings.Contains(err.Error(), "ksmPagesToScan") {
		t.Fatalf("unwritable pages_to_scan: want an error naming ksmPagesToScan, got %v", err)
	}
}

func TestReadKSM(t *testing.T) {
	dir := t.TempDir()
	for name, v := range map[string]string{"run": "1\n", "pages_shared": "120\n", "pages_sharing": "3400\n", "full_scans": "7\n"} {
		os.WriteFile(filepath.Join(dir, name), []byte(v), 0o644)
	}
	s, err := ReadKSM(dir)
	if err != nil {
		t.Fatal(err)
	}
	if s != (KSMStats{Run: 1, PagesShared: 120, PagesSharing: 3400, FullScans: 7}) {
		t.Fatalf("got %+v", s)
	}
	os.WriteFile(filepath.Join(dir, "full_scans"), []byte("many\n"), 0o644)
	if _, err := ReadKSM(dir); err == nil || !strings.Contains(err.Error(), "full_scans") {
		t.Fatalf("want an error naming full_scans, got %v", err)
	}
}
