package nodestatus

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// KSMDir is where the kernel exposes its same-page merging (KSM) controls.
const KSMDir = "/sys/kernel/mm/ksm"

// EnableKSM starts the kernel's same-page merging (writes 1 to <dir>/run)
// unless it already runs; dir is KSMDir outside tests. It never stops KSM:
// other users of the host may rely on it. Only guest RAM QEMU marked
// mergeable (vmMemory.pageMerging) is scanned. pagesToScan > 0 is written
// to <dir>/pages_to_scan first (vmMemory.ksmPagesToScan: the pages ksmd
// scans per wake-up, host-wide); 0 leaves the kernel's rate.
func EnableKSM(dir string, pagesToScan int) error {
	if pagesToScan > 0 {
		p := filepath.Join(dir, "pages_to_scan")
		if err := os.WriteFile(p, []byte(strconv.Itoa(pagesToScan)+"\n"), 0); err != nil {
			return fmt.Errorf("vmMemory.ksmPagesToScan: cannot write %d to %s (needs root, a writable /sys and a kernel with KSM): %w", pagesToScan, p, err)
		}
	}
	run := filepath.Join(dir, "run")
	b, err := os.ReadFile(run)
	if err != nil {
		return fmt.Errorf("vmMemory.enableKSM: the kernel's KSM control %s cannot be read (kernel without CONFIG_KSM?): %w", run, err)
	}
	if strings.TrimSpace(string(b)) == "1" {
		return nil
	}
	if err := os.WriteFile(run, []byte("1\n"), 0); err != nil {
		return fmt.Errorf("vmMemory.enableKSM: cannot start KSM by writing 1 to %s (needs root and a writable /sys): %w", run, err)
	}
	return nil
}

// KSMStats are the kernel's KSM counters (pages).
type KSMStats struct {
	// Run is the value of run (0 stopped, 1 running, 2 unmerging).
	Run int64
	// PagesShared: merged pages kept; PagesSharing: the pages mapping them
	// (the memory saved is PagesSharing pages).
	PagesShared, PagesSharing int64
	FullScans                 int64
}

// ReadKSM reads the KSM counters of dir (KSMDir outside tests).
func ReadKSM(dir string) (KSMStats, error) {
	var s KSMStats
	for _, f := range []struct {
		name string
		dst  *int64
	}{{"run", &s.Run}, {"pages_shared", &s.PagesShared}, {"pages_sharing", &s.PagesSharing}, {"full_scans", &s.FullScans}} {
		b, err := os.ReadFile(filepath.Join(dir, f.name))
		if err != nil {
			return s, fmt.Errorf("read KSM counters: %w", err)
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		if err != nil {
			return s, fmt.Errorf("read KSM counter %s: %w", f.name, err)
		}
		*f.dst = v
	}
	return s, nil
}
