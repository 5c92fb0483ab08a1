package podspec

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
)

// AnnotationPrefix is the prefix of the pod annotations qemu-kubelet reads.
// The set under it is closed: an unknown key is an error, not ignored.
const AnnotationPrefix = "qemu-kubelet.io/"

// Pod annotations understood by qemu-kubelet (docs/pods.md).
const (
	// AnnotationMachine selects the QEMU machine type of the node's guest
	// architecture: on x86_64 q35 (default), pc or microvm (direct kernel
	// boot only; no pvpanic, so a guest panic is seen as a crash); on
	// aarch64 virt (the default and only one).
	AnnotationMachine = AnnotationPrefix + "machine"
	// AnnotationFirmware is bios (default) or uefi (needs OVMF on the node).
	AnnotationFirmware = AnnotationPrefix + "firmware"
	// AnnotationKernelCmdline is appended to the image's kernel command line
	// (images with a kernel only).
	AnnotationKernelCmdline = AnnotationPrefix + "kernel-cmdline"
	// AnnotationRequireAccelerator requires an accelerator: kvm, tcg, or any
	// (default: whatever the node probed).
	AnnotationRequireAccelerator = AnnotationPrefix + "accelerator"
	// AnnotationStartFromSnapshot "true" starts the VM from a memory
	// snapshot of the same image and VM shape taken at its readiness
	// point, instead of booting (provider/snapshots.go, docs/pods.md). Needs a
	// readinessProbe: its first success is the point the snapshot is
	// taken at.
	AnnotationStartFromSnapshot = v1alpha1.StartFromSnapshotAnnotation
	// AnnotationDisplay gives the VM a display: "vnc" (a graphics card and
	// a VNC server on a unix socket in the pod's state dir, served as the
	// Jumpstarter exporter's vnc child) or "none". Absent: an exporter
	// pod's VM has one, any other's none (DisplayOf). "vnc" not with
	// machine microvm.
	AnnotationDisplay = v1alpha1.DisplayAnnotation
	// AnnotationCPUModel names the guest CPU model, QEMU's -cpu: a model,
	// optionally with comma-separated features (e.g. max, Haswell-v4,
	// max,la57=off; host under KVM only). Default: the node's
	// (config cpuModel), else qemu.DefaultCPUModel (CPUModel).
	AnnotationCPUModel = AnnotationPrefix + "cpu-model"
)

// Values of AnnotationDisplay.
const (
	DisplayNone = v1alpha1.DisplayNone
	DisplayVNC  = "vnc"
)

// knownAnnotations is the closed set of annotation keys under the prefix.
var knownAnnotations = map[string]bool{
	AnnotationMachine: true, AnnotationFirmware: true, AnnotationKernelCmdline: true, AnnotationRequireAccelerator: true,
	AnnotationStartFromSnapshot:          true,
	AnnotationDisplay:                    true,
	AnnotationCPUModel:                   true,
	v1alpha1.JumpstarterSecretAnnotation: true, // provider/exporter
	// The ExporterSet controller's: the parameters reach the guest through
	// the QK_PARAMETERS env fieldRef (environment disk); the state and
	// reclaim policies are the node's (package poddisk); the removal mark is the
	// controller's.
	v1alpha1.ParametersAnnotation: true, v1alpha1.RemoveAnnotation: true,
	v1alpha1.StatePolicyAnnotation: true, v1alpha1.ReclaimPolicyAnnotation: true,
	// The lease state policy and hooks are the pod's exporter's (leasepolicy.go).
	v1alpha1.LeaseStatePolicyAnnotation: true, v1alpha1.LeaseHooksAnnotation: true,
	// The exporter's default drivers (jsdrivers.go).
	v1alpha1.SSHDriverAnnotation: true,
}

// DefaultMemory is the guest RAM of a pod that sets neither a memory limit
// nor a memory request.
var DefaultMemory = resource.MustParse("512Mi")

// maxCPU and maxMemory bound a VM's vCPUs and RAM (QEMU's q35 limit is
// 1024 vCPUs); larger requests are refused, not truncated.
var (
	maxCPU    = resource.MustParse("1024")
	maxMemory = resource.MustParse("16Ti")
)

// MaxKernelCmdlineAnnotation bounds the appended command line.
const MaxKernelCmdlineAnnotation = 2048

// kubeAPIAccessPrefix names the projected volume the ServiceAccount admission
// plugin adds to every pod ("kube-api-access-xxxxx"). A VM cannot use it;
// it is ignored.
const kubeAPIAccessPrefix = "kube-api-access-"

