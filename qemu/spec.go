package qemu

import (
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
)

// Firmware selects how the machine boots before the kernel.
type Firmware string

const (
	// FirmwareBIOS is SeaBIOS (QEMU's default firmware).
	FirmwareBIOS Firmware = "bios"
	// FirmwareUEFI is OVMF: Spec.UEFICode (read-only) and a private copy of
	// Spec.UEFIVarsTemplate in the state dir.
	FirmwareUEFI Firmware = "uefi"
)

// DiskFormat is a QEMU block format.
type DiskFormat string

const (
	FormatQCOW2 DiskFormat = "qcow2"
	FormatRaw   DiskFormat = "raw"
)

// Disk is one virtio block device.
type Disk struct {
	// Path to the image; must be inside Spec.AllowedDirs (or the state dir).
	Path     string
	Format   DiskFormat
	ReadOnly bool
	// Serial is visible to the guest (/dev/disk/by-id/virtio-<serial>);
	// optional, at most 20 characters of [A-Za-z0-9._-].
	Serial string
}

// PortForward forwards a host loopback TCP port to a guest TCP port through
// user-mode networking.
type PortForward struct {
	// HostPort on 127.0.0.1; 0 is not allowed here (use FreeLoopbackPort).
	HostPort  int
	GuestPort int
}

// Limits bound what a spec may ask for.
type Limits struct {
	MaxCPUs      int // default 64
	MaxMemoryMiB int // default 262144 (256 GiB)
	MinMemoryMiB int // default 32
}

// DefaultLimits are the limits a Spec with zero Limits gets.
func DefaultLimits() Limits { return Limits{}.withDefaults() }

func (l Limits) withDefaults() Limits {
	if l.MaxCPUs <= 0 {
		l.MaxCPUs = 64
	}
	if l.MaxMemoryMiB <= 0 {
		l.MaxMemoryMiB = 256 << 10
	}
	if l.MinMemoryMiB <= 0 {
		l.MinMemoryMiB = 32
	}
	return l
}

