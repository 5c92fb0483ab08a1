package qemu

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

func baseSpec() Spec {
	return Spec{
		Name:        "vm1",
		CPUs:        2,
		MemoryMiB:   512,
		Kernel:      "/images/vmlinuz",
		Initrd:      "/images/initrd.gz",
		Cmdline:     "console=ttyS0 quiet",
		AllowedDirs: []string{"/images"},
		StateDir:    "/run/qk/vm1",
	}
}

func TestArgsGolden(t *testing.T) {
	cases := map[string]func(*Spec){
		"kernel-tcg": func(*Spec) {},
		"kernel-kvm-net": func(s *Spec) {
			s.Accelerator = AccelKVM
			s.Network = true
			s.Forwards = []PortForward{{HostPort: 20080, GuestPort: 8080}, {HostPort: 20022, GuestPort: 22}}
			s.RunAs = &User{UID: 65534, GID: 65534}
		},
		"disk-uefi": func(s *Spec) {
			s.Kernel, s.Initrd, s.Cmdline = "", "", ""
			s.Firmware = FirmwareUEFI
			s.UEFICode = "/images/OVMF_CODE.fd"
			s.UEFIVarsTemplate = "/images/OVMF_VARS.fd"
			s.Disks = []Disk{
				{Path: "/run/qk/vm1/root.qcow2", Serial: "root"},
				{Path: "/images/config.img", Format: FormatRaw, ReadOnly: true, Serial: "cidata"},
			}
		},
		"disk-bios-file": func(s *Spec) {
			s.Kernel, s.Initrd, s.Cmdline = "", "", ""
			s.BIOS = "/run/qk/vm1/flash/bios-0123456789ab"
			s.Disks = []Disk{{Path: "/run/qk/vm1/root.qcow2", Serial: "root"}}
		},
		"kernel-tcg-memory-tuned": func(s *Spec) {
			s.Network = true
			s.Memory = MemoryTuning{TCGTranslationBufferMiB: 32, FreePageReporting: true, MemMerge: true}
		},
		"microvm": func(s *Spec) {
			s.Machine = "microvm"
			s.Accelerator = AccelKVM
			s.Network = true
		},
	}
	for name, mut := range cases {
		t.Run(name, func(t *testing.T) {
			s := baseSpec()
			mut(&s)
			checkGolden(t, name, s)
			// Invariants every command line must hold.
			joined := strings.Join(Args(s), " ")
			sandbox := "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
			for _, must := range []string{"-nodefaults", sandbox, "-qmp unix:/run/qk/vm1/qmp.sock", "logfile=/run/qk/vm1/console.log"} {
				if !strings.Contains(joined, must) {
					t.Errorf("missing %q", must)
				}
			}
			if strings.Contains(joined, "hostfwd=tcp::") || strings.Contains(joined, "hostfwd=tcp:0.0.0.0") {
				t.Errorf("forward not bound to loopback: %s", joined)
			}
		})
	}
}

// checkGolden validates s and compares Args(s) with testdata/<name>.golden
// (rewritten with -update).
func checkGolden(t *testing.T, name string, s Spec) {
	t.Helper()
	if err := s.Validate(); err != nil {
		t.Fatalf("golden spec invalid: %v", err)
	}
	got := strings.Join(Args(s), "\n") + "\n"
	path := filepath.Join("testdata", name+".golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("read golden (run with -update to create): %v", err)
	}
	if got != string(want) {
		t.Errorf("args differ from %s (run go test -run 'TestArgs' -update after checking):\n got:\n%s\nwant:\n%s", path, got, want)
	}
}

