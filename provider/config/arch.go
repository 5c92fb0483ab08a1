package config

import (
	"fmt"
	"maps"
	"math"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// GuestArchitecture adds a node for guests of another architecture than
// the host's, run under TCG (e.g. arm64 guests on an x86-64 host). Pods
// select it the Kubernetes way: nodeSelector kubernetes.io/arch=arm64.
type GuestArchitecture struct {
	// Arch is the guest architecture as Kubernetes names it: arm64 or
	// amd64; not the host's (the main node runs that one).
	Arch string `json:"arch"`
	// NodeName of the architecture's node (default <nodeName>-<arch>).
	NodeName string `json:"nodeName,omitempty"`
	// MaxVMs is the node's "pods" capacity (default 4).
	MaxVMs *int32 `json:"maxVMs,omitempty"`
	// CapacityShare is the fraction (0, 1) of the host's cpu, memory and
	// ephemeral-storage capacity this node reports; the host-architecture
	// node keeps the rest, so the scheduler never places more than the host
	// has over all nodes. Default: maxVMs / (sum of every node's maxVMs).
	CapacityShare *float64 `json:"capacityShare,omitempty"`
	// Port of the node's kubelet API (default server.port + 1 + index);
	// same address, certificate and authentication as the main node's.
	Port *int32 `json:"port,omitempty"`
	// QEMUBinary defaults to qemu-system-<QEMU arch> (qemu-system-aarch64).
	QEMUBinary string `json:"qemuBinary,omitempty"`
	// Firmware for UEFI pods; absent: the architecture's Debian firmware if
	// installed (AAVMF from qemu-efi-aarch64 for arm64, OVMF for amd64).
	Firmware Firmware `json:"firmware,omitempty"`
	// Labels are added to the main node's labels for this node.
	Labels map[string]string `json:"labels,omitempty"`
	// Kubeconfig holds this node's credentials (absolute path). Empty: the
	// agent's own (--kubeconfig, $KUBECONFIG or in-cluster), which suits a
	// ServiceAccount with the chart's ClusterRole. With node identities
	// (system:node:<name>), the Node authorizer and NodeRestriction let a
	// node write only its own Node, Lease and pods: give each node its own.
	Kubeconfig string `json:"kubeconfig,omitempty"`
}

// DefaultGuestArchMaxVMs is a guest-architecture node's default maxVMs:
// emulated guests are slow, a few are what a host runs well.
const DefaultGuestArchMaxVMs = 4

// DefaultAAVMF is where Debian's qemu-efi-aarch64 installs the arm64 UEFI
// firmware (64 MiB pflash images, as -machine virt wants them).
var DefaultAAVMF = [][2]string{{"/usr/share/AAVMF/AAVMF_CODE.fd", "/usr/share/AAVMF/AAVMF_VARS.fd"}}

// defaultFirmware is the firmware search list of a guest architecture.
func defaultFirmware(arch string) [][2]string {
	if arch == "arm64" {
		return DefaultAAVMF
	}
	return DefaultOVMF
}

func (e Environment) hostArch() string {
	if e.HostArch != "" {
		return e.HostArch
	}
	return runtime.GOARCH
}

func (e Environment) firstFirmware(arch string) (code, vars string) {
	for _, pair := range defaultFirmware(arch) {
		if e.exists(pair[0]) && e.exists(pair[1]) {
			return pair[0], pair[1]
		}
	}
	return "", ""
}

// defaultGuestArchitectures fills the entries' defaults; c's own defaults
// (nodeName, server.port, maxVMs) are already in place.
func defaultGuestArchitectures(c *NodeConfiguration, env Environment) {
	for i := range c.GuestArchitectures {
		g := &c.GuestArchitectures[i]
		if g.NodeName == "" && c.NodeName != "" {
			g.NodeName = c.NodeName + "-" + g.Arch
		}
		if g.MaxVMs == nil {
			v := int32(DefaultGuestArchMaxVMs)
			g.MaxVMs = &v
		}
		if g.Port == nil && c.Server.Port != nil {
			p := *c.Server.Port + 1 + int32(i)
			g.Port = &p
		}
		if a, err := qemu.ParseArch(g.Arch); err == nil && g.QEMUBinary == "" {
			g.QEMUBinary = a.Binary()
		}
		if g.Firmware.UEFICode == "" && g.Firmware.UEFIVars == "" {
			g.Firmware.UEFICode, g.Firmware.UEFIVars = env.firstFirmware(g.Arch)
		}
	}
}

// validateGuestArchitectures checks the entries and derives their nodes
// from main (already validated fields) into main.GuestArchitectures.
func validateGuestArchitectures(c *NodeConfiguration, main *Node, hostArch string, errs field.ErrorList) field.ErrorList {
	base := field.NewPath("guestArchitectures")
	total := float64(main.MaxVMs)
	for _, g := range c.GuestArchitectures {
		if g.MaxVMs != nil && *g.MaxVMs > 0 {
			total += float64(*g.MaxVMs)
		}
	}
	shareSum := 0.0
	seenArch, seenName, seenPort := map[string]int{}, map[string]int{main.NodeName: -1}, map[int32]int{main.Port: -1}
	for i, g := range c.GuestArchitectures {
		p := base.Index(i)
		n := *main
		n.GuestArchitectures = nil
		n.Labels = maps.Clone(main.Labels)
		if n.Labels == nil {
			n.Labels = map[string]string{}
		}
		n.Reserved = corev1.ResourceList{}    // the host's reserve is held back once, on the main node
		n.AcceleratorPolicy = PolicyPreferKVM // KVM never runs another architecture's guests: TCG, with that reason
		n.GuestArch = g.Arch
		n.CPUModels = nil // the file's cpuModel names the host architecture's models
		n.NodeName = g.NodeName
		n.QEMUBinary = g.QEMUBinary
		n.UEFICode, n.UEFIVars = g.Firmware.UEFICode, g.Firmware.UEFIVars
		n.StateDir = filepath.Join(main.StateDir, GuestArchDirName, g.Arch)
		n.Kubeconfig = g.Kubeconfig
		if g.Kubeconfig != "" && !filepath.IsAbs(g.Kubeconfig) {
			errs = append(errs, field.Invalid(p.Child("kubeconfig"), g.Kubeconfig, "must be an absolute path"))
		}

		switch a, err := qemu.ParseArch(g.Arch); {
		case err != nil || string(a) == g.Arch:
			errs = append(errs, field.NotSupported(p.Child("arch"), g.Arch, []string{"amd64", "arm64"}))
		case g.Arch == hostArch:
			errs = append(errs, field.Invalid(p.Child("arch"), g.Arch, "is the host's architecture: the main node already runs it"))
		default:
			if j, dup := seenArch[g.Arch]; dup {
				errs = append(errs, field.Duplicate(p.Child("arch"), fmt.Sprintf("%s (also guestArchitectures[%d])", g.Arch, j)))
			}
			seenArch[g.Arch] = i
		}
		for _, m := range validation.IsDNS1123Subdomain(g.NodeName) {
			errs = append(errs, field.Invalid(p.Child("nodeName"), g.NodeName, m))
		}
		if j, dup := seenName[g.NodeName]; dup && g.NodeName != "" {
			errs = append(errs, field.Duplicate(p.Child("nodeName"), fmt.Sprintf("%s (also %s)", g.NodeName, which(j))))
		}
		seenName[g.NodeName] = i
		n.MaxVMs = *g.MaxVMs
		n.MaxVMsReason = fmt.Sprintf("maxVMs %d from %s (default %d)", n.MaxVMs, p.Child("maxVMs"), DefaultGuestArchMaxVMs)
		if n.MaxVMs < 1 || n.MaxVMs > 10000 {
			errs = append(errs, field.Invalid(p.Child("maxVMs"), n.MaxVMs, "must be between 1 and 10000"))
		}
		n.CapacityShare = float64(n.MaxVMs) / total
		if g.CapacityShare != nil {
			n.CapacityShare = *g.CapacityShare
			if !(n.CapacityShare > 0 && n.CapacityShare < 1) || math.IsNaN(n.CapacityShare) {
				errs = append(errs, field.Invalid(p.Child("capacityShare"), n.CapacityShare, "must be a fraction greater than 0 and less than 1"))
			}
		}
		shareSum += n.CapacityShare
		n.Port = *g.Port
		if n.Port < 1 || n.Port > 65535 {
			errs = append(errs, field.Invalid(p.Child("port"), n.Port, "must be between 1 and 65535"))
		} else if j, dup := seenPort[n.Port]; dup {
			errs = append(errs, field.Duplicate(p.Child("port"), fmt.Sprintf("%d (also %s)", n.Port, which(j))))
		}
		seenPort[n.Port] = i
		if g.QEMUBinary == "" || strings.ContainsAny(g.QEMUBinary, "\n") {
			errs = append(errs, field.Invalid(p.Child("qemuBinary"), g.QEMUBinary, "must name the qemu-system binary"))
		}
		errs = validateFirmware(p.Child("firmware"), g.Firmware, errs)
		for k, v := range g.Labels {
			for _, m := range validation.IsQualifiedName(k) {
				errs = append(errs, field.Invalid(p.Child("labels").Key(k), k, m))
			}
			for _, m := range validation.IsValidLabelValue(v) {
				errs = append(errs, field.Invalid(p.Child("labels").Key(k), v, m))
			}
			n.Labels[k] = v
		}
		main.GuestArchitectures = append(main.GuestArchitectures, &n)
	}
	if len(c.GuestArchitectures) > 0 && !(shareSum < 1) {
		errs = append(errs, field.Invalid(base, shareSum, "the capacityShare of all guest architectures must add up to less than 1 (the main node keeps the rest)"))
	}
	main.CapacityShare = 1 - shareSum
	return errs
}

func which(i int) string {
	if i < 0 {
		return "the main node"
	}
	return fmt.Sprintf("guestArchitectures[%d]", i)
}

// GuestArchDirName is the directory under the main state dir holding the
// guest-architecture nodes' state dirs (<stateDir>/arch/<arch>).
const GuestArchDirName = "arch"
