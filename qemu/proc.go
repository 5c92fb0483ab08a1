package qemu

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
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
