package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/pinned"
)

// AccelPolicy is the caller's choice of accelerator.
type AccelPolicy string

const (
	// AccelRequireKVM fails when KVM does not run guest code.
	AccelRequireKVM AccelPolicy = "require-kvm"
	// AccelPreferKVM uses KVM when it runs guest code, TCG otherwise.
	AccelPreferKVM AccelPolicy = "prefer-kvm"
	// AccelTCGOnly never tries KVM.
	AccelTCGOnly AccelPolicy = "tcg"
)

// Accelerator is the accelerator a VM runs with.
type Accelerator string

const (
	AccelKVM Accelerator = "kvm"
	AccelTCG Accelerator = "tcg"
)

// DefaultQEMUBinary is the x86_64 system emulator looked up in $PATH.
const DefaultQEMUBinary = "qemu-system-x86_64"

// ProbeOptions configures ProbeAccelerator.
type ProbeOptions struct {
	// Arch is the guest architecture the VMs will have; default the host's
	// (x86_64 when the host is none of Arches). KVM runs only the host's
	// own architecture: for another one the answer is TCG without a probe
	// (an error under AccelRequireKVM).
	Arch Arch
	// QEMUBinary defaults to Arch.Binary() (qemu-system-<arch>).
	QEMUBinary string
	// Policy defaults to AccelPreferKVM.
	Policy AccelPolicy
	// Timeout bounds the KVM probe VM (default 10s). A KVM that works runs
	// the probe guest in well under a second.
	Timeout time.Duration
	// WorkDir holds the probe's boot sector; default a fresh temp dir,
	// removed afterwards.
	WorkDir string
	// RunAs runs the probe VM as the VMs' user (Spec.RunAs, with /dev/kvm's
	// group): KVM counts as usable only if that user can use it. Nil: the
	// caller's.
	RunAs *User
}

// ProbeResult is the decision and why.
type ProbeResult struct {
	Accelerator Accelerator
	// Reason is for humans, e.g. "KVM probe failed: ...; falling back to TCG".
	Reason string
	// KVMError is why KVM was not usable ("" when KVM works or was not tried).
	KVMError string
	// KVMProbeDuration is how long the KVM probe VM took (0 when not tried).
	KVMProbeDuration time.Duration
}

// probeExitValue is written by the probe guest to isa-debug-exit; QEMU then
// exits with (value<<1)|1.
const (
	probeExitValue = 0x31
	probeExitCode  = probeExitValue<<1 | 1 // 99
)

// probeBootSector is a 512-byte real-mode boot sector: mov al,0x31;
// out 0xf4,al (isa-debug-exit); hlt; jmp $. It proves the firmware ran and
// handed control to guest code, and that guest I/O reaches QEMU.
func probeBootSector() []byte {
	b := make([]byte, 512)
	copy(b, []byte{0xb0, probeExitValue, 0xe6, 0xf4, 0xf4, 0xeb, 0xfe})
	b[510], b[511] = 0x55, 0xaa
	return b
}

// probeAArch64Image is a raw aarch64 "kernel" for -machine virt -kernel:
// movz x0,#0x8; movk x0,#0x8400,lsl #16 (x0 = PSCI SYSTEM_OFF); hvc #0;
// b . — QEMU (KVM or TCG) powers the machine off and exits 0 only if the
// guest's first instructions ran; otherwise it hangs until the timeout.
func probeAArch64Image() []byte {
	var b []byte
	for _, insn := range []uint32{0xd2800100, 0xf2b08000, 0xd4000002, 0x14000000} {
		b = append(b, byte(insn), byte(insn>>8), byte(insn>>16), byte(insn>>24))
	}
	return b
}