// Plan is what a pod asks of its VM, translated and validated. Plain data;
// the image-dependent parts (kernel, disk) are filled in at start.
type Plan struct {
	Image       string
	PullPolicy  oci.PullPolicy
	PullSecrets []string
	CPUs        int
	MemoryMiB   int
	// CPULimitMilli is the container's CPU limit (0: none): the cap of the
	// VM's own cgroup (VMCgroup).
	CPULimitMilli int64
	Machine       string
	Firmware      qemu.Firmware
	// ExtraCmdline is appended to the image's kernel command line.
	ExtraCmdline string
	// Accelerator is a requirement: "" (any), "kvm" or "tcg".
	Accelerator string
	// StatePolicy says whether the VM's disk survives its restarts
	// (package poddisk): Retain, else ("" or Disabled) a fresh disk every start.
	StatePolicy v1alpha1.StatePolicy
	// SnapshotStart: start from a memory snapshot (AnnotationStartFromSnapshot).
	SnapshotStart bool
	// Display: the VM has a graphics card and a VNC server (AnnotationDisplay;
	// by default an exporter pod's: DisplayOf).
	Display bool
	// CPUModel: the guest CPU model the pod asks for (AnnotationCPUModel;
	// "": the node's choice, see CPUModel).
	CPUModel string
	// EmptyDiskBytes is the size of the empty root disk of a pod whose
	// image is v1alpha1.EmptyDiskImage (IsEmptyDisk; 0 otherwise).
	EmptyDiskBytes int64
}

// Rejection says why a pod is not started: a kubelet-style reason and a
// message naming the field and why.
type Rejection struct {
	Reason  string
	Message string
}

func (r *Rejection) Error() string { return r.Reason + ": " + r.Message }

// Reasons of pods that are not started (pod status reason, phase Failed).
const (
	// ReasonUnsupportedPodSpec: the pod uses a feature a VM pod does not
	// support (or not yet).
	ReasonUnsupportedPodSpec = "UnsupportedPodSpec"
)

// Translate turns a pod into a VM plan for a node whose guests are of
// architecture arch (machine types differ), or a Rejection listing every
// unsupported field. Pure.
func Translate(pod *corev1.Pod, arch qemu.Arch) (Plan, *Rejection) {
	var problems []string
	bad := func(field, format string, a ...any) {
		problems = append(problems, field+": "+fmt.Sprintf(format, a...))
	}
	spec := &pod.Spec
	var plan Plan

	switch n := len(spec.Containers); {
	case n == 0:
		bad("spec.containers", "a VM pod needs exactly one container (its image is the OS image)")
	case n > 1:
		bad("spec.containers", "a VM pod has exactly one container (its image is the OS image), got %d", n)
	}
	if len(spec.InitContainers) > 0 {
		bad("spec.initContainers", "not supported: a VM pod has no init containers")
	}
	if len(spec.EphemeralContainers) > 0 {
		bad("spec.ephemeralContainers", "not supported")
	}
	if spec.HostNetwork {
		bad("spec.hostNetwork", "not supported: VMs use QEMU user-mode networking")
	}
	if spec.HostPID {
		bad("spec.hostPID", "not supported: a VM has its own kernel")
	}
	if spec.HostIPC {
		bad("spec.hostIPC", "not supported: a VM has its own kernel")
	}
	if spec.SecurityContext != nil && spec.SecurityContext.WindowsOptions != nil {
		bad("spec.securityContext.windowsOptions", "not supported")
	}
	for i, v := range spec.Volumes {
		f := fmt.Sprintf("spec.volumes[%d]", i)
		switch {
		case v.Projected != nil && strings.HasPrefix(v.Name, kubeAPIAccessPrefix):
			// Added by the ServiceAccount admission plugin; ignored.
		case v.PersistentVolumeClaim != nil:
			bad(f+".persistentVolumeClaim", "volume %q: persistent volume claims are not supported by VM pods", v.Name)
		case v.Secret != nil, v.ConfigMap != nil, v.EmptyDir != nil:
			// Guest disks (volumes.go), checked below.
		default:
			bad(f, "volume %q: this volume type is not supported by VM pods", v.Name)
		}
	}
	problems = append(problems, ValidateGuestVolumes(spec, ExporterSecretName(pod))...)
	if len(spec.Containers) > 0 {
		c := spec.Containers[0]
		translateContainer(c, bad, &plan)
	}
	for i, s := range spec.ImagePullSecrets {
		if s.Name == "" {
			bad(fmt.Sprintf("spec.imagePullSecrets[%d].name", i), "must not be empty")
			continue
		}
		plan.PullSecrets = append(plan.PullSecrets, s.Name)
	}
	translateAnnotations(pod.Annotations, arch, ExporterSecretName(pod) != "", bad, &plan)
	if plan.IsEmptyDisk() {
		validateEmptyDisk(pod.Annotations, plan, bad)
	}
	if plan.SnapshotStart {
		validateSnapshotStart(spec, ExporterSecretName(pod), bad)
		if plan.StatePolicy == v1alpha1.StatePolicyRetain {
			// A snapshot's memory belongs with the snapshot's disk: restored
			// over a disk the guest changed since, it corrupts the guest.
			bad("metadata.annotations["+v1alpha1.StatePolicyAnnotation+"]", "Retain cannot be combined with %s: a memory snapshot restores the guest with the image's disk, not the pod's kept one", AnnotationStartFromSnapshot)
		}
	}

	if len(problems) > 0 {
		return Plan{}, &Rejection{Reason: ReasonUnsupportedPodSpec, Message: strings.Join(problems, "; ")}
	}
	return plan, nil
}

