package nodestatus

import (
	"fmt"
	"maps"
	"runtime"
	"strconv"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Node labels, annotations and condition types qemu-kubelet sets.
const (
	LabelAccelerator      = "qemu-kubelet.io/accelerator"
	AnnotationAccelerator = "qemu-kubelet.io/accelerator-reason"
	// AnnotationMaxVMs says how the node's pods capacity (maxVMs) was
	// chosen: set in the file, or derived from the host's memory.
	AnnotationMaxVMs = "qemu-kubelet.io/max-vms"
	InstanceTypeQEMU = "qemu-vm-host"

	// ConditionKVM is True when VMs run under KVM, False (with the probe's
	// reason) when they run under TCG or not at all.
	ConditionKVM corev1.NodeConditionType = "KVMAccelerated"

	// AnnotationFeatures is the effective features section, in the form of
	// --feature-gates ("attach=true,...,consoleLogSize=8Mi").
	AnnotationFeatures = "qemu-kubelet.io/features"
	// ConditionConfigOK is True when the configuration file on disk is the
	// one in force (the kubelet's former KubeletConfigOk): False with
	// ReasonConfigInvalid when a reload rejected it (the previous
	// configuration stays), or ReasonRestartRequired when it changed
	// settings only a restart applies.
	ConditionConfigOK     corev1.NodeConditionType = "ConfigOK"
	ReasonConfigApplied                            = "ConfigApplied"
	ReasonConfigInvalid                            = "ConfigInvalid"
	ReasonRestartRequired                          = "RestartRequired"
)

// Reasons of the Ready condition.
const (
	ReasonReady                  = "KubeletReady"
	ReasonStateDirUnusable       = "StateDirUnusable"
	ReasonQEMUUnavailable        = "QEMUUnavailable"
	ReasonAcceleratorUnavailable = "AcceleratorUnavailable"
)

// Accelerator is the outcome of the accelerator probe, as shown on the node.
type Accelerator struct {
	// Name is "kvm" or "tcg"; empty when no accelerator is usable.
	Name string
	// Reason explains the choice (for humans).
	Reason string
	// KVMError is why KVM is not used ("" when KVM works or was not tried).
	KVMError string
	// Error is set when no accelerator is usable (require-kvm and KVM fails,
	// or the probe itself failed).
	Error string
}

// Facts are what is fixed for the life of the process: the configuration,
// versions, host info and the accelerator probe result; and the outcome of
// the last configuration (re)load (NodeStatus.SetConfigState changes it).
type Facts struct {
	Config      *config.Node
	Version     string // qemu-kubelet version
	QEMUVersion string // "" when unknown
	Host        HostInfo
	Accelerator Accelerator
	ConfigState ConfigState
}

// ConfigState is the outcome of the last load of the configuration file, as
// the node shows it (ConditionConfigOK, AnnotationFeatures). Plain data.
type ConfigState struct {
	// Features in force (nil: Config.Features).
	Features *config.FeatureConfig
	// Source is the file ("" for the default configuration).
	Source string
	// Error: the last reload was rejected (the previous features stay).
	Error string
	// RestartRequired lists the changed fields only a restart applies.
	RestartRequired []string
}

func (f Facts) features() *config.FeatureConfig {
	if f.ConfigState.Features != nil {
		return f.ConfigState.Features
	}
	if f.Config.Features != nil {
		return f.Config.Features
	}
	return config.DefaultFeatures()
}

// configCondition is ConditionConfigOK of a ConfigState.
func configCondition(cs ConfigState) corev1.NodeCondition {
	src := "config file " + cs.Source
	if cs.Source == "" {
		src = "default configuration (no --config file)"
	}
	c := corev1.NodeCondition{Type: ConditionConfigOK, Status: corev1.ConditionTrue, Reason: ReasonConfigApplied, Message: src + " in force"}
	switch {
	case cs.Error != "":
		c.Status, c.Reason = corev1.ConditionFalse, ReasonConfigInvalid
		c.Message = src + " rejected, the previous configuration stays in force: " + cs.Error
	case len(cs.RestartRequired) > 0:
		c.Status, c.Reason = corev1.ConditionFalse, ReasonRestartRequired
		c.Message = src + ": features applied; changed settings take effect after a restart: " + strings.Join(cs.RestartRequired, ", ")
	}
	return c
}

// Capacity computes the node capacity: cpu = host CPUs * cpu overcommit,
// memory = MemTotal * memory overcommit, ephemeral-storage = size of the
// state directory's file system, each times the node's capacity share
// (guest-architecture nodes split the host; 1 without them), pods = maxVMs.
func Capacity(cfg *config.Node, h HostReadings) corev1.ResourceList {
	share := cfg.CapacityShare
	if share <= 0 || share > 1 {
		share = 1
	}
	milliCPU := int64(float64(h.CPUs) * 1000 * cfg.CPUOvercommit * share)
	mem := int64(float64(h.MemoryTotal) * cfg.MemoryOvercommit * share)
	disk := int64(float64(h.DiskTotal) * share)
	return corev1.ResourceList{
		corev1.ResourceCPU:              *resource.NewMilliQuantity(milliCPU, resource.DecimalSI),
		corev1.ResourceMemory:           *resource.NewQuantity(mem, resource.BinarySI),
		corev1.ResourceEphemeralStorage: *resource.NewQuantity(disk, resource.BinarySI),
		corev1.ResourcePods:             *resource.NewQuantity(int64(cfg.MaxVMs), resource.DecimalSI),
	}
}

// Allocatable is capacity minus reserved, per resource, never negative.
func Allocatable(capacity, reserved corev1.ResourceList) corev1.ResourceList {
	out := corev1.ResourceList{}
	for name, c := range capacity {
		a := c.DeepCopy()
		if r, ok := reserved[name]; ok {
			a.Sub(r)
			if a.Sign() < 0 {
				a = *resource.NewQuantity(0, c.Format)
			}
		}
		out[name] = a
	}
	return out
}

// Labels are the node's labels: the well-known kubelet ones, the
// virtual-kubelet type, the accelerator, and the configured extra labels
// (which win on conflict).
func Labels(f Facts) map[string]string {
	accel := f.Accelerator.Name
	if accel == "" {
		accel = "none"
	}
	l := map[string]string{
		corev1.LabelHostname:           f.Config.NodeName,
		corev1.LabelOSStable:           runtime.GOOS,
		corev1.LabelArchStable:         guestArch(f.Config),
		corev1.LabelInstanceTypeStable: InstanceTypeQEMU,
		"type":                         "virtual-kubelet",
		LabelAccelerator:               accel,
	}
	maps.Copy(l, f.Config.Labels)
	return l
}

// guestArch is the node's architecture as Kubernetes sees it: that of its
// guests (a guest-architecture node is labelled arm64 on an x86-64 host, so
// arm64 pods select it like any arm64 node).
func guestArch(cfg *config.Node) string {
	if cfg.GuestArch != "" {
		return cfg.GuestArch
	}
	return runtime.GOARCH
}

// Annotations carry the accelerator reason in full, how maxVMs was chosen
// and the features in force.
func Annotations(f Facts) map[string]string {
	a := map[string]string{AnnotationAccelerator: acceleratorSummary(f.Accelerator), AnnotationFeatures: f.features().String()}
	if f.Config.MaxVMsReason != "" {
		a[AnnotationMaxVMs] = f.Config.MaxVMsReason
	}
	return a
}

func acceleratorSummary(a Accelerator) string {
	if a.Error != "" {
		return a.Error
	}
	return a.Reason
}

// NodeInfo is the node's systemInfo.
func NodeInfo(f Facts) corev1.NodeSystemInfo {
	qv := f.QEMUVersion
	if qv == "" {
		qv = "unknown"
	}
	return corev1.NodeSystemInfo{
		MachineID:               f.Host.MachineID,
		SystemUUID:              f.Host.SystemUUID,
		BootID:                  f.Host.BootID,
		KernelVersion:           f.Host.KernelVersion,
		OSImage:                 f.Host.OSImage,
		ContainerRuntimeVersion: "qemu://" + qv,
		KubeletVersion:          f.Version,
		KubeProxyVersion:        "",
		OperatingSystem:         runtime.GOOS,
		Architecture:            guestArch(f.Config),
	}
}

// Conditions computes the node conditions from one host sample. prev (the
// last conditions) keeps LastTransitionTime where a status did not change.
func Conditions(prev []corev1.NodeCondition, f Facts, h HostReadings, now metav1.Time) []corev1.NodeCondition {
	cfg := f.Config
	cond := func(t corev1.NodeConditionType, bad bool, badReason, badMsg, okReason, okMsg string) corev1.NodeCondition {
		c := corev1.NodeCondition{Type: t, Status: corev1.ConditionFalse, Reason: okReason, Message: okMsg}
		if bad {
			c.Status, c.Reason, c.Message = corev1.ConditionTrue, badReason, badMsg
		}
		return c
	}
	memP := cfg.MemoryAvailable.Crossed(h.MemoryAvailable, h.MemoryTotal)
	diskP := cfg.DiskAvailable.Crossed(h.DiskAvailable, h.DiskTotal)
	pidP := cfg.PIDAvailable.Crossed(h.PIDMax-h.PIDsInUse, h.PIDMax)
	conds := []corev1.NodeCondition{
		cond(corev1.NodeMemoryPressure, memP,
			"KubeletHasInsufficientMemory", fmt.Sprintf("available memory %s is below the threshold %s", bytesString(h.MemoryAvailable), cfg.MemoryAvailable),
			"KubeletHasSufficientMemory", fmt.Sprintf("kubelet has sufficient memory available (threshold %s)", cfg.MemoryAvailable)),
		cond(corev1.NodeDiskPressure, diskP,
			"KubeletHasDiskPressure", fmt.Sprintf("available disk %s under %s is below the threshold %s", bytesString(h.DiskAvailable), cfg.StateDir, cfg.DiskAvailable),
			"KubeletHasNoDiskPressure", fmt.Sprintf("kubelet has no disk pressure under %s (threshold %s)", cfg.StateDir, cfg.DiskAvailable)),
		cond(corev1.NodePIDPressure, pidP,
			"KubeletHasInsufficientPID", fmt.Sprintf("%d of %d PIDs in use, threshold %s available", h.PIDsInUse, h.PIDMax, cfg.PIDAvailable),
			"KubeletHasSufficientPID", fmt.Sprintf("kubelet has sufficient PID available (threshold %s)", cfg.PIDAvailable)),
		readyCondition(f, h),
		kvmCondition(f),
		configCondition(f.ConfigState),
	}
	for i := range conds {
		conds[i].LastHeartbeatTime = now
		conds[i].LastTransitionTime = now
		for _, p := range prev {
			if p.Type == conds[i].Type && p.Status == conds[i].Status && !p.LastTransitionTime.IsZero() {
				conds[i].LastTransitionTime = p.LastTransitionTime
			}
		}
	}
	return conds
}

func readyCondition(f Facts, h HostReadings) corev1.NodeCondition {
	notReady := func(reason, msg string) corev1.NodeCondition {
		return corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionFalse, Reason: reason, Message: msg}
	}
	switch {
	case h.StateDirError != "":
		return notReady(ReasonStateDirUnusable, h.StateDirError)
	case h.QEMUError != "":
		return notReady(ReasonQEMUUnavailable, h.QEMUError)
	case f.Accelerator.Error != "" || f.Accelerator.Name == "":
		msg := f.Accelerator.Error
		if msg == "" {
			msg = "no accelerator probed"
		}
		return notReady(ReasonAcceleratorUnavailable, msg)
	}
	return corev1.NodeCondition{
		Type:    corev1.NodeReady,
		Status:  corev1.ConditionTrue,
		Reason:  ReasonReady,
		Message: fmt.Sprintf("qemu-kubelet is posting ready status; QEMU %s, accelerator %s", orUnknown(f.QEMUVersion), f.Accelerator.Name),
	}
}