// Spec describes one VM. It is plain data: Validate checks it and Args turns
// it into a QEMU command line; nothing in it is passed to QEMU unchecked.
type Spec struct {
	// Name is a label for logs and QEMU's -name ([A-Za-z0-9._-], <= 63).
	Name string
	// Arch is the guest architecture, x86_64 (default) or aarch64. KVM
	// runs only the host's own architecture; other ones run under TCG.
	Arch Arch
	// QEMUBinary defaults to Arch.Binary() (qemu-system-<arch>).
	QEMUBinary string
	// Accelerator, normally from ProbeAccelerator. Defaults to TCG.
	Accelerator Accelerator
	// Machine is one of Arch.Machines(): q35 (x86_64 default), pc,
	// microvm; virt (aarch64, the only one).
	Machine string
	// CPUModel is QEMU's -cpu value (a model, optionally with feature
	// flags: "Haswell-v4", "max,la57=off"); "" picks the accelerator's
	// default, DefaultCPUModel. "host" needs KVM.
	CPUModel  string
	CPUs      int
	MemoryMiB int
	// Firmware defaults to BIOS.
	Firmware         Firmware
	UEFICode         string
	UEFIVarsTemplate string
	// BIOS is a firmware file loaded with -bios instead of QEMU's own
	// SeaBIOS (FirmwareBIOS only; "" for QEMU's).
	BIOS string

	// Direct kernel boot: Kernel (+ Initrd, Cmdline). When Kernel is empty
	// the firmware boots Disks[0].
	Kernel  string
	Initrd  string
	Cmdline string

	Disks []Disk

	// Network enables user-mode networking (virtio-net) with these forwards.
	Network  bool
	Forwards []PortForward

	// RunAs starts QEMU as this uid and gid (supplementary groups: the
	// group of /dev/kvm under KVM, when that group may use it) instead of
	// the caller's; nil: the caller's. Start hands the user what QEMU
	// opens and nothing more (handOver): the state dir is the caller's
	// with the user's group (mode 01770), the disks, firmware and kernel
	// files inside it the user's. Files outside the state dir are left as
	// they are and must be readable by the user, their directories
	// searchable: Start says which one is not. Not QEMU's -runas: with
	// QEMU 7.2 its late setuid is killed by -sandbox
	// elevateprivileges=deny, and starting unprivileged is stronger
	// anyway. The caller needs CAP_SETUID, CAP_SETGID and CAP_CHOWN, and
	// to reach QEMU's sockets and signal and renice it afterwards
	// CAP_DAC_OVERRIDE, CAP_KILL and CAP_SYS_NICE (root has them all).
	RunAs *User `json:",omitempty"`

	// AllowedDirs: every file the VM opens (kernel, initrd, disks, firmware)
	// must be inside one of them or inside the state dir. Empty means only
	// the state dir.
	AllowedDirs []string
	Limits      Limits

	// Memory tunes what the VM costs the host beyond the guest's RAM.
	Memory MemoryTuning

	// Nice is the nice value every QEMU thread (vCPUs included) runs its
	// guest at, 0 to 19. A positive value keeps busy guests from starving
	// the node agent, the API server and etcd on the same host: guests
	// compete with each other as before, but below the control path. Such
	// a VM is launched paused (-S) at the caller's priority and Start
	// lowers its threads before starting the vCPUs, so QEMU's own start-up
	// is not slowed by busy guests either. QEMU runs in the caller's
	// session, so thread nice values apply against the caller's threads
	// under scheduler autogroups too (lowerAutogroup). A node uses it
	// where its VMs get no CPU cgroup of lower weight (PlanCPUPlacement).
	Nice int

	// MAC is the NIC's MAC address (a locally administered unicast
	// address); empty derives one from Name. VMs restored from one saved
	// state must all use the MAC it was saved with (the NIC's state
	// carries it).
	MAC string

	// Incoming restores the VM from a state saved by VM.SaveState (memory
	// and device state) instead of booting it: QEMU starts with
	// -incoming fd:3 reading this file, and Start returns once the state
	// is loaded and the guest runs again. Every other field must describe
	// the same VM as the saved one (same Args but for Name, StateDir,
	// Forwards and disk paths), and its disks must hold what they held
	// when the state was saved. An unreadable or incompatible file fails
	// Start (QEMU exits during the load).
	Incoming string

	// Display gives the VM a graphics card (VGA on x86_64, virtio-gpu on
	// aarch64) and a VNC server on the unix socket VNCSocketName in the
	// state dir (no TCP listener; the dir's 0700 mode guards it).
	// Not with machine microvm.
	Display bool

	// ConsoleCapBytes bounds the kept console output (console.log plus
	// console.log.1); 0 means DefaultConsoleCap.
	ConsoleCapBytes int64

	// Cgroup, when set, runs QEMU in a cgroup of its own (cgroup.go)
	// instead of the caller's, with the VM's limits there.
	Cgroup *Cgroup

	// StateDir is the per-VM directory (0700) holding the QMP and console
	// sockets, console log, pidfile and exit record. Set by Start.
	StateDir string
}

// MemoryTuning is what the host pays for a VM beyond the guest RAM it
// touched: QEMU's own memory and guest memory the guest no longer uses.
// docs/qemu.md and docs/performance.md give the measured effect of each.
type MemoryTuning struct {
	// TCGTranslationBufferMiB sizes TCG's buffer of translated guest code
	// (-accel tcg,tb-size=N). 0 keeps QEMU's default (1 GiB, filled as code
	// is translated: about 50 MiB for an idle Linux guest); a small buffer
	// is flushed and refilled more often. Unused under KVM.
	TCGTranslationBufferMiB int
	// FreePageReporting adds a virtio-balloon device with
	// free-page-reporting=on: a guest whose kernel has the virtio_balloon
	// driver reports memory it freed and QEMU gives it back to the host. It
	// never takes memory the guest uses (no inflation).
	FreePageReporting bool
	// MemMerge marks guest RAM mergeable by the host's KSM
	// (-machine mem-merge=on); off (mem-merge=off) keeps KSM away from the
	// guest even when the host runs it. Merging only happens when the host
	// runs KSM (/sys/kernel/mm/ksm/run).
	MemMerge bool
}

// MaxNice is the largest Spec.Nice (Linux's lowest priority).
const MaxNice = 19

// MaxTCGTranslationBufferMiB bounds MemoryTuning.TCGTranslationBufferMiB.
const MaxTCGTranslationBufferMiB = 4096