// ProbeAccelerator decides KVM vs TCG by actually starting a tiny VM under
// KVM: firmware boots a boot sector that signals through isa-debug-exit, so a
// /dev/kvm that opens but cannot run guest code (nested virtualization, as on
// some CI machines) is detected. Under AccelRequireKVM a failed KVM probe is
// an error naming why; under AccelTCGOnly KVM is not tried.
func ProbeAccelerator(ctx context.Context, opts ProbeOptions) (ProbeResult, error) {
	if opts.Arch == "" {
		opts.Arch = HostArch()
		if opts.Arch == "" {
			opts.Arch = ArchX86_64
		}
	}
	if !opts.Arch.Valid() {
		return ProbeResult{}, fmt.Errorf("probe accelerator: arch %q: want %q or %q", opts.Arch, ArchX86_64, ArchAArch64)
	}
	if opts.QEMUBinary == "" {
		opts.QEMUBinary = opts.Arch.Binary()
	}
	if opts.Policy == "" {
		opts.Policy = AccelPreferKVM
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 10 * time.Second
	}
	switch opts.Policy {
	case AccelTCGOnly:
		return ProbeResult{Accelerator: AccelTCG, Reason: "accelerator policy is tcg; KVM not tried"}, nil
	case AccelPreferKVM, AccelRequireKVM:
	default:
		return ProbeResult{}, fmt.Errorf("unknown accelerator policy %q (want %q, %q or %q)", opts.Policy, AccelRequireKVM, AccelPreferKVM, AccelTCGOnly)
	}
	if !opts.Arch.CanKVM() {
		why := fmt.Sprintf("KVM cannot run %s guests on this %s host", opts.Arch, HostArch())
		if opts.Policy == AccelRequireKVM {
			return ProbeResult{KVMError: why}, fmt.Errorf("accelerator policy require-kvm: %s", why)
		}
		return ProbeResult{Accelerator: AccelTCG, Reason: why + "; using TCG"}, nil
	}
	start := time.Now()
	kvmErr := probeKVM(ctx, opts)
	took := time.Since(start)
	if kvmErr == nil {
		return ProbeResult{Accelerator: AccelKVM, Reason: fmt.Sprintf("KVM probe VM ran guest code in %s", took.Round(time.Millisecond)), KVMProbeDuration: took}, nil
	}
	if ctx.Err() != nil {
		return ProbeResult{}, fmt.Errorf("probe KVM: %w", ctx.Err())
	}
	res := ProbeResult{KVMError: kvmErr.Error(), KVMProbeDuration: took}
	if opts.Policy == AccelRequireKVM {
		return res, fmt.Errorf("accelerator policy require-kvm: KVM probe failed: %w", kvmErr)
	}
	res.Accelerator = AccelTCG
	res.Reason = fmt.Sprintf("KVM probe failed: %s; falling back to TCG", kvmErr)
	return res, nil
}

func probeKVM(ctx context.Context, opts ProbeOptions) error {
	f, err := os.OpenFile(KVMDevice, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", KVMDevice, err)
	}
	f.Close()
	if u := opts.RunAs; u != nil && u.UID != 0 {
		if _, ok := kvmGroup(KVMDevice); !ok {
			fi, _ := os.Stat(KVMDevice)
			if fi == nil || fi.Mode().Perm()&0o006 != 0o006 {
				return fmt.Errorf("%s is not usable by the VMs' uid %d gid %d: give it a group with read and write (udev's kvm group, mode 0660)", KVMDevice, u.UID, u.GID)
			}
		}
	}
	if opts.Arch == ArchX86_64 {
		if err := kvmModuleError("/sys/module"); err != nil {
			return err
		}
	}
	return probeGuest(ctx, opts, AccelKVM)
}

// kvmModuleError says why the x86 KVM behind /dev/kvm cannot run the
// node's guests, judged from the loaded modules under sysModule
// (/sys/module): nil with kvm_intel or kvm_amd (hardware virtualization)
// or when nothing tells. kvm_pvm alone is PVM, KVM without hardware
// virtualization: only guest kernels built for PVM run under it. A stock
// kernel hangs in its first instructions (the host logs "kvm-pvm:
// INTERNAL_ERROR in batch emul"), while the probe's boot sector, which
// never leaves low memory, runs; so the probe VM cannot tell and the
// modules must.
func kvmModuleError(sysModule string) error {
	loaded := func(m string) bool {
		_, err := os.Stat(filepath.Join(sysModule, m))
		return err == nil
	}
	if loaded("kvm_intel") || loaded("kvm_amd") {
		return nil
	}
	if loaded("kvm_pvm") {
		return fmt.Errorf("/dev/kvm is kvm_pvm (KVM without hardware virtualization; neither kvm_intel nor kvm_amd is loaded): only PVM-enabled guest kernels run under it")
	}
	return nil
}