func translateContainer(c corev1.Container, bad func(field, format string, a ...any), plan *Plan) {
	f := "spec.containers[0]"
	plan.Image = c.Image
	if c.Image == "" {
		bad(f+".image", "must name the OS image")
	}
	switch c.ImagePullPolicy {
	case corev1.PullAlways:
		plan.PullPolicy = oci.PullAlways
	case corev1.PullNever:
		plan.PullPolicy = oci.PullNever
	case corev1.PullIfNotPresent, "":
		plan.PullPolicy = oci.PullIfNotPresent
	default:
		bad(f+".imagePullPolicy", "unknown policy %q", c.ImagePullPolicy)
	}
	if len(c.Command) > 0 {
		bad(f+".command", "not supported: a VM boots its image's OS (use the %s annotation for kernel arguments)", AnnotationKernelCmdline)
	}
	if len(c.Args) > 0 {
		bad(f+".args", "not supported: a VM boots its image's OS (use the %s annotation for kernel arguments)", AnnotationKernelCmdline)
	}
	for _, pr := range ValidateGuestEnv(&c, f) {
		field, msg, _ := strings.Cut(pr, ": ")
		bad(field, "%s", msg)
	}
	if c.WorkingDir != "" {
		bad(f+".workingDir", "not supported by VM pods")
	}
	if c.Lifecycle != nil {
		bad(f+".lifecycle", "lifecycle hooks are not supported by VM pods")
	}
	if sc := c.SecurityContext; sc != nil {
		if sc.Privileged != nil && *sc.Privileged {
			bad(f+".securityContext.privileged", "not supported: QEMU never runs privileged for a pod")
		}
		if sc.Capabilities != nil && len(sc.Capabilities.Add) > 0 {
			bad(f+".securityContext.capabilities.add", "not supported: QEMU gets no extra capabilities")
		}
	}
	for i, p := range c.Ports {
		if p.HostPort != 0 {
			bad(fmt.Sprintf("%s.ports[%d].hostPort", f, i), "not supported: use kubectl port-forward or a Service")
		}
	}
	if len(c.VolumeDevices) > 0 {
		bad(f+".volumeDevices", "not supported by VM pods")
	}
	for _, pr := range []struct {
		field string
		probe *corev1.Probe
	}{{"livenessProbe", c.LivenessProbe}, {"readinessProbe", c.ReadinessProbe}, {"startupProbe", c.StartupProbe}} {
		if pr.probe == nil {
			continue
		}
		// provider/probes.go runs tcpSocket and httpGet probes through the VM's
		// user network and exec probes through the guest agent (every VM
		// has its channel); grpc is not implemented, so such a probe could
		// only ever fail (a liveness probe would restart the VM forever).
		if pr.probe.Exec != nil && (len(pr.probe.Exec.Command) == 0 || pr.probe.Exec.Command[0] == "") {
			bad(f+"."+pr.field+".exec.command", "an exec probe needs a command")
		}
		if pr.probe.GRPC != nil {
			bad(f+"."+pr.field+".grpc", "grpc probes are not supported by VM pods; use tcpSocket or httpGet")
		}
	}
	for _, rl := range []struct {
		what string
		list corev1.ResourceList
	}{{"limits", c.Resources.Limits}, {"requests", c.Resources.Requests}} {
		names := make([]string, 0, len(rl.list))
		for name := range rl.list {
			names = append(names, string(name))
		}
		sort.Strings(names)
		for _, name := range names {
			switch corev1.ResourceName(name) {
			case corev1.ResourceCPU, corev1.ResourceMemory, corev1.ResourceEphemeralStorage:
				q := rl.list[corev1.ResourceName(name)]
				field := fmt.Sprintf("%s.resources.%s[%s]", f, rl.what, name)
				switch {
				case q.Sign() < 0:
					bad(field, "%s must not be negative", q.String())
				case corev1.ResourceName(name) == corev1.ResourceCPU && q.Cmp(maxCPU) > 0:
					bad(field, "%s is more than a VM can have (%s vCPUs)", q.String(), maxCPU.String())
				case corev1.ResourceName(name) == corev1.ResourceMemory && q.Cmp(maxMemory) > 0:
					bad(field, "%s is more than a VM can have (%s)", q.String(), maxMemory.String())
				}
			default:
				bad(fmt.Sprintf("%s.resources.%s[%s]", f, rl.what, name), "resource not supported by VM pods (cpu, memory, ephemeral-storage)")
			}
		}
	}
	plan.CPUs = VCPUs(c.Resources)
	if q, ok := c.Resources.Limits[corev1.ResourceCPU]; ok && q.Sign() > 0 {
		plan.CPULimitMilli = q.MilliValue()
	}
	mem := GuestMemory(c.Resources)
	plan.MemoryMiB = MemoryMiB(mem.Value())
	if plan.IsEmptyDisk() {
		plan.EmptyDiskBytes = emptyDiskBytes(c, f, bad)
	}
}

