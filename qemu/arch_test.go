package qemu

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// foreignArch is a supported guest architecture that is not the host's.
func foreignArch() Arch {
	if HostArch() == ArchAArch64 {
		return ArchX86_64
	}
	return ArchAArch64
}

func TestArchTable(t *testing.T) {
	for _, tc := range []struct {
		in                               string
		want                             Arch
		goarch, binary, machine, console string
	}{
		{"amd64", ArchX86_64, "amd64", "qemu-system-x86_64", "q35", "console=ttyS0"},
		{"x86_64", ArchX86_64, "amd64", "qemu-system-x86_64", "q35", "console=ttyS0"},
		{"arm64", ArchAArch64, "arm64", "qemu-system-aarch64", "virt", "console=ttyAMA0"},
		{"aarch64", ArchAArch64, "arm64", "qemu-system-aarch64", "virt", "console=ttyAMA0"},
	} {
		a, err := ParseArch(tc.in)
		if err != nil || a != tc.want {
			t.Fatalf("ParseArch(%q) = %q, %v", tc.in, a, err)
		}
		if a.GOARCH() != tc.goarch || a.Binary() != tc.binary || a.DefaultMachine() != tc.machine || a.KernelConsole() != tc.console {
			t.Errorf("%s: %s %s %s %s", a, a.GOARCH(), a.Binary(), a.DefaultMachine(), a.KernelConsole())
		}
	}
	for _, bad := range []string{"", "riscv64", "arm", "AMD64"} {
		if _, err := ParseArch(bad); err == nil || !strings.Contains(err.Error(), "unknown architecture") {
			t.Errorf("ParseArch(%q): want an error, got %v", bad, err)
		}
	}
	if !HostArch().CanKVM() || foreignArch().CanKVM() {
		t.Errorf("KVM runs the host's architecture only: host %s", HostArch())
	}
}

func aarch64Spec() Spec {
	s := baseSpec()
	s.Arch = ArchAArch64
	s.Cmdline = "console=ttyAMA0 quiet"
	return s
}

func TestValidateArch(t *testing.T) {
	if err := aarch64Spec().Validate(); err != nil {
		t.Fatalf("aarch64 spec: %v", err)
	}
	cases := []struct {
		name string
		mut  func(*Spec)
		want string
	}{
		{"x86 machine on aarch64", func(s *Spec) { s.Machine = "q35" }, `machine "q35": not a aarch64 machine (want virt)`},
		{"microvm on aarch64", func(s *Spec) { s.Machine = "microvm"; s.Accelerator = AccelKVM }, `machine "microvm": not a aarch64 machine`},
		{"kvm for a foreign arch", func(s *Spec) { s.Arch = foreignArch(); s.Machine = ""; s.Accelerator = AccelKVM }, "accelerator kvm: KVM cannot run " + string(foreignArch())},
		{"virt on x86_64", func(s *Spec) { s.Arch = ArchX86_64; s.Machine = "virt" }, `machine "virt": not a x86_64 machine (want q35, pc, microvm)`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := aarch64Spec()
			tc.mut(&s)
			err := s.Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want error containing %q, got %v", tc.want, err)
			}
		})
	}
}

func TestArgsAArch64Golden(t *testing.T) {
	cases := map[string]func(*Spec){
		"aarch64-kernel-tcg": func(s *Spec) { s.Network = true; s.Forwards = []PortForward{{HostPort: 20080, GuestPort: 8080}} },
		"aarch64-disk-uefi": func(s *Spec) {
			s.Kernel, s.Initrd, s.Cmdline = "", "", ""
			s.Firmware = FirmwareUEFI
			s.UEFICode = "/images/AAVMF_CODE.fd"
			s.UEFIVarsTemplate = "/images/AAVMF_VARS.fd"
			s.Disks = []Disk{{Path: "/run/qk/vm1/root.qcow2", Serial: "root"}}
		},
	}
	for name, mut := range cases {
		t.Run(name, func(t *testing.T) {
			s := aarch64Spec()
			mut(&s)
			checkGolden(t, name, s)
			args := Args(s)
			joined := strings.Join(args, " ")
			for _, must := range []string{"-machine virt,gic-version=max", "-cpu max,pauth-impdef=on", "-device pvpanic-pci", "-accel tcg"} {
				if !strings.Contains(joined, must) {
					t.Errorf("missing %q in %s", must, joined)
				}
			}
			for _, mustNot := range []string{"-device pvpanic ", "vmport", "isa-"} {
				if strings.Contains(joined+" ", mustNot) {
					t.Errorf("x86-only %q on virt: %s", mustNot, joined)
				}
			}
		})
	}
	if got := aarch64Spec().withDefaults().QEMUBinary; got != "qemu-system-aarch64" {
		t.Errorf("default binary for aarch64 = %q", got)
	}
}