func kvmCondition(f Facts) corev1.NodeCondition {
	a := f.Accelerator
	c := corev1.NodeCondition{Type: ConditionKVM, Status: corev1.ConditionFalse, Message: acceleratorSummary(a)}
	switch {
	case a.Name == "kvm":
		c.Status, c.Reason = corev1.ConditionTrue, "KVMProbeSucceeded"
	case a.KVMError != "" || a.Error != "":
		c.Reason = "KVMProbeFailed"
	default:
		c.Reason = "KVMNotTried"
	}
	return c
}

func orUnknown(s string) string {
	if s == "" {
		return "unknown"
	}
	return s
}

func bytesString(b int64) string {
	if b >= 1<<30 {
		return strconv.FormatFloat(float64(b)/(1<<30), 'f', 1, 64) + "Gi"
	}
	if b >= 1<<20 {
		return strconv.FormatInt(b>>20, 10) + "Mi"
	}
	return resource.NewQuantity(b, resource.BinarySI).String()
}

// Status computes the whole node status from one host sample.
func Status(prev []corev1.NodeCondition, f Facts, h HostReadings, now metav1.Time) corev1.NodeStatus {
	capacity := Capacity(f.Config, h)
	return corev1.NodeStatus{
		Capacity:    capacity,
		Allocatable: Allocatable(capacity, reservedWithRetained(f.Config.Reserved, h.RetainedBytes)), // package poddisk
		Phase:       corev1.NodeRunning,
		Conditions:  Conditions(prev, f, h, now),
		Addresses: []corev1.NodeAddress{
			{Type: corev1.NodeInternalIP, Address: f.Config.NodeIP},
			{Type: corev1.NodeHostName, Address: f.Config.Hostname},
		},
		DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: f.Config.Port}},
		NodeInfo:        NodeInfo(f),
	}
}

// RegistrationNode is the Node object registered when it does not exist
// yet: labels, annotations, the configured taints and the full status. On
// later starts only status, labels and annotations are updated, so taints
// and cordon set by admins survive.
func RegistrationNode(f Facts, h HostReadings, now metav1.Time) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{
			Name:        f.Config.NodeName,
			Labels:      Labels(f),
			Annotations: Annotations(f),
		},
		Spec: corev1.NodeSpec{
			Taints: append([]corev1.Taint(nil), f.Config.Taints...),
		},
		Status: Status(nil, f, h, now),
	}
}