// Files inside the state dir.
const (
	QMPSocketName     = "qmp.sock"
	ConsoleSocketName = "console.sock"
	ConsoleLogName    = "console.log"
	PidfileName       = "qemu.pid"
	QEMULogName       = "qemu.log"
	SpecFileName      = "spec.json"
	ExitFileName      = "exit.json"
	UEFIVarsName      = "uefi-vars.fd"
	// MigrateSocketName is the unix socket SaveState receives the state on.
	MigrateSocketName = "migrate.sock"
	// GuestAgentSocketName is the host end of the VM's qemu-guest-agent
	// channel (qga.go).
	GuestAgentSocketName = "qga.sock"
	// VNCSocketName is the VNC server of a VM with a display (Spec.Display).
	VNCSocketName = "vnc.sock"
)

// GuestAgentChannel is the virtio-serial port name qemu-guest-agent opens
// in the guest (/dev/virtio-ports/org.qemu.guest_agent.0).
const GuestAgentChannel = "org.qemu.guest_agent.0"

// maxSocketPath is sun_path's size minus the NUL.
const maxSocketPath = 107

var (
	nameRE   = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)
	serialRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,20}$`)
	// cpuModelRE: a model name, then comma-separated properties
	// (feature=on|off, +feature, -feature).
	cpuModelRE = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}(,[+-]?[A-Za-z0-9_][A-Za-z0-9._-]{0,63}(=[A-Za-z0-9._-]{1,63})?)*$`)
)

// MaxCPUModelLen bounds Spec.CPUModel.
const MaxCPUModelLen = 512

// ValidateCPUModel checks the form of a -cpu value (Spec.CPUModel): a
// model name, then comma-separated features (+f, -f, f=v). Whether QEMU
// knows the model is QEMU's to say; whether it fits the accelerator is
// Spec.Validate's.
func ValidateCPUModel(m string) error {
	if m == "" || len(m) > MaxCPUModelLen || !cpuModelRE.MatchString(m) {
		return fmt.Errorf("cpu model %q: want a QEMU CPU model, optionally with comma-separated features (e.g. max, Haswell-v4, max,la57=off), at most %d characters", m, MaxCPUModelLen)
	}
	return nil
}

// withDefaults fills the defaults Validate and Args assume.
func (s Spec) withDefaults() Spec {
	if s.Arch == "" {
		s.Arch = ArchX86_64
	}
	if s.QEMUBinary == "" {
		s.QEMUBinary = s.Arch.Binary()
	}
	if s.Accelerator == "" {
		s.Accelerator = AccelTCG
	}
	if s.Machine == "" {
		s.Machine = s.Arch.DefaultMachine()
	}
	if s.Firmware == "" {
		s.Firmware = FirmwareBIOS
	}
	for i := range s.Disks {
		if s.Disks[i].Format == "" {
			s.Disks[i].Format = FormatQCOW2
		}
	}
	s.Limits = s.Limits.withDefaults()
	return s
}

// Validate checks the spec and returns every problem found, each naming the
// field and why. It touches no files.
func (s Spec) Validate() error {
	c := &specCheck{s: s.withDefaults()}
	c.machine()
	c.dirs()
	c.boot()
	c.disks()
	c.network()
	c.limits()
	if c.s.Cgroup != nil {
		c.errs = append(c.errs, c.s.Cgroup.validate(c.s)...)
	}
	return errors.Join(c.errs...)
}

// specCheck collects what is wrong with a Spec (its defaults applied):
// each method checks one part, Validate joins the errors.
type specCheck struct {
	s    Spec
	errs []error
}

func (c *specCheck) bad(format string, a ...any) { c.errs = append(c.errs, fmt.Errorf(format, a...)) }

// path checks a file QEMU opens: absolute, no commas or newlines (QEMU's
// option syntax), inside the allowed dirs or the state dir.
func (c *specCheck) path(what, p string) {
	if p == "" {
		c.bad("%s: path is empty", what)
		return
	}
	if !filepath.IsAbs(p) {
		c.bad("%s %q: must be an absolute path", what, p)
		return
	}
	if strings.ContainsAny(p, ",\n") {
		c.bad("%s %q: commas and newlines are not allowed in paths", what, p)
		return
	}
	if !c.s.pathAllowed(p) {
		c.bad("%s %q: outside the allowed dirs %v and the state dir", what, p, c.s.AllowedDirs)
	}
}