// TestProbeForeignArch: KVM never runs another architecture's guests, so
// no probe VM is started (the binary does not even exist here).
func TestProbeForeignArch(t *testing.T) {
	ctx := context.Background()
	a := foreignArch()
	res, err := ProbeAccelerator(ctx, ProbeOptions{Arch: a, Policy: AccelPreferKVM, QEMUBinary: "/nonexistent/qemu"})
	if err != nil || res.Accelerator != AccelTCG || !strings.Contains(res.Reason, "KVM cannot run "+string(a)+" guests") || res.KVMProbeDuration != 0 {
		t.Fatalf("prefer-kvm for %s: %+v %v", a, res, err)
	}
	_, err = ProbeAccelerator(ctx, ProbeOptions{Arch: a, Policy: AccelRequireKVM, QEMUBinary: "/nonexistent/qemu"})
	if err == nil || !strings.Contains(err.Error(), "require-kvm: KVM cannot run "+string(a)) {
		t.Fatalf("require-kvm for %s: want an error naming why, got %v", a, err)
	}
	if _, err := ProbeAccelerator(ctx, ProbeOptions{Arch: "mips", Policy: AccelTCGOnly}); err == nil || !strings.Contains(err.Error(), `arch "mips"`) {
		t.Fatalf("unknown arch: %v", err)
	}
}

// TestProbeGuestTCG runs each architecture's probe guest under TCG: the
// guest code (boot sector on x86_64, PSCI SYSTEM_OFF on aarch64) is what a
// KVM probe relies on, so it must really signal QEMU; a guest that does
// not (zeroed code) is reported as not having run.
func TestProbeGuestTCG(t *testing.T) {
	testutil.SkipIfShort(t, "QEMU")
	for _, a := range Arches {
		t.Run(string(a), func(t *testing.T) {
			ctx := context.Background()
			opts := ProbeOptions{Arch: a, QEMUBinary: a.Binary(), Timeout: 20 * time.Second, WorkDir: t.TempDir()}
			start := time.Now()
			if err := probeGuest(ctx, opts, AccelTCG); err != nil {
				t.Fatalf("probe guest under TCG: %v", err)
			}
			t.Logf("%s probe guest ran under TCG in %s", a, time.Since(start).Round(time.Millisecond))
			if a != ArchAArch64 {
				return
			}
			// A raw image that never calls PSCI: QEMU keeps running until
			// the timeout, which must be reported as "did not run".
			opts.Timeout = 2 * time.Second
			args, _ := probeArgs(a, AccelTCG, filepath.Join(opts.WorkDir, "zero.img"))
			if !strings.Contains(strings.Join(args, " "), "-machine virt") {
				t.Fatalf("aarch64 probe args: %v", args)
			}
			if err := os.WriteFile(filepath.Join(opts.WorkDir, "zero.img"), make([]byte, 64), 0o600); err != nil {
				t.Fatal(err)
			}
			err := runProbeImage(ctx, opts, AccelTCG, filepath.Join(opts.WorkDir, "zero.img"))
			if err == nil || !strings.Contains(err.Error(), "did not run its probe code") {
				t.Fatalf("zeroed guest: want 'did not run', got %v", err)
			}
		})
	}
}

