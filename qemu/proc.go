package qemu

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// readPidfile returns the pid QEMU wrote to the state dir.
func readPidfile(stateDir string) (int, error) {
	b, err := os.ReadFile(filepath.Join(stateDir, PidfileName))
	if err != nil {
		return 0, fmt.Errorf("read pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pidfile %s: bad content %q", filepath.Join(stateDir, PidfileName), b)
	}
	return pid, nil
}

// qemuAlive reports whether pid is a live (not zombie) QEMU process serving
// this state dir: the pid could have been reused after QEMU died, so its
// command line must name our QMP socket.
func qemuAlive(pid int, stateDir string) bool {
	if pid <= 0 {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// state is the field after the parenthesised comm.
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) {
		if s := stat[i+2]; s == 'Z' || s == 'X' {
			return false
		}
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	return bytes.Contains(cmdline, []byte(filepath.Join(stateDir, QMPSocketName)))
}

// KillStale SIGKILLs the QEMU whose pidfile is in stateDir, if that
// process is a live QEMU serving stateDir (qemuAlive: pids are reused, so
// any other process is left alone), and waits up to wait for it to go. For
// a QEMU that Adopt could not reach and that must not run on unsupervised.
// No pidfile, or no such QEMU: nothing to do.
func KillStale(stateDir string, wait time.Duration) error {
	abs, err := filepath.Abs(stateDir)
	if err != nil {
		return fmt.Errorf("kill stale QEMU: state dir %s: %w", stateDir, err)
	}
	pid, err := readPidfile(abs)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("kill stale QEMU: %w", err)
	}
	if !qemuAlive(pid, abs) {
		return nil // gone, or not ours
	}
	if err := signalPid(pid, syscall.SIGKILL); err != nil {
		return fmt.Errorf("kill stale QEMU: %w", err)
	}
	for deadline := time.Now().Add(wait); qemuAlive(pid, abs); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("kill stale QEMU: pid %d still alive %s after SIGKILL", pid, wait)
		}
	}
	return nil
}

func signalPid(pid int, sig syscall.Signal) error {
	if err := syscall.Kill(pid, sig); err != nil && err != syscall.ESRCH {
		return fmt.Errorf("signal %v to QEMU pid %d: %w", sig, pid, err)
	}
	return nil
}

// writeFileAtomic writes via a temp file and rename.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, data, perm); err != nil {
		return fmt.Errorf("write %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("rename %s: %w", path, err)
	}
	return nil
}

// ProcStats is the resource use of the QEMU process (for the provider's
// /stats/summary and metrics).
type ProcStats struct {
	// CPUTime is user+system CPU time consumed so far.
	CPUTime time.Duration
	// RSSBytes is the resident set size.
	RSSBytes int64
	// PSSBytes is the proportional set size: resident pages, each shared
	// page (libraries, page cache, pages KSM merged with other VMs) divided
	// by the number of processes mapping it; summed over all VMs it is what
	// they cost the host. 0 when /proc/<pid>/smaps_rollup is unreadable.
	PSSBytes int64
	// AnonBytes is the anonymous part of RSS (guest RAM, QEMU's heap and
	// TCG buffers); 0 when smaps_rollup is unreadable.
	AnonBytes int64
	At        time.Time
}

// parseSmapsRollup reads Rss, Pss and Anonymous (kB) of
// /proc/<pid>/smaps_rollup, in bytes.
func parseSmapsRollup(b []byte) (rss, pss, anon int64, err error) {
	seen := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) != 3 || f[2] != "kB" {
			continue
		}
		var dst *int64
		switch f[0] {
		case "Rss:":
			dst = &rss
		case "Pss:":
			dst = &pss
		case "Anonymous:":
			dst = &anon
		default:
			continue
		}
		v, perr := strconv.ParseInt(f[1], 10, 64)
		if perr != nil || v < 0 {
			return 0, 0, 0, fmt.Errorf("parse smaps_rollup %s %q", f[0], f[1])
		}
		*dst = v << 10
		seen++
	}
	if seen != 3 {
		return 0, 0, 0, fmt.Errorf("parse smaps_rollup: want Rss, Pss and Anonymous, found %d of them", seen)
	}
	return rss, pss, anon, nil
}

// clockTicks is USER_HZ; 100 on every Linux architecture Go supports.
const clockTicks = 100

// readProcStats reads /proc/<pid>/stat and smaps_rollup (statm when
// smaps_rollup cannot be read or parsed, e.g. without ptrace access to
// QEMU: RSS only).
func readProcStats(pid int) (ProcStats, error) {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ProcStats{}, fmt.Errorf("read stats of pid %d: %w", pid, err)
	}
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return ProcStats{}, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(string(stat[i+1:]))
	// After ")": state(0) ... utime is field 14 of the full line = index 11 here.
	if len(f) < 13 {
		return ProcStats{}, fmt.Errorf("parse /proc/%d/stat: %d fields", pid, len(f))
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return ProcStats{}, fmt.Errorf("parse /proc/%d/stat cpu times", pid)
	}
	ps := ProcStats{CPUTime: time.Duration(ut+st) * time.Second / clockTicks}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps_rollup", pid)); err == nil {
		// Empty for a process without memory (a kernel thread): statm.
		if rss, pss, anon, err := parseSmapsRollup(b); err == nil {
			ps.RSSBytes, ps.PSSBytes, ps.AnonBytes, ps.At = rss, pss, anon, time.Now()
			return ps, nil
		}
	}
	statm, err := os.ReadFile(fmt.Sprintf("/proc/%d/statm", pid))
	if err != nil {
		return ProcStats{}, fmt.Errorf("read stats of pid %d: %w", pid, err)
	}
	sf := strings.Fields(string(statm))
	if len(sf) < 2 {
		return ProcStats{}, fmt.Errorf("parse /proc/%d/statm", pid)
	}
	rss, err := strconv.ParseInt(sf[1], 10, 64)
	if err != nil {
		return ProcStats{}, fmt.Errorf("parse /proc/%d/statm: %w", pid, err)
	}
	ps.RSSBytes, ps.At = rss*int64(os.Getpagesize()), time.Now()
	return ps, nil
}