// machine: name, architecture, accelerator, machine type, CPU model and
// size.
func (c *specCheck) machine() {
	s := c.s
	if !nameRE.MatchString(s.Name) {
		c.bad("name %q: must be 1-63 characters of [A-Za-z0-9._-] starting with a letter or digit", s.Name)
	}
	if !s.Arch.Valid() {
		c.bad("arch %q: want %q or %q", s.Arch, ArchX86_64, ArchAArch64)
	}
	switch s.Accelerator {
	case AccelKVM:
		if s.Arch.Valid() && !s.Arch.CanKVM() {
			c.bad("accelerator kvm: KVM cannot run %s guests on this %s host (use tcg)", s.Arch, HostArch())
		}
	case AccelTCG:
	default:
		c.bad("accelerator %q: want %q or %q", s.Accelerator, AccelKVM, AccelTCG)
	}
	if s.Arch.Valid() && !slices.Contains(s.Arch.Machines(), s.Machine) {
		c.bad("machine %q: not a %s machine (want %s)", s.Machine, s.Arch, strings.Join(s.Arch.Machines(), ", "))
	}
	if s.Display && s.Machine == "microvm" {
		c.bad("display: machine microvm has no graphics card (use q35 or pc)")
	}
	if s.Machine == "microvm" && s.Accelerator != AccelKVM {
		c.bad("machine microvm: needs accelerator kvm (under TCG the guest finds no reliable clock: no HPET/PM timer, PIT calibration fails)")
	}
	if m := s.CPUModel; m != "" {
		name, _, _ := strings.Cut(m, ",")
		if err := ValidateCPUModel(m); err != nil {
			c.bad("%v", err)
		} else if name == "host" && s.Accelerator != AccelKVM {
			c.bad("cpu model %q: host needs accelerator kvm (under %s pick a model, e.g. max)", m, s.Accelerator)
		}
	}
	if s.CPUs < 1 || s.CPUs > s.Limits.MaxCPUs {
		c.bad("cpus %d: must be between 1 and %d", s.CPUs, s.Limits.MaxCPUs)
	}
	if s.MemoryMiB < s.Limits.MinMemoryMiB || s.MemoryMiB > s.Limits.MaxMemoryMiB {
		c.bad("memory %d MiB: must be between %d and %d MiB", s.MemoryMiB, s.Limits.MinMemoryMiB, s.Limits.MaxMemoryMiB)
	}
}

// dirs: the state dir (its sockets' path length) and the allowed dirs.
func (c *specCheck) dirs() {
	s := c.s
	if s.StateDir == "" || !filepath.IsAbs(s.StateDir) {
		c.bad("state dir %q: must be an absolute path", s.StateDir)
	} else if l := len(filepath.Join(s.StateDir, ConsoleSocketName)); l > maxSocketPath {
		c.bad("state dir %q: too long for unix sockets (%d > %d bytes)", s.StateDir, l, maxSocketPath)
	} else if l := len(filepath.Join(s.StateDir, GuestAgentSocketName)); l > maxSocketPath {
		c.bad("state dir %q: too long for unix sockets (%d > %d bytes)", s.StateDir, l, maxSocketPath)
	}
	for i, d := range s.AllowedDirs {
		if !filepath.IsAbs(d) {
			c.bad("allowed dir [%d] %q: must be absolute", i, d)
		}
	}
}

// boot: the firmware and the kernel or disk the guest boots from.
func (c *specCheck) boot() {
	s := c.s
	switch s.Firmware {
	case FirmwareBIOS:
		if s.BIOS != "" {
			c.path("bios", s.BIOS)
		}
	case FirmwareUEFI:
		if s.BIOS != "" {
			c.bad("bios %q: only with firmware %q", s.BIOS, FirmwareBIOS)
		}
		if s.Machine == "microvm" {
			c.bad("firmware uefi: not supported with machine microvm")
		}
		c.path("uefi code", s.UEFICode)
		c.path("uefi vars template", s.UEFIVarsTemplate)
	default:
		c.bad("firmware %q: want %q or %q", s.Firmware, FirmwareBIOS, FirmwareUEFI)
	}
	if s.Kernel == "" {
		if s.Initrd != "" || s.Cmdline != "" {
			c.bad("initrd/cmdline given without a kernel")
		}
		if len(s.Disks) == 0 {
			c.bad("boot source: no kernel and no disk to boot from")
		}
		if s.Machine == "microvm" {
			c.bad("machine microvm: needs a kernel (no disk boot)")
		}
	} else {
		c.path("kernel", s.Kernel)
		if s.Initrd != "" {
			c.path("initrd", s.Initrd)
		}
		if strings.ContainsAny(s.Cmdline, "\n\x00") || len(s.Cmdline) > 4096 {
			c.bad("cmdline: must be one line of at most 4096 bytes")
		}
	}
}

