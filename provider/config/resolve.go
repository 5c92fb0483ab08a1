package config

import (
	"fmt"
	"maps"
	"math"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Defaults of the optional fields.
const (
	DefaultStateDir                                 = "/var/lib/qemu-kubelet"
	DefaultMaxVMs                                   = 20
	DefaultAcceleratorPolicy                        = PolicyPreferKVM
	DefaultProbeTimeout                             = "30s"
	DefaultServerAddress                            = "0.0.0.0"
	DefaultServerPort                               = 10250
	DefaultNodeStatusUpdateFrequency                = "10s"
	DefaultNodeLeaseDurationSeconds                 = 40
	DefaultKubeAPIQPS                               = 50
	DefaultKubeAPIBurst                             = 100
	DefaultEventRecordQPS                           = 50
	DefaultEventBurst                               = 100
	DefaultPodSyncWorkers                           = 10
	DefaultVMNice                                   = 10
	DefaultMemoryAvailable           QuantityString = "100Mi"
	DefaultDiskAvailable             QuantityString = "10%"
	DefaultPIDAvailable              QuantityString = "5%"
	// DefaultVMOverhead is QEMU's own memory per VM counted by admission:
	// measured 89 MiB (TCG, tcgTranslationBuffer 32Mi) to 109 MiB (QEMU's
	// default buffer) of RSS beyond a fully touched 96 MiB guest, plus
	// margin (docs/performance.md). The chart's RuntimeClass overhead is
	// the same.
	DefaultVMOverhead QuantityString = "128Mi"
	// DefaultVMIdleCost is the host memory of one idle test-image VM with
	// the default knobs (docs/performance.md), the divisor of DeriveMaxVMs.
	DefaultVMIdleCost QuantityString = "160Mi"
	// DefaultTCGTranslationBuffer: 32 MiB took 20 MiB off each VM at the
	// same boot time (docs/performance.md).
	DefaultTCGTranslationBuffer QuantityString = "32Mi"
	DefaultFreePageReporting                   = true
	DefaultPageMerging                         = false
	DefaultEnableKSM                           = false
	// DefaultTransparentHugePages: under TCG huge pages do not speed the
	// guest (QEMU's software TLB maps 4 KiB pages) and khugepaged fills
	// again what free page reporting returned (bench/history.md, issue
	// #42); under KVM the guest's speed depends on them.
	DefaultTransparentHugePages = THPAuto
	// ProviderTaintKey is the key of the default taint.
	ProviderTaintKey = "virtual-kubelet.io/provider"
)

// DefaultEmulatedKernelArgs: what an idle emulated x86-64 guest wakes up
// for, cut (provider.EmulatedKernelCmdline; docs/performance.md, "CPU of
// an idle VM").
var DefaultEmulatedKernelArgs = []string{"tsc=reliable", "sysctl.vm.compaction_proactiveness=0"}

// badKernelArg says why a is not one kernel command-line argument ("" when
// it is).
func badKernelArg(a string) string {
	switch {
	case a == "":
		return "must not be empty"
	case a == "--":
		return `must not be "--" (what follows it goes to init)`
	case len(a) > 256:
		return "longer than 256 characters"
	case strings.ContainsFunc(a, func(r rune) bool { return r <= ' ' || r == '"' || r == 0x7f }):
		return "one argument: no spaces, quotes or control characters"
	}
	return ""
}

// DefaultReserved is what is held back from capacity when reserved is absent.
var DefaultReserved = map[string]QuantityString{"cpu": "0", "memory": "512Mi", "ephemeral-storage": "1Gi"}

// DefaultTaints is the taint list registered when taints is absent.
func DefaultTaints() []corev1.Taint {
	return []corev1.Taint{{Key: ProviderTaintKey, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}}
}

// DefaultQEMUBinary is the qemu-system binary for the host architecture.
func DefaultQEMUBinary() string {
	switch runtime.GOARCH {
	case "arm64":
		return "qemu-system-aarch64"
	default:
		return "qemu-system-x86_64"
	}
}

// Environment carries the host facts defaults are derived from, so that
// defaulting stays a pure function.
type Environment struct {
	// Hostname of the machine (default node name).
	Hostname string
	// HostIP is the default InternalIP.
	HostIP string
	// FileExists tells whether a firmware file exists (nil: os.Stat).
	FileExists func(path string) bool
	// MemoryTotal is the host's memory in bytes (/proc/meminfo MemTotal);
	// maxVMs is derived from it when the file sets none. 0: unknown, the
	// fixed DefaultMaxVMs is used.
	MemoryTotal int64
	// HostArch is the host's architecture as Go names it (default
	// runtime.GOARCH).
	HostArch string
	// AgentUID and AgentGID are the agent's effective uid and gid (0:
	// root), which vmUser's default follows.
	AgentUID, AgentGID uint32
}

// DefaultOVMF are the OVMF code/vars pairs looked for, in order, when the
// configuration names none: where Debian's ovmf package installs them.
var DefaultOVMF = [][2]string{
	{"/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd"},
	{"/usr/share/OVMF/OVMF_CODE.fd", "/usr/share/OVMF/OVMF_VARS.fd"},
}

func (e Environment) exists(p string) bool {
	if e.FileExists != nil {
		return e.FileExists(p)
	}
	_, err := os.Stat(p)
	return err == nil
}

// Node is the resolved, validated configuration: plain data with parsed
// quantities and durations.
type Node struct {
	NodeName   string
	NodeIP     string
	Hostname   string
	StateDir   string
	QEMUBinary string
	// UEFICode and UEFIVars are the OVMF files ("": UEFI pods refused).
	UEFICode, UEFIVars string
	MaxVMs             int32
	// MaxVMsReason says where MaxVMs comes from (the file, or how it was
	// derived from the host), for the node's annotation.
	MaxVMsReason      string
	Reserved          corev1.ResourceList
	CPUOvercommit     float64
	MemoryOvercommit  float64
	AcceleratorPolicy string
	ProbeTimeout      time.Duration
	Taints            []corev1.Taint
	Labels            map[string]string
	ListenAddress     string
	Port              int32
	TLSCertFile       string
	TLSKeyFile        string
	ClientCAFile      string
	// StatusUpdateFrequency is the period of host readings / status pushes.
	StatusUpdateFrequency time.Duration
	// LeaseDuration of the node lease; renewed every LeaseDuration/4.
	LeaseDuration time.Duration
	// KubeAPIQPS/KubeAPIBurst: the node's API client budget; EventRecordQPS/
	// EventBurst: the events client's.
	KubeAPIQPS     float32
	KubeAPIBurst   int
	EventRecordQPS float32
	EventBurst     int
	// PodSyncWorkers: workers of each pod controller queue.
	PodSyncWorkers int
	// VMNice: the nice value of every QEMU.
	VMNice int
	// EmulatedKernelArgs: added to directly booted x86-64 TCG guests'
	// kernel command lines.
	EmulatedKernelArgs []string
	MemoryAvailable    Threshold
	DiskAvailable      Threshold
	PIDAvailable       Threshold
	// CPUModels: the -cpu of pods that name none, by accelerator (absent:
	// qemu.DefaultCPUModel). Empty on guest-architecture nodes.
	CPUModels map[qemu.Accelerator]string
	// Images is the image cache configuration.
	Images ImageCache
	// VMMemory is the resolved vmMemory section.
	VMMemory VMMemoryConfig
	// VMCgroup is the resolved vmCgroup section.
	VMCgroup VMCgroupConfig
	// VMUser is the uid and gid every QEMU runs as.
	VMUser VMUserConfig
	// Leases is the resolved jumpstarter section.
	Leases LeasesConfig

	// GuestArch is the architecture of the node's guests, as Kubernetes
	// names it (amd64, arm64): its kubernetes.io/arch label.
	GuestArch string
	// CapacityShare is the fraction of the host's cpu, memory and
	// ephemeral-storage capacity the node reports (1 without guest
	// architectures).
	CapacityShare float64
	// GuestArchitectures are the derived nodes of the guestArchitectures
	// entries (main node only): each a copy of this Node with its own
	// name, state dir, port, capacity, binary and firmware.
	GuestArchitectures []*Node
	// Kubeconfig is a guest-architecture node's own credentials ("": the
	// agent's).
	Kubeconfig string
	// Features is the features section as resolved from the file (a
	// reload swaps in a new one elsewhere: this stays the start's).
	Features *FeatureConfig
	// File is the defaulted file this Node was resolved from (reload
	// planning compares it field by field).
	File *NodeConfiguration
}

// VMMemoryConfig is the resolved vmMemory section.
type VMMemoryConfig struct {
	// Overhead is QEMU's own memory per VM, in bytes (admission).
	Overhead int64
	// IdleCost is the host memory of an idle VM, in bytes (maxVMs).
	IdleCost int64
	// TCGTranslationBufferMiB is QEMU's tb-size (0: QEMU's default).
	TCGTranslationBufferMiB int
	FreePageReporting       bool
	PageMerging             bool
	EnableKSM               bool
	// KSMPagesToScan: written to the kernel's pages_to_scan with
	// EnableKSM; 0 leaves the kernel's rate.
	KSMPagesToScan int
	// TransparentHugePages: THPAuto, THPEnabled or THPDisabled.
	TransparentHugePages string
}

// Default fills the absent fields of c (in place) with their defaults.
func Default(c *NodeConfiguration, env Environment) {
	if c.NodeName == "" {
		c.NodeName = strings.ToLower(env.Hostname)
	}
	if c.NodeIP == "" {
		c.NodeIP = env.HostIP
		if c.NodeIP == "" {
			c.NodeIP = "127.0.0.1"
		}
	}
	if c.StateDir == "" {
		c.StateDir = DefaultStateDir
	}
	if c.QEMUBinary == "" {
		c.QEMUBinary = DefaultQEMUBinary()
	}
	if c.Firmware.UEFICode == "" && c.Firmware.UEFIVars == "" {
		c.Firmware.UEFICode, c.Firmware.UEFIVars = env.firstFirmware(env.hostArch())
	}
	if c.Reserved == nil {
		c.Reserved = maps.Clone(DefaultReserved)
	}
	one := 1.0
	if c.Overcommit.CPU == nil {
		c.Overcommit.CPU = &one
	}
	if c.Overcommit.Memory == nil {
		c.Overcommit.Memory = &one
	}
	if c.Accelerator.Policy == "" {
		c.Accelerator.Policy = DefaultAcceleratorPolicy
	}
	if c.Accelerator.ProbeTimeout == "" {
		c.Accelerator.ProbeTimeout = DefaultProbeTimeout
	}
	if c.Taints == nil {
		c.Taints = DefaultTaints()
	}
	if c.Server.Address == "" {
		c.Server.Address = DefaultServerAddress
	}
	if c.Server.Port == nil {
		p := int32(DefaultServerPort)
		c.Server.Port = &p
	}
	if c.NodeStatusUpdateFrequency == "" {
		c.NodeStatusUpdateFrequency = DefaultNodeStatusUpdateFrequency
	}
	if c.NodeLeaseDurationSeconds == nil {
		v := int32(DefaultNodeLeaseDurationSeconds)
		c.NodeLeaseDurationSeconds = &v
	}
	defaultInt32(&c.KubeAPIQPS, DefaultKubeAPIQPS)
	defaultInt32(&c.KubeAPIBurst, DefaultKubeAPIBurst)
	defaultInt32(&c.EventRecordQPS, DefaultEventRecordQPS)
	defaultInt32(&c.EventBurst, DefaultEventBurst)
	defaultInt32(&c.PodSyncWorkers, DefaultPodSyncWorkers)
	defaultInt32(&c.VMNice, DefaultVMNice)
	if c.EmulatedKernelArgs == nil {
		args := append([]string(nil), DefaultEmulatedKernelArgs...)
		c.EmulatedKernelArgs = &args
	}
	if c.Pressure.MemoryAvailable == "" {
		c.Pressure.MemoryAvailable = DefaultMemoryAvailable
	}
	if c.Pressure.DiskAvailable == "" {
		c.Pressure.DiskAvailable = DefaultDiskAvailable
	}
	if c.Pressure.PIDAvailable == "" {
		c.Pressure.PIDAvailable = DefaultPIDAvailable
	}
	defaultImages(&c.Images)
	vm := &c.VMMemory
	if vm.Overhead == "" {
		vm.Overhead = DefaultVMOverhead
	}
	if vm.IdleCost == "" {
		vm.IdleCost = DefaultVMIdleCost
	}
	if vm.TCGTranslationBuffer == "" {
		vm.TCGTranslationBuffer = DefaultTCGTranslationBuffer
	}
	defaultBool(&vm.FreePageReporting, DefaultFreePageReporting)
	defaultBool(&vm.PageMerging, DefaultPageMerging)
	defaultBool(&vm.EnableKSM, DefaultEnableKSM)
	if vm.TransparentHugePages == "" {
		vm.TransparentHugePages = DefaultTransparentHugePages
	}
	defaultVMCgroup(&c.VMCgroup)
	defaultVMUser(&c.VMUser, env)
	defaultGuestArchitectures(c, env)
	defaultFeatures(&c.Features)
	defaultLeases(&c.Jumpstarter)
}
func defaultBool(p **bool, v bool) {
	if *p == nil {
		*p = &v
	}
}

// Resolve defaults a copy of c, validates it and returns the parsed Node.
// The error lists every invalid field with its path, one per line.
func Resolve(c *NodeConfiguration, env Environment) (*Node, error) {
	cc := *c
	cc.Reserved = maps.Clone(c.Reserved)
	cc.Labels = maps.Clone(c.Labels)
	cc.Taints = slices.Clone(c.Taints)
	cc.GuestArchitectures = slices.Clone(c.GuestArchitectures)
	Default(&cc, env)
	n, errs := validate(&cc, env)
	n.Leases, errs = validateLeases(cc.Jumpstarter, errs) // leases.go
	n.GuestArch = env.hostArch()
	errs = validateGuestArchitectures(&cc, n, env.hostArch(), errs)
	if len(errs) > 0 {
		lines := make([]string, 0, len(errs))
		for _, e := range errs {
			lines = append(lines, e.Error())
		}
		return nil, fmt.Errorf("invalid configuration:\n  %s", strings.Join(lines, "\n  "))
	}
	n.File = &cc
	n.Hostname = env.Hostname
	if n.Hostname == "" {
		n.Hostname = n.NodeName
	}
	for _, g := range n.GuestArchitectures {
		g.Hostname = n.Hostname
	}
	return n, nil
}

// MaxVMsInput are the host facts and settings maxVMs is derived from.
type MaxVMsInput struct {
	// MemoryTotal of the host in bytes (0: unknown).
	MemoryTotal int64
	// ReservedMemory is reserved.memory in bytes.
	ReservedMemory int64
	// MemoryOvercommit is overcommit.memory, like KubeVirt's memory
	// overcommit: how much more VM memory than host memory is accepted.
	MemoryOvercommit float64
	// IdleCost is vmMemory.idleCost in bytes.
	IdleCost int64
}

// DeriveMaxVMs is maxVMs when the file sets none: as many idle VMs as the
// host's memory (minus reserved, times the memory overcommit) holds at
// their measured cost, between 1 and MaxMaxVMs; DefaultMaxVMs when the
// host's memory is unknown. The reason says how, for the node's
// annotation. Pure.
func DeriveMaxVMs(in MaxVMsInput) (int32, string) {
	if in.MemoryTotal <= 0 || in.IdleCost <= 0 {
		return DefaultMaxVMs, fmt.Sprintf("maxVMs %d: the default, host memory unknown", DefaultMaxVMs)
	}
	usable := float64(in.MemoryTotal-in.ReservedMemory) * in.MemoryOvercommit
	n := int64(math.Floor(usable / float64(in.IdleCost)))
	n = min(max(n, 1), MaxMaxVMs)
	mi := func(b int64) string { return resource.NewQuantity(b, resource.BinarySI).String() }
	return int32(n), fmt.Sprintf("maxVMs %d derived from host memory: (%s total - %s reserved) x memory overcommit %s / %s per idle VM (vmMemory.idleCost)",
		n, bytesMi(in.MemoryTotal), mi(in.ReservedMemory), strconv.FormatFloat(in.MemoryOvercommit, 'f', -1, 64), mi(in.IdleCost))
}

// bytesMi renders bytes in whole MiB ("24105Mi").
func bytesMi(b int64) string { return strconv.FormatInt(b>>20, 10) + "Mi" }
func defaultInt32(p **int32, v int32) {
	if *p == nil {
		*p = &v
	}
}
