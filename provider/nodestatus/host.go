package nodestatus

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// HostReadings is one sample of the host, taken every status period; the
// node status is computed from it by pure functions.
type HostReadings struct {
	// CPUs usable by this process.
	CPUs int
	// MemoryTotal and MemoryAvailable in bytes (/proc/meminfo MemTotal,
	// MemAvailable).
	MemoryTotal, MemoryAvailable int64
	// DiskTotal and DiskAvailable in bytes of the file system holding the
	// state directory.
	DiskTotal, DiskAvailable int64
	// RetainedBytes is the space the retained disks of deleted pods take
	// (<stateDir>/retained, package poddisk): reserved ephemeral-storage.
	RetainedBytes int64
	// PIDMax is kernel.pid_max; PIDsInUse the tasks currently running.
	PIDMax, PIDsInUse int64
	// StateDirError says why the state directory is unusable ("" = usable).
	StateDirError string
	// QEMUError says why the QEMU binary cannot be run ("" = found).
	QEMUError string
}

// HostSource reads the host. Paths are fields so tests can point them at
// fixture files.
type HostSource struct {
	StateDir   string
	QEMUBinary string
	ProcDir    string // default /proc
}

// Read takes one sample. Failures to read a value are reported in the
// returned error but the other values are still filled.
func (s HostSource) Read() (HostReadings, error) {
	proc := s.ProcDir
	if proc == "" {
		proc = "/proc"
	}
	var errs []string
	h := HostReadings{CPUs: runtime.NumCPU()}

	if err := checkStateDir(s.StateDir); err != nil {
		h.StateDirError = err.Error()
	}
	if _, err := exec.LookPath(s.QEMUBinary); err != nil {
		h.QEMUError = fmt.Sprintf("QEMU binary %q not usable: %v", s.QEMUBinary, err)
	}

	if b, err := os.ReadFile(filepath.Join(proc, "meminfo")); err != nil {
		errs = append(errs, err.Error())
	} else if total, avail, err := ParseMeminfo(b); err != nil {
		errs = append(errs, err.Error())
	} else {
		h.MemoryTotal, h.MemoryAvailable = total, avail
	}

	var st unix.Statfs_t
	if err := unix.Statfs(s.StateDir, &st); err != nil {
		errs = append(errs, fmt.Sprintf("statfs %s: %v", s.StateDir, err))
	} else {
		h.DiskTotal = int64(st.Blocks) * st.Bsize
		h.DiskAvailable = int64(st.Bavail) * st.Bsize
	}
	n, err := RetainedBytes(s.StateDir)
	h.RetainedBytes = n
	if err != nil {
		errs = append(errs, err.Error())
	}

	if b, err := os.ReadFile(filepath.Join(proc, "sys/kernel/pid_max")); err != nil {
		errs = append(errs, err.Error())
	} else if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err != nil {
		errs = append(errs, fmt.Sprintf("parse pid_max: %v", err))
	} else {
		h.PIDMax = v
	}
	if b, err := os.ReadFile(filepath.Join(proc, "loadavg")); err != nil {
		errs = append(errs, err.Error())
	} else if v, err := ParseLoadavgTasks(b); err != nil {
		errs = append(errs, err.Error())
	} else {
		h.PIDsInUse = v
	}
	if len(errs) > 0 {
		return h, fmt.Errorf("read host: %s", strings.Join(errs, "; "))
	}
	return h, nil
}

// checkStateDir makes sure dir exists and a file can be created in it.
func checkStateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return fmt.Errorf("state directory %s: %w", dir, err)
	}
	f, err := os.CreateTemp(dir, ".probe-*")
	if err != nil {
		return fmt.Errorf("state directory %s not writable: %w", dir, err)
	}
	name := f.Name()
	f.Close()
	if err := os.Remove(name); err != nil {
		return fmt.Errorf("state directory %s: %w", dir, err)
	}
	return nil
}

// ParseMeminfo returns MemTotal and MemAvailable in bytes.
func ParseMeminfo(b []byte) (total, available int64, err error) {
	var haveTotal, haveAvail bool
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		v, perr := strconv.ParseInt(f[1], 10, 64)
		if perr != nil {
			continue
		}
		if len(f) >= 3 && f[2] == "kB" {
			v *= 1024
		}
		switch f[0] {
		case "MemTotal:":
			total, haveTotal = v, true
		case "MemAvailable:":
			available, haveAvail = v, true
		}
	}
	if !haveTotal || !haveAvail {
		return 0, 0, fmt.Errorf("meminfo: MemTotal or MemAvailable missing")
	}
	return total, available, nil
}

// ParseLoadavgTasks returns the number of kernel scheduling entities (the
// "total" of the 4th field "running/total" of /proc/loadavg), which is what
// consumes PIDs.
func ParseLoadavgTasks(b []byte) (int64, error) {
	f := strings.Fields(string(b))
	if len(f) < 4 {
		return 0, fmt.Errorf("loadavg: want at least 4 fields, got %q", string(b))
	}
	_, total, ok := strings.Cut(f[3], "/")
	if !ok {
		return 0, fmt.Errorf("loadavg: bad tasks field %q", f[3])
	}
	v, err := strconv.ParseInt(total, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("loadavg: bad tasks field %q: %w", f[3], err)
	}
	return v, nil
}

// HostInfo is what does not change while qemu-kubelet runs.
type HostInfo struct {
	KernelVersion string
	OSImage       string
	MachineID     string
	BootID        string
	SystemUUID    string
}

// ReadHostInfo reads the kernel release, /etc/os-release PRETTY_NAME,
// machine-id and boot-id. Missing files leave fields empty.
func ReadHostInfo() HostInfo {
	var hi HostInfo
	var u unix.Utsname
	if err := unix.Uname(&u); err == nil {
		hi.KernelVersion = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/etc/os-release"); err == nil {
		hi.OSImage = ParseOSRelease(b)
	}
	if hi.OSImage == "" {
		hi.OSImage = runtime.GOOS
	}
	if b, err := os.ReadFile("/etc/machine-id"); err == nil {
		hi.MachineID = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		hi.BootID = strings.TrimSpace(string(b))
	}
	if b, err := os.ReadFile("/sys/class/dmi/id/product_uuid"); err == nil {
		hi.SystemUUID = strings.TrimSpace(string(b))
	}
	return hi
}

// ParseOSRelease returns PRETTY_NAME (else NAME VERSION) of an os-release file.
func ParseOSRelease(b []byte) string {
	vals := map[string]string{}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), "=")
		if !ok || strings.HasPrefix(k, "#") {
			continue
		}
		if uq, err := strconv.Unquote(v); err == nil {
			v = uq
		} else {
			v = strings.Trim(v, `'"`)
		}
		vals[k] = v
	}
	if v := vals["PRETTY_NAME"]; v != "" {
		return v
	}
	return strings.TrimSpace(vals["NAME"] + " " + vals["VERSION"])
}