// disks: each disk's file, format and serial, no file twice.
func (c *specCheck) disks() {
	s := c.s
	seenDisk := map[string]int{}
	for i, d := range s.Disks {
		what := fmt.Sprintf("disk[%d]", i)
		c.path(what, d.Path)
		if j, dup := seenDisk[d.Path]; dup {
			c.bad("%s %q: same file as disk[%d]", what, d.Path, j)
		}
		seenDisk[d.Path] = i
		switch d.Format {
		case FormatQCOW2, FormatRaw:
		default:
			c.bad("%s format %q: want qcow2 or raw", what, d.Format)
		}
		if d.Serial != "" && !serialRE.MatchString(d.Serial) {
			c.bad("%s serial %q: at most 20 characters of [A-Za-z0-9._-]", what, d.Serial)
		}
	}
}

// network: port forwards and the MAC.
func (c *specCheck) network() {
	s := c.s
	if len(s.Forwards) > 0 && !s.Network {
		c.bad("forwards: need network enabled")
	}
	hostPorts, guestPorts := map[int]int{}, map[int]int{}
	for i, f := range s.Forwards {
		what := fmt.Sprintf("forward[%d]", i)
		if f.HostPort < 1 || f.HostPort > 65535 {
			c.bad("%s host port %d: must be 1-65535", what, f.HostPort)
		}
		if f.GuestPort < 1 || f.GuestPort > 65535 {
			c.bad("%s guest port %d: must be 1-65535", what, f.GuestPort)
		}
		if j, dup := hostPorts[f.HostPort]; dup {
			c.bad("%s host port %d: collides with forward[%d]", what, f.HostPort, j)
		}
		if j, dup := guestPorts[f.GuestPort]; dup {
			c.bad("%s guest port %d: already forwarded by forward[%d]", what, f.GuestPort, j)
		}
		hostPorts[f.HostPort], guestPorts[f.GuestPort] = i, i
	}
	if s.MAC != "" {
		if hw, err := net.ParseMAC(s.MAC); err != nil || len(hw) != 6 || hw[0]&1 != 0 || hw[0]&2 == 0 || hw.String() != s.MAC {
			c.bad("mac %q: want a locally administered unicast MAC in lower case (e.g. 52:54:00:12:34:56)", s.MAC)
		} else if !s.Network {
			c.bad("mac: needs network enabled")
		}
	}
}

// limits: priority, translation buffer, incoming state, console cap and
// the user QEMU runs as.
func (c *specCheck) limits() {
	s := c.s
	if s.Nice < 0 || s.Nice > MaxNice {
		c.bad("nice %d: must be between 0 and %d (QEMU never runs above the agent's priority)", s.Nice, MaxNice)
	}
	if tb := s.Memory.TCGTranslationBufferMiB; tb < 0 || tb > MaxTCGTranslationBufferMiB {
		c.bad("memory tcg translation buffer %d MiB: must be 0 (QEMU's default) or between 1 and %d MiB", tb, MaxTCGTranslationBufferMiB)
	}
	if s.Incoming != "" {
		c.path("incoming state", s.Incoming)
	}
	if s.ConsoleCapBytes < 0 || (s.ConsoleCapBytes > 0 && s.ConsoleCapBytes < 64<<10) {
		c.bad("console cap %d bytes: must be 0 (default) or at least 64 KiB", s.ConsoleCapBytes)
	}
	if u := s.RunAs; u != nil && (u.UID > MaxID || u.GID > MaxID) {
		c.bad("run as uid %d gid %d: uid and gid must be at most %d", u.UID, u.GID, MaxID)
	}
}