func TestValidateRejects(t *testing.T) {
	cases := []struct {
		name string
		mut  func(*Spec)
		want string
	}{
		{"zero cpus", func(s *Spec) { s.CPUs = 0 }, "cpus 0"},
		{"too many cpus", func(s *Spec) { s.CPUs = 1000 }, "cpus 1000"},
		{"absurd memory", func(s *Spec) { s.MemoryMiB = 1 << 30 }, "memory 1073741824 MiB"},
		{"tiny memory", func(s *Spec) { s.MemoryMiB = 1 }, "memory 1 MiB"},
		{"missing kernel and disk", func(s *Spec) { s.Kernel, s.Initrd, s.Cmdline = "", "", "" }, "no kernel and no disk"},
		{"initrd without kernel", func(s *Spec) { s.Kernel = ""; s.Disks = []Disk{{Path: "/images/a.qcow2"}} }, "without a kernel"},
		{"kernel outside allowed", func(s *Spec) { s.Kernel = "/etc/shadow" }, `kernel "/etc/shadow": outside the allowed dirs`},
		{"disk traversal", func(s *Spec) { s.Disks = []Disk{{Path: "/images/../etc/passwd"}} }, "outside the allowed dirs"},
		{"disk prefix trick", func(s *Spec) { s.Disks = []Disk{{Path: "/images-evil/x.qcow2"}} }, "outside the allowed dirs"},
		{"relative disk", func(s *Spec) { s.Disks = []Disk{{Path: "x.qcow2"}} }, "must be an absolute path"},
		{"comma in path", func(s *Spec) { s.Disks = []Disk{{Path: "/images/a,format=raw"}} }, "commas"},
		{"same disk twice", func(s *Spec) {
			s.Disks = []Disk{{Path: "/images/a.qcow2"}, {Path: "/images/a.qcow2"}}
		}, "same file as disk[0]"},
		{"bios outside allowed", func(s *Spec) { s.BIOS = "/etc/shadow" }, `bios "/etc/shadow": outside the allowed dirs`},
		{"bios with uefi", func(s *Spec) {
			s.Firmware, s.UEFICode, s.UEFIVarsTemplate, s.BIOS = FirmwareUEFI, "/images/c.fd", "/images/v.fd", "/images/bios.bin"
		}, "only with firmware"},
		{"bad format", func(s *Spec) { s.Disks = []Disk{{Path: "/images/a", Format: "vmdk"}} }, `format "vmdk"`},
		{"host port collision", func(s *Spec) {
			s.Network = true
			s.Forwards = []PortForward{{HostPort: 2000, GuestPort: 80}, {HostPort: 2000, GuestPort: 81}}
		}, "host port 2000: collides with forward[0]"},
		{"guest port twice", func(s *Spec) {
			s.Network = true
			s.Forwards = []PortForward{{HostPort: 2000, GuestPort: 80}, {HostPort: 2001, GuestPort: 80}}
		}, "guest port 80: already forwarded"},
		{"port out of range", func(s *Spec) { s.Network = true; s.Forwards = []PortForward{{HostPort: 70000, GuestPort: 80}} }, "host port 70000"},
		{"forward without network", func(s *Spec) { s.Forwards = []PortForward{{HostPort: 2000, GuestPort: 80}} }, "need network"},
		{"bad name", func(s *Spec) { s.Name = "a b;rm" }, "name"},
		{"multicast mac", func(s *Spec) { s.Network = true; s.MAC = "53:54:00:12:34:56" }, `mac "53:54:00:12:34:56"`},
		{"global mac", func(s *Spec) { s.Network = true; s.MAC = "00:54:00:12:34:56" }, "locally administered"},
		{"upper-case mac", func(s *Spec) { s.Network = true; s.MAC = "52:54:00:AB:34:56" }, "lower case"},
		{"mac without network", func(s *Spec) { s.MAC = "52:54:00:12:34:56" }, "mac: needs network"},
		{"incoming outside allowed", func(s *Spec) { s.Incoming = "/etc/state" }, `incoming state "/etc/state": outside the allowed dirs`},
		{"arch", func(s *Spec) { s.Arch = "riscv64" }, `arch "riscv64"`},
		{"machine", func(s *Spec) { s.Machine = "isapc" }, `machine "isapc"`},
		{"microvm under tcg", func(s *Spec) { s.Machine = "microvm" }, "machine microvm: needs accelerator kvm"},
		{"cmdline newline", func(s *Spec) { s.Cmdline = "a\nb" }, "cmdline"},
		{"relative state dir", func(s *Spec) { s.StateDir = "state" }, "state dir"},
		{"long state dir", func(s *Spec) { s.StateDir = "/" + strings.Repeat("x", 120) }, "too long for unix sockets"},
		{"console cap too small", func(s *Spec) { s.ConsoleCapBytes = 10 }, "console cap 10 bytes"},
		{"uid -1", func(s *Spec) { s.RunAs = &User{UID: 1<<32 - 1, GID: 107} }, "run as uid 4294967295 gid 107: uid and gid must be at most 4294967294"},
		{"negative nice", func(s *Spec) { s.Nice = -5 }, "nice -5: must be between 0 and 19"},
		{"nice out of range", func(s *Spec) { s.Nice = 20 }, "nice 20: must be between 0 and 19"},
		{"negative tb size", func(s *Spec) { s.Memory.TCGTranslationBufferMiB = -1 }, "memory tcg translation buffer -1 MiB"},
		{"huge tb size", func(s *Spec) { s.Memory.TCGTranslationBufferMiB = 1 << 20 }, "memory tcg translation buffer 1048576 MiB"},
		{"uefi without code", func(s *Spec) { s.Firmware = FirmwareUEFI }, "uefi code: path is empty"},
		{"cpu model with a space", func(s *Spec) { s.CPUModel = "max -device x" }, `cpu model "max -device x": want a QEMU CPU model`},
		{"cpu model option injection", func(s *Spec) { s.CPUModel = "max,,x" }, `cpu model "max,,x"`},
		{"cpu model bare plus", func(s *Spec) { s.CPUModel = "max,+" }, `cpu model "max,+"`},
		{"cpu model too long", func(s *Spec) { s.CPUModel = "max" + strings.Repeat(",a=on", 120) }, "at most 512 characters"},
		{"cpu host under tcg", func(s *Spec) { s.CPUModel = "host,pmu=off" }, `cpu model "host,pmu=off": host needs accelerator kvm`},
		{"display on microvm", func(s *Spec) { s.Machine, s.Accelerator, s.Display = "microvm", AccelKVM, true }, "display: machine microvm has no graphics card"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := baseSpec()
			tc.mut(&s)
			err := s.Validate()
			if err == nil {
				t.Fatalf("want error containing %q, got nil", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
	if err := baseSpec().Validate(); err != nil {
		t.Fatalf("base spec: %v", err)
	}
	// Several problems are all reported.
	s := baseSpec()
	s.CPUs, s.MemoryMiB = 0, 0
	if err := s.Validate(); err == nil || !strings.Contains(err.Error(), "cpus") || !strings.Contains(err.Error(), "memory") {
		t.Fatalf("want both cpu and memory errors, got %v", err)
	}
}

// TestArgsMemoryTuning: each memory knob reaches the command line as
// configured, and only where it applies (tb-size is a TCG option).
func TestArgsMemoryTuning(t *testing.T) {
	arg := func(args []string, flag string) []string {
		var out []string
		for i := 0; i+1 < len(args); i++ {
			if args[i] == flag {
				out = append(out, args[i+1])
			}
		}
		return out
	}
	cases := []struct {
		name    string
		mut     func(*Spec)
		machine string
		accel   string
		balloon []string
	}{
		{"defaults", func(*Spec) {}, "q35,vmport=off,mem-merge=off", "tcg", nil},
		{"tb-size under tcg", func(s *Spec) { s.Memory.TCGTranslationBufferMiB = 32 }, "q35,vmport=off,mem-merge=off", "tcg,tb-size=32", nil},
		{"tb-size ignored under kvm", func(s *Spec) {
			s.Accelerator = AccelKVM
			s.Memory.TCGTranslationBufferMiB = 32
		}, "q35,vmport=off,mem-merge=off", "kvm", nil},
		{"free page reporting", func(s *Spec) { s.Memory.FreePageReporting = true }, "q35,vmport=off,mem-merge=off", "tcg",
			[]string{"virtio-balloon-pci,free-page-reporting=on"}},
		{"mem-merge", func(s *Spec) { s.Memory.MemMerge = true }, "q35,vmport=off,mem-merge=on", "tcg", nil},
		{"microvm balloon on virtio-mmio", func(s *Spec) {
			s.Machine, s.Accelerator = "microvm", AccelKVM
			s.Memory = MemoryTuning{FreePageReporting: true, MemMerge: true}
		}, "microvm,acpi=on,mem-merge=on", "kvm", []string{"virtio-balloon-device,free-page-reporting=on"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := baseSpec()
			tc.mut(&s)
			if err := s.Validate(); err != nil {
				t.Fatal(err)
			}
			a := Args(s)
			if got := arg(a, "-machine"); len(got) != 1 || got[0] != tc.machine {
				t.Errorf("-machine %v, want [%s]", got, tc.machine)
			}
			if got := arg(a, "-accel"); len(got) != 1 || got[0] != tc.accel {
				t.Errorf("-accel %v, want [%s]", got, tc.accel)
			}
			var balloon []string
			for _, d := range arg(a, "-device") {
				if strings.HasPrefix(d, "virtio-balloon") {
					balloon = append(balloon, d)
				}
			}
			if strings.Join(balloon, " ") != strings.Join(tc.balloon, " ") {
				t.Errorf("balloon devices %v, want %v", balloon, tc.balloon)
			}
		})
	}
}

func TestArgsMACAndIncoming(t *testing.T) {
	s := baseSpec()
	s.Network = true
	s.MAC = "52:54:00:ab:cd:ef"
	s.Incoming = "/images/snap/state"
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	a := strings.Join(Args(s), " ")
	if !strings.Contains(a, "virtio-net-pci,netdev=net0,mac=52:54:00:ab:cd:ef") {
		t.Errorf("MAC not used: %s", a)
	}
	if !strings.HasSuffix(a, " -incoming fd:3") {
		t.Errorf("no -incoming fd:3 at the end: %s", a)
	}
	s.MAC, s.Incoming = "", ""
	a = strings.Join(Args(s), " ")
	if !strings.Contains(a, "mac="+macFor("vm1")) || strings.Contains(a, "-incoming") {
		t.Errorf("default MAC / no incoming expected: %s", a)
	}
}

// TestArgsDisplay: a display is a graphics card and a VNC server on a unix
// socket in the state dir, never a TCP listener; without one, none.
func TestArgsDisplay(t *testing.T) {
	s := baseSpec()
	a := strings.Join(Args(s), " ")
	if strings.Contains(a, "-vnc") || strings.Contains(a, "VGA") {
		t.Fatalf("no display asked, got one: %s", a)
	}
	s.Display = true
	if err := s.Validate(); err != nil {
		t.Fatal(err)
	}
	a = strings.Join(Args(s), " ")
	if !strings.Contains(a, "-vnc unix:"+s.Path(VNCSocketName)+" -device VGA") {
		t.Errorf("x86_64 display: want a VGA card and VNC on %s: %s", s.Path(VNCSocketName), a)
	}
	s.Arch, s.Machine = ArchAArch64, "virt"
	a = strings.Join(Args(s), " ")
	if !strings.Contains(a, "-device virtio-gpu-pci") {
		t.Errorf("aarch64 display: want virtio-gpu-pci: %s", a)
	}
}

// TestArgsCPUModel: -cpu is the spec's CPUModel when set, else the
// accelerator's and architecture's default (DefaultCPUModel).
func TestArgsCPUModel(t *testing.T) {
	cases := []struct {
		name  string
		arch  Arch
		accel Accelerator
		model string
		want  string
	}{
		{"tcg x86_64 default", ArchX86_64, AccelTCG, "", tcgX86CPUModel},
		{"kvm default", HostArch(), AccelKVM, "", "host"},
		{"tcg aarch64 default", ArchAArch64, AccelTCG, "", "max,pauth-impdef=on"},
		{"tcg x86_64 asked for max", ArchX86_64, AccelTCG, "max", "max"},
		{"tcg x86_64 named model with features", ArchX86_64, AccelTCG, "Haswell-v4,-hle,+pcid,la57=off", "Haswell-v4,-hle,+pcid,la57=off"},
		{"kvm asked for a model", HostArch(), AccelKVM, "EPYC-v4", "EPYC-v4"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := baseSpec()
			s.Arch, s.Accelerator, s.CPUModel = tc.arch, tc.accel, tc.model
			if tc.arch == ArchAArch64 {
				s.Machine = "virt"
			}
			if err := s.Validate(); err != nil {
				t.Fatal(err)
			}
			if got := argOf(Args(s), "-cpu"); len(got) != 1 || got[0] != tc.want {
				t.Errorf("-cpu %v, want [%s]", got, tc.want)
			}
		})
	}
}

// argOf returns the values given to flag in args, in order.
func argOf(args []string, flag string) []string {
	var out []string
	for i := 0; i+1 < len(args); i++ {
		if args[i] == flag {
			out = append(out, args[i+1])
		}
	}
	return out
}