// TestAArch64KernelBoot boots the arm64 test image (Debian arm64 kernel,
// busybox from Debian's arm64 packages) with direct kernel boot on
// -machine virt under TCG: boot marker from an aarch64 kernel, HTTP through
// a forward, and a graceful stop through the power button (gpio-keys on
// the device tree).
func TestAArch64KernelBoot(t *testing.T) {
	spec := testSpecArch(t, ArchAArch64, "acpi")
	hostPort, err := FreeLoopbackPort()
	if err != nil {
		t.Fatal(err)
	}
	spec.Network = true
	spec.Forwards = []PortForward{{HostPort: hostPort, GuestPort: 8080}}
	dir := newStateDir(t)
	start := time.Now()
	vm := startVM(t, spec, dir)
	waitBoot(t, vm)
	t.Logf("aarch64 TCG direct kernel boot to marker: %s", time.Since(start).Round(100*time.Millisecond))
	b, _ := vm.Console()
	if !strings.Contains(string(b), "arch=aarch64") || !strings.Contains(string(b), "-arm64") {
		t.Fatalf("console does not show an aarch64 kernel:\n%s", b)
	}
	body, err := httpGet(t, fmt.Sprintf("http://127.0.0.1:%d/", hostPort))
	if err != nil || !strings.Contains(body, "QK-HTTP-OK") {
		b, _ := vm.Console()
		q, _ := os.ReadFile(filepath.Join(dir, QEMULogName))
		ss, _ := exec.Command("ss", "-ltnp").CombinedOutput()
		t.Fatalf("guest HTTP: %q %v\nconsole:\n%s\nqemu.log:\n%s\n%s", body, err, b, q, ss)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ex, err := vm.Stop(ctx, StopOptions{Grace: 60 * time.Second})
	if err != nil || ex.Class != ExitGuestShutdown {
		b, _ := vm.Console()
		t.Fatalf("stop: %+v %v (want guest-shutdown through the power button); console:\n%s", ex, err, b)
	}
}

// TestAArch64UEFIDiskBoot boots the arm64 test disk (systemd-boot as the
// removable-media loader on a FAT disk) with AAVMF on pflash and no
// -kernel, from a qcow2 overlay, and stops it through the ACPI power button.
func TestAArch64UEFIDiskBoot(t *testing.T) {
	const code, vars = "/usr/share/AAVMF/AAVMF_CODE.fd", "/usr/share/AAVMF/AAVMF_VARS.fd"
	if _, err := os.Stat(code); err != nil {
		t.Fatalf("AAVMF not installed (hack/install-deps.sh installs qemu-efi-aarch64): %v", err)
	}
	img := testImageArch(t, "arm64")
	dir := newStateDir(t)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	overlay := filepath.Join(dir, "root.qcow2")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := CreateOverlay(ctx, filepath.Join(img, "disk.qcow2"), FormatQCOW2, overlay, 0); err != nil {
		t.Fatal(err)
	}
	spec := Spec{Name: "test-aavmf", Arch: ArchAArch64, CPUs: 1, MemoryMiB: 256,
		Firmware: FirmwareUEFI, UEFICode: code, UEFIVarsTemplate: vars,
		Disks:       []Disk{{Path: overlay, Format: FormatQCOW2}},
		AllowedDirs: []string{img, "/usr/share/AAVMF"}}
	start := time.Now()
	vm := startVM(t, spec, dir)
	waitBoot(t, vm)
	t.Logf("aarch64 TCG UEFI (AAVMF) disk boot to marker: %s", time.Since(start).Round(100*time.Millisecond))
	if b, _ := vm.Console(); !strings.Contains(string(b), "arch=aarch64") {
		t.Fatalf("console:\n%s", b)
	}
	if fi, err := os.Stat(filepath.Join(dir, UEFIVarsName)); err != nil || fi.Size() == 0 {
		t.Fatalf("private UEFI vars: %v", err)
	}
	ex, err := vm.Stop(ctx, StopOptions{Grace: 60 * time.Second})
	if err != nil || ex.Class != ExitGuestShutdown {
		b, _ := vm.Console()
		t.Fatalf("stop: %+v %v (want guest-shutdown through the ACPI power button); console:\n%s", ex, err, b)
	}
}