func (s Spec) pathAllowed(p string) bool {
	p = filepath.Clean(p)
	dirs := append([]string{s.StateDir}, s.AllowedDirs...)
	for _, d := range dirs {
		if d == "" {
			continue
		}
		rel, err := filepath.Rel(filepath.Clean(d), p)
		if err == nil && rel != "." && rel != ".." && !strings.HasPrefix(rel, "../") {
			return true
		}
	}
	return false
}

// Path returns the path of a state-dir file (QMPSocketName etc.).
func (s Spec) Path(name string) string { return filepath.Join(s.StateDir, name) }

// sandboxArg confines QEMU with seccomp: no obsolete syscalls, no setuid
// after start, no fork/exec, no scheduler/affinity changes.
const sandboxArg = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"

// Args returns the QEMU argument list (without the binary) for a valid spec.
// It is pure: same spec, same arguments.
//
// Choices: -cpu from CPUModel or DefaultCPUModel; -nodefaults and no
// display; QMP and the serial console on unix sockets in the state dir,
// the console also written by QEMU to console.log (so it survives our
// restarts); pvpanic; guest shutdown and panic pause the
// VM instead of exiting (-action shutdown=pause,panic=pause) so the
// supervisor — or a later Adopt — can read why the guest stopped from QMP
// before quitting QEMU; user-mode networking with forwards bound to
// 127.0.0.1 only; the memory tuning (MemoryTuning) as configured, guest
// RAM not mergeable by KSM unless asked; a virtio-serial port named
// GuestAgentChannel on a unix socket in the state dir for qemu-guest-agent
// (always present, same device ids every time: a guest without the agent
// just never opens it, and a VM restored from a snapshot finds the same
// devices).
func Args(s Spec) []string {
	s = s.withDefaults()
	machine := s.Machine
	switch s.Machine {
	case "q35", "pc":
		machine += ",vmport=off"
	case "microvm":
		machine += ",acpi=on" // pit/pic stay: the kernel calibrates the TSC against the PIT under TCG
	case "virt":
		machine += ",gic-version=max" // GICv3 when TCG or the host has it: more than 8 vCPUs
	}
	if s.Memory.MemMerge {
		machine += ",mem-merge=on"
	} else {
		machine += ",mem-merge=off"
	}
	accel := string(s.Accelerator)
	if s.Accelerator == AccelTCG && s.Memory.TCGTranslationBufferMiB > 0 {
		accel += fmt.Sprintf(",tb-size=%d", s.Memory.TCGTranslationBufferMiB)
	}
	cpu := s.CPUModel
	if cpu == "" {
		cpu = DefaultCPUModel(s.Arch, s.Accelerator)
	}
	a := []string{
		"-name", "guest=" + s.Name + ",debug-threads=on",
		"-machine", machine,
		"-accel", accel,
		"-cpu", cpu,
		"-smp", fmt.Sprint(s.CPUs),
		"-m", fmt.Sprintf("%dM", s.MemoryMiB),
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-sandbox", sandboxArg,
		"-qmp", "unix:" + s.Path(QMPSocketName) + ",server=on,wait=off",
		"-chardev", "socket,id=console,path=" + s.Path(ConsoleSocketName) + ",server=on,wait=off,logfile=" + s.Path(ConsoleLogName) + ",logappend=on",
		"-serial", "chardev:console",
		"-action", "shutdown=pause,panic=pause,reboot=reset",
		"-pidfile", s.Path(PidfileName),
	}
	if s.Nice > 0 {
		a = append(a, "-S") // Start lowers the threads, then sends cont
	}
	if s.Display {
		gpu := "VGA"
		if s.Arch == ArchAArch64 {
			gpu = "virtio-gpu-pci"
		}
		a = append(a, "-vnc", "unix:"+s.Path(VNCSocketName), "-device", gpu)
	}
	switch s.Machine {
	case "microvm":
	case "virt":
		a = append(a, "-device", "pvpanic-pci") // no ISA bus on virt
	default:
		a = append(a, "-device", "pvpanic")
	}
	if s.Firmware == FirmwareBIOS && s.BIOS != "" {
		a = append(a, "-bios", s.BIOS)
	}
	if s.Firmware == FirmwareUEFI {
		a = append(a,
			"-drive", "if=pflash,format=raw,unit=0,readonly=on,file="+s.UEFICode,
			"-drive", "if=pflash,format=raw,unit=1,file="+s.Path(UEFIVarsName))
	}
	if s.Kernel != "" {
		a = append(a, "-kernel", s.Kernel)
		if s.Initrd != "" {
			a = append(a, "-initrd", s.Initrd)
		}
		if s.Cmdline != "" {
			a = append(a, "-append", s.Cmdline)
		}
	}
	pciSuffix := "-pci"
	if s.Machine == "microvm" {
		pciSuffix = "-device"
	}
	for i, d := range s.Disks {
		id := fmt.Sprintf("disk%d", i)
		drive := "file=" + d.Path + ",format=" + string(d.Format) + ",if=none,id=" + id + ",cache=writeback,discard=unmap"
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		dev := "virtio-blk" + pciSuffix + ",drive=" + id
		if d.Serial != "" {
			dev += ",serial=" + d.Serial
		}
		if s.Kernel == "" && i == 0 {
			dev += ",bootindex=0"
		}
		a = append(a, "-drive", drive, "-device", dev)
	}
	if s.Network {
		netdev := "user,id=net0"
		for _, f := range s.Forwards {
			netdev += fmt.Sprintf(",hostfwd=tcp:127.0.0.1:%d-:%d", f.HostPort, f.GuestPort)
		}
		mac := s.MAC
		if mac == "" {
			mac = macFor(s.Name)
		}
		a = append(a, "-netdev", netdev, "-device", "virtio-net"+pciSuffix+",netdev=net0,mac="+mac)
	}
	if s.Memory.FreePageReporting {
		a = append(a, "-device", "virtio-balloon"+pciSuffix+",free-page-reporting=on")
	}
	a = append(a,
		"-chardev", "socket,id=qga0,path="+s.Path(GuestAgentSocketName)+",server=on,wait=off",
		"-device", "virtio-serial"+pciSuffix+",id=vser0,max_ports=2",
		"-device", "virtserialport,bus=vser0.0,nr=1,chardev=qga0,name="+GuestAgentChannel)
	if s.Incoming != "" {
		a = append(a, "-incoming", fmt.Sprintf("fd:%d", IncomingFD))
	}
	return a
}