// VCPUs is ceil(cpu limit), else ceil(cpu request), else 1.
func VCPUs(r corev1.ResourceRequirements) int {
	q, ok := r.Limits[corev1.ResourceCPU]
	if !ok || q.IsZero() {
		q, ok = r.Requests[corev1.ResourceCPU]
	}
	if !ok || q.IsZero() {
		return 1
	}
	return int((q.MilliValue() + 999) / 1000)
}

// GuestMemory is the memory limit, else the memory request, else
// DefaultMemory.
func GuestMemory(r corev1.ResourceRequirements) resource.Quantity {
	if q, ok := r.Limits[corev1.ResourceMemory]; ok && !q.IsZero() {
		return q
	}
	if q, ok := r.Requests[corev1.ResourceMemory]; ok && !q.IsZero() {
		return q
	}
	return DefaultMemory.DeepCopy()
}

// translateAnnotations reads the qemu-kubelet annotations of a pod into
// plan; exporter: the pod has a Jumpstarter exporter (its display default).
func translateAnnotations(ann map[string]string, arch qemu.Arch, exporter bool, bad func(field, format string, a ...any), plan *Plan) {
	keys := make([]string, 0, len(ann))
	for k := range ann {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !strings.HasPrefix(k, AnnotationPrefix) {
			continue
		}
		v := ann[k]
		f := fmt.Sprintf("metadata.annotations[%s]", k)
		if !knownAnnotations[k] {
			bad(f, "unknown qemu-kubelet annotation (known: %s)", strings.Join(sortedKeys(knownAnnotations), ", "))
			continue
		}
		switch k {
		case AnnotationMachine:
			if slices.Contains(arch.Machines(), v) {
				plan.Machine = v
			} else {
				bad(f, "machine %q: not a machine of this node's %s guests (want %s)", v, arch, strings.Join(arch.Machines(), ", "))
			}
		case AnnotationFirmware:
			switch qemu.Firmware(v) {
			case qemu.FirmwareBIOS, qemu.FirmwareUEFI:
				plan.Firmware = qemu.Firmware(v)
			default:
				bad(f, "firmware %q: want bios or uefi", v)
			}
		case AnnotationKernelCmdline:
			if strings.ContainsAny(v, "\n\r\x00") || len(v) > MaxKernelCmdlineAnnotation {
				bad(f, "must be one line of at most %d bytes", MaxKernelCmdlineAnnotation)
			} else {
				plan.ExtraCmdline = strings.TrimSpace(v)
			}
		case v1alpha1.JumpstarterSecretAnnotation:
			if errs := validation.IsDNS1123Subdomain(v); len(errs) > 0 {
				bad(f, "secret name %q: %s", v, strings.Join(errs, "; "))
			}
		case v1alpha1.LeaseStatePolicyAnnotation, v1alpha1.LeaseHooksAnnotation:
			if _, err := LeaseSettingsOf(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{k: v}}}); err != nil {
				bad(f, "%v", err)
			}
		case v1alpha1.SSHDriverAnnotation:
			if _, err := SSHDriverOf(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{k: v}}}); err != nil {
				bad(f, "%v", err)
			}
		case v1alpha1.StatePolicyAnnotation:
			switch v1alpha1.StatePolicy(v) {
			case v1alpha1.StatePolicyDisabled, v1alpha1.StatePolicyRetain:
				plan.StatePolicy = v1alpha1.StatePolicy(v)
			default:
				bad(f, "state policy %q: want Disabled or Retain", v)
			}
		case v1alpha1.ReclaimPolicyAnnotation:
			switch v1alpha1.ReclaimPolicy(v) {
			case v1alpha1.ReclaimPolicyDelete, v1alpha1.ReclaimPolicyRetain:
			default:
				bad(f, "reclaim policy %q: want Delete or Retain", v)
			}
		case AnnotationRequireAccelerator:
			switch v {
			case "kvm", "tcg":
				plan.Accelerator = v
			case "any", "":
			default:
				bad(f, "accelerator %q: want kvm, tcg or any", v)
			}
		case AnnotationStartFromSnapshot:
			switch v {
			case "true":
				plan.SnapshotStart = true
			case "false":
			default:
				bad(f, "%q: want \"true\" or \"false\"", v)
			}
		case AnnotationCPUModel:
			// Whether the model suits the accelerator (host needs KVM) is
			// known at start: qemu.Spec.Validate (InvalidVMSpec).
			if err := qemu.ValidateCPUModel(v); err != nil {
				bad(f, "%v", err)
			} else {
				plan.CPUModel = v
			}
		case AnnotationDisplay:
			if v != DisplayVNC && v != DisplayNone {
				bad(f, "display %q: want %s or %s", v, DisplayVNC, DisplayNone)
			}
		}
	}
	if plan.Machine == "" {
		plan.Machine = arch.DefaultMachine()
	}
	v, set := ann[AnnotationDisplay]
	plan.Display = decideDisplay(v, set, exporter, plan.Machine)
	if plan.Firmware == "" {
		plan.Firmware = qemu.FirmwareBIOS
	}

	if plan.Machine == "microvm" && plan.Firmware == qemu.FirmwareUEFI {
		bad("metadata.annotations["+AnnotationFirmware+"]", "uefi is not available with machine microvm")
	}
	if plan.Machine == "microvm" && v == DisplayVNC {
		bad("metadata.annotations["+AnnotationDisplay+"]", "machine microvm has no graphics card (use q35 or pc)")
	}
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// validateSnapshotStart: the snapshot is taken when the readiness probe
// first passes, and per-pod data must not end up in memory other pods start
// from: no volumes that become guest disks, no env (the environment disk).
func validateSnapshotStart(spec *corev1.PodSpec, exporterSecret string, bad func(field, format string, a ...any)) {
	f := "metadata.annotations[" + AnnotationStartFromSnapshot + "]"
	if len(spec.Containers) == 0 || spec.Containers[0].ReadinessProbe == nil {
		bad(f, "needs a readinessProbe on the container: the snapshot is taken when it first succeeds")
	}
	for _, v := range spec.Volumes {
		if hostOnlyVolume(v, exporterSecret) || (v.Secret == nil && v.ConfigMap == nil && v.EmptyDir == nil) {
			continue
		}
		bad(f, "not with volume %q: guest disks hold per-pod data, which would end up in a snapshot other pods start from", v.Name)
	}
	if len(spec.Containers) > 0 && (len(spec.Containers[0].Env) > 0 || len(spec.Containers[0].EnvFrom) > 0) {
		bad(f, "not with env or envFrom: the environment disk holds per-pod data, which would end up in a snapshot other pods start from")
	}
}

// InvalidSpec is the error of a pod whose VM spec cannot be built from its
// image and plan: the start ends with ReasonInvalidVMSpec, not
// ReasonStartError.
type InvalidSpec struct{ Err error }

func (e InvalidSpec) Error() string { return e.Err.Error() }

func (e InvalidSpec) Unwrap() error { return e.Err }

// ImageID is the container imageID of a pod booting img: its repository
// and digest (repo@sha256:...).
func ImageID(img *oci.Image) string {
	repo := img.Ref
	if i := strings.Index(repo, "@"); i >= 0 {
		repo = repo[:i]
	} else if i := strings.LastIndex(repo, ":"); i > strings.LastIndex(repo, "/") {
		repo = repo[:i]
	}
	return repo + "@" + img.Digest
}