// probeArgs is the probe VM's command line for arch under accel: firmware
// plus boot sector and isa-debug-exit on x86_64, a bare kernel calling PSCI
// SYSTEM_OFF on aarch64.
func probeArgs(arch Arch, accel Accelerator, img string) (args []string, okExit int) {
	cpu := "host"
	if accel != AccelKVM {
		cpu = "max"
	}
	common := []string{"-accel", string(accel), "-cpu", cpu, "-nodefaults", "-no-user-config", "-display", "none", "-m", "16"}
	if arch == ArchAArch64 {
		return append([]string{"-machine", "virt"}, append(common, "-kernel", img)...), 0
	}
	return append([]string{"-machine", "pc"}, append(common,
		"-drive", "file="+img+",format=raw,if=floppy,readonly=on",
		"-device", "isa-debug-exit,iobase=0xf4,iosize=0x04",
		"-no-reboot")...), probeExitCode
}

// probeGuest runs the probe guest of opts.Arch under accel; nil when its
// code ran (QEMU exited with the probe's code).
func probeGuest(ctx context.Context, opts ProbeOptions, accel Accelerator) error {
	var err error
	dir := opts.WorkDir
	if dir == "" {
		dir, err = os.MkdirTemp("", "qk-kvm-probe-")
		if err != nil {
			return fmt.Errorf("create probe dir: %w", err)
		}
		defer os.RemoveAll(dir)
	} else if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create probe dir %s: %w", dir, err)
	}
	img := filepath.Join(dir, "kvm-probe-boot.img")
	code := probeBootSector()
	if opts.Arch == ArchAArch64 {
		code = probeAArch64Image()
	}
	if err := os.WriteFile(img, code, 0o600); err != nil {
		return fmt.Errorf("write probe guest: %w", err)
	}
	defer os.Remove(img)
	if u := opts.RunAs; u != nil {
		if err := os.Lchown(dir, -1, int(u.GID)); err != nil {
			return fmt.Errorf("give the probe dir to gid %d: %w", u.GID, err)
		}
		if err := os.Chmod(dir, 0o710); err != nil {
			return fmt.Errorf("chmod probe dir: %w", err)
		}
		if err := os.Lchown(img, int(u.UID), int(u.GID)); err != nil {
			return fmt.Errorf("give the probe guest to uid %d: %w", u.UID, err)
		}
		if err := reachable(Spec{RunAs: u, Accelerator: accel}.credential(), img, true); err != nil {
			return fmt.Errorf("probe guest: %w", err)
		}
	}
	return runProbeImage(ctx, opts, accel, img)
}

// runProbeImage boots the probe image img and judges QEMU's exit.
func runProbeImage(ctx context.Context, opts ProbeOptions, accel Accelerator, img string) error {
	pctx, cancel := context.WithTimeout(ctx, opts.Timeout)
	defer cancel()
	args, okExit := probeArgs(opts.Arch, accel, img)
	cmd := exec.CommandContext(pctx, opts.QEMUBinary, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if opts.RunAs != nil {
		cmd.SysProcAttr.Credential = Spec{RunAs: opts.RunAs, Accelerator: accel}.credential()
	}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 2 * time.Second
	err := pinned.Run(cmd)
	msg := strings.TrimSpace(stderr.String())
	var ee *exec.ExitError
	name := strings.ToUpper(string(accel))
	switch {
	case pctx.Err() != nil && ctx.Err() == nil:
		return fmt.Errorf("%s guest did not run its probe code within %s (QEMU stderr: %q)", name, opts.Timeout, msg)
	case err == nil && okExit == 0:
		return nil
	case err == nil:
		return fmt.Errorf("QEMU under %s exited 0 without the probe guest signalling (stderr: %q)", name, msg)
	case errors.As(err, &ee) && ee.ExitCode() == okExit && okExit != 0:
		return nil
	default:
		return fmt.Errorf("QEMU under %s failed: %v (stderr: %q)", name, err, msg)
	}
}

var versionRE = regexp.MustCompile(`version (\d+\.\d+(?:\.\d+)?)`)

// Version returns the QEMU version, e.g. "7.2.22", from `<binary> --version`.
func Version(ctx context.Context, qemuBinary string) (string, error) {
	if qemuBinary == "" {
		qemuBinary = DefaultQEMUBinary
	}
	out, err := exec.CommandContext(ctx, qemuBinary, "--version").Output()
	if err != nil {
		return "", fmt.Errorf("run %s --version: %w", qemuBinary, err)
	}
	return parseVersion(string(out))
}

func parseVersion(out string) (string, error) {
	m := versionRE.FindStringSubmatch(out)
	if m == nil {
		return "", fmt.Errorf("no version in QEMU output %q", strings.TrimSpace(out))
	}
	return m[1], nil
}