// DefaultCPUModel is the -cpu of a Spec of arch under accel that names no
// CPUModel. Under KVM the host's own CPU (host). Under TCG a model is
// emulated instruction by instruction, and each feature the guest kernel
// turns on can cost it at boot: on x86_64 x86-64-v2 without max's extras
// (tcgX86CPUModel); on aarch64 max with pointer authentication on QEMU's
// cheap implementation-defined algorithm instead of QARMA (QEMU's
// documented TCG speed-up).
func DefaultCPUModel(arch Arch, accel Accelerator) string {
	switch {
	case accel == AccelKVM:
		return "host"
	case arch == ArchAArch64:
		return "max,pauth-impdef=on"
	default:
		return tcgX86CPUModel
	}
}

// tcgX86CPUModel is the x86_64 TCG default CPU model: QEMU's own default
// (qemu64, AuthenticAMD: no Meltdown page-table isolation in the guest)
// raised to x86-64-v2 (SSSE3, SSE4.1, SSE4.2, POPCNT; CX16 and LAHF are
// qemu64's), the level current enterprise userlands require. max (AVX2
// and the rest of x86-64-v3, SMAP, SMEP, PKU, LA57, RDRAND, ...) cost the
// test image's boot about 7% more CPU (0.2 s; bench/history.md, issue 42):
// a guest that needs them asks for max (Spec.CPUModel: a pod's
// qemu-kubelet.io/cpu-model annotation, or the node's cpuModel.tcg).
const tcgX86CPUModel = "qemu64,+ssse3,+sse4.1,+sse4.2,+popcnt"

// IncomingFD is the descriptor Start hands Spec.Incoming to QEMU on (the
// first of exec.Cmd.ExtraFiles).
const IncomingFD = 3

// macFor derives a stable locally administered MAC from the VM name.
func macFor(name string) string {
	var h uint32 = 2166136261
	for i := 0; i < len(name); i++ {
		h ^= uint32(name[i])
		h *= 16777619
	}
	hw := net.HardwareAddr{0x52, 0x54, 0x00, byte(h >> 16), byte(h >> 8), byte(h)}
	return hw.String()
}
