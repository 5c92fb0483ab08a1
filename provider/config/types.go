// Package config owns the versioned node configuration file of qemu-kubelet
// (apiVersion qemu-kubelet.io/v1alpha1, kind NodeConfiguration): its file
// type, strict decoding, defaults, validation, and the resolved plain-data
// form (Node) the rest of the program consumes.
//
// The file type keeps quantities and durations as strings so that a bad value
// is reported with its field path ("reserved.memory: Invalid value ...")
// instead of an anonymous decoder error.
package config

import (
	"encoding/json"
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// APIVersion and Kind identify the node configuration file format.
const (
	APIVersion = "qemu-kubelet.io/v1alpha1"
	Kind       = "NodeConfiguration"
)

// Accelerator policies.
const (
	// PolicyRequireKVM refuses to run VMs unless a KVM VM really starts.
	PolicyRequireKVM = "require-kvm"
	// PolicyPreferKVM uses KVM when a probe VM starts with it, else TCG.
	PolicyPreferKVM = "prefer-kvm"
	// PolicyTCG always uses TCG (software emulation).
	PolicyTCG = "tcg"
)

// NodeConfiguration is the on-disk configuration file of qemu-kubelet.
// Every field is optional except apiVersion and kind; see Default for the
// defaults and docs/node-config.md for the reference.
type NodeConfiguration struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`

	// NodeName is the name of the Node object. Default: the host name
	// (lower-cased). The --node-name flag overrides it.
	NodeName string `json:"nodeName,omitempty"`
	// NodeIP is the address published as the node's InternalIP (the API
	// server reaches the kubelet API there). Default: the first non-loopback
	// IPv4 address of the host, else 127.0.0.1.
	NodeIP string `json:"nodeIP,omitempty"`
	// StateDir holds VM state, the generated serving certificate and the
	// disk whose space is reported as ephemeral-storage.
	StateDir string `json:"stateDir,omitempty"`
	// QEMUBinary is the qemu-system binary (name looked up in PATH, or path).
	QEMUBinary string `json:"qemuBinary,omitempty"`
	// MaxVMs is the node's "pods" capacity. Absent: derived from the host's
	// memory (see DeriveMaxVMs and vmMemory.idleCost).
	MaxVMs *int32 `json:"maxVMs,omitempty"`
	// Reserved is subtracted from capacity to give allocatable. Keys: cpu,
	// memory, ephemeral-storage; values are resource quantities.
	Reserved map[string]QuantityString `json:"reserved,omitempty"`
	// Overcommit multiplies the host's CPUs and memory into capacity.
	Overcommit Overcommit `json:"overcommit,omitempty"`
	// Accelerator selects KVM or TCG.
	Accelerator Accelerator `json:"accelerator,omitempty"`
	// Firmware locates the UEFI firmware (OVMF) for pods annotated
	// qemu-kubelet.io/firmware=uefi.
	Firmware Firmware `json:"firmware,omitempty"`
	// Taints are put on the Node when it is registered (created). Absent:
	// virtual-kubelet.io/provider=qemu:NoSchedule. An empty list: no taint.
	// Taints set later by admins are kept across restarts.
	Taints []corev1.Taint `json:"taints,omitempty"`
	// Labels are added to the node's labels. Keys in the kubernetes.io and
	// k8s.io domains are restricted by the NodeRestriction admission plugin.
	Labels map[string]string `json:"labels,omitempty"`
	// Server is the kubelet API (logs, exec, port-forward, pods, stats).
	Server Server `json:"server,omitempty"`
	// NodeStatusUpdateFrequency is how often host readings are taken and
	// the node status is pushed when it changed (duration, default 10s).
	NodeStatusUpdateFrequency string `json:"nodeStatusUpdateFrequency,omitempty"`
	// NodeLeaseDurationSeconds is the duration of the node's Lease in
	// kube-node-lease; it is renewed every quarter of it, like the kubelet
	// (default 40).
	NodeLeaseDurationSeconds *int32 `json:"nodeLeaseDurationSeconds,omitempty"`
	// KubeAPIQPS and KubeAPIBurst are the node's API client budget, as the
	// kubelet's kubeAPIQPS/kubeAPIBurst (defaults 50 and 100). Pod status
	// writes, deletes and the node's own updates share it; events have a
	// client and budget of their own (EventRecordQPS/EventBurst).
	KubeAPIQPS   *int32 `json:"kubeAPIQPS,omitempty"`
	KubeAPIBurst *int32 `json:"kubeAPIBurst,omitempty"`
	// EventRecordQPS and EventBurst bound event creation, on a client of
	// their own so events never delay a pod status write (kubelet's
	// eventRecordQPS/eventBurst; defaults 50 and 100).
	EventRecordQPS *int32 `json:"eventRecordQPS,omitempty"`
	EventBurst     *int32 `json:"eventBurst,omitempty"`
	// PodSyncWorkers is the number of workers of each of the pod
	// controller's queues (pods to the provider, provider statuses to the
	// API server, deletes), as virtual-kubelet's --pod-sync-workers
	// (default 10). Pod starts themselves run on a goroutine per pod.
	PodSyncWorkers *int32 `json:"podSyncWorkers,omitempty"`
	// VMNice is the nice value every guest runs at, 0 to 19 (default 10;
	// 0: off), where the VMs get no CPU cgroup below the agent
	// (vmCgroup.cpuWeight, which comes first): its threads and, on hosts
	// with scheduler autogroups, its session. Guests then compete with
	// each other as before, but below the agent, the API server and etcd:
	// a burst of 30 pods reached all-Ready in 6.6 s with 10 against
	// 26.9 s with 0 (docs/performance.md).
	VMNice *int32 `json:"vmNice,omitempty"`
	// EmulatedKernelArgs are added to the kernel command line of x86-64
	// guests booted directly (-kernel) under TCG, unless the image's or
	// the pod's command line names the argument already. Absent: the
	// defaults (tsc=reliable, sysctl.vm.compaction_proactiveness=0), which
	// took an idle test-image VM's QEMU from 0.58% to 0.22% of a CPU
	// (docs/performance.md); [] adds none.
	EmulatedKernelArgs *[]string `json:"emulatedKernelArgs,omitempty"`
	// CPUModel is the guest CPU model (QEMU's -cpu) of pods that name
	// none (cpumodel.go, docs/node-config.md).
	CPUModel CPUModel `json:"cpuModel,omitempty"`
	// Pressure holds the thresholds of the pressure conditions.
	Pressure PressureThresholds `json:"pressure,omitempty"`
	// Images configures the OS image cache and registries.
	Images Images `json:"images,omitempty"`
	// VMMemory accounts and tunes what each VM costs the host beyond its
	// guest RAM (docs/node-config.md gives the measured trade-offs).
	VMMemory VMMemory `json:"vmMemory,omitempty"`
	// VMCgroup says in which cgroup each VM's QEMU runs (cgroup.go): the
	// agent's (default) or one of its own, so that VMs outlive an agent
	// whose container is stopped (the Helm chart sets mode Own).
	VMCgroup VMCgroup `json:"vmCgroup,omitempty"`
	// VMUser is the uid and gid every QEMU runs as (vmuser.go): 107:107
	// by default (the agent's own when it is not root).
	VMUser VMUser `json:"vmUser,omitempty"`
	// GuestArchitectures registers one more node per entry, for guests of
	// another architecture run under TCG (arch.go, docs/node-config.md).
	GuestArchitectures []GuestArchitecture `json:"guestArchitectures,omitempty"`
	// Features switches what the node offers (features.go); the only
	// section a reload applies at runtime.
	Features Features `json:"features,omitempty"`
	// Jumpstarter bounds what a lease holder may make the node do through
	// the pods' exporters (leases.go, docs/multi-tenant.md).
	Jumpstarter Leases `json:"jumpstarter,omitempty"`
}

// VMMemory accounts and tunes the host memory of VMs.
type VMMemory struct {
	// Overhead is QEMU's own memory per VM (quantity, default 128Mi):
	// admission counts a VM pod's memory request plus the larger of this and
	// the pod's RuntimeClass overhead.
	Overhead QuantityString `json:"overhead,omitempty"`
	// IdleCost is the host memory an idle VM costs, QEMU and the guest RAM
	// it touched (quantity, default 160Mi, measured with the test image);
	// only used to derive maxVMs when the file sets none.
	IdleCost QuantityString `json:"idleCost,omitempty"`
	// TCGTranslationBuffer sizes QEMU's buffer of translated guest code
	// under TCG (quantity in whole MiB, default 32Mi; "0" keeps QEMU's
	// default of 1Gi, filled as code is translated).
	TCGTranslationBuffer QuantityString `json:"tcgTranslationBuffer,omitempty"`
	// FreePageReporting gives every VM a virtio-balloon device with free
	// page reporting, so memory the guest freed goes back to the host
	// (default true; needs the guest's virtio_balloon driver).
	FreePageReporting *bool `json:"freePageReporting,omitempty"`
	// PageMerging marks guest RAM mergeable by the host's KSM (QEMU
	// mem-merge=on). Default false: identical pages of different pods'
	// guests are never merged, which closes the page-deduplication timing
	// side channel between tenants.
	PageMerging *bool `json:"pageMerging,omitempty"`
	// EnableKSM makes the agent start the kernel's same-page merging
	// (writes 1 to /sys/kernel/mm/ksm/run) at start; needs pageMerging and
	// a writable /sys. Default false (KSM costs host CPU: see
	// docs/node-config.md).
	EnableKSM *bool `json:"enableKSM,omitempty"`
	// KSMPagesToScan is written to /sys/kernel/mm/ksm/pages_to_scan (a
	// host-wide setting) when the node starts KSM (enableKSM): pages ksmd
	// scans per wake-up (every sleep_millisecs, 20 ms by default). Absent
	// or 0 leaves the kernel's value (100: ~20 MiB/s, a full pass over 200
	// 96-MiB guests in ~16 minutes); 1000 scans ~200 MiB/s and cost ksmd
	// 5.4% of a CPU over 16 merged idle VMs (docs/performance.md).
	KSMPagesToScan *int32 `json:"ksmPagesToScan,omitempty"`
	// TransparentHugePages says whether the VMs' QEMUs may have the
	// kernel's transparent huge pages: Auto (default: disabled when the
	// node's VMs run under TCG, the kernel's choice under KVM), Enabled
	// (the kernel's choice: its transparent_hugepage mode, for which QEMU
	// asks for huge pages for guest RAM) or Disabled. Disabling is process
	// wide (prctl PR_SET_THP_DISABLE on the agent, which its QEMUs
	// inherit): the agent's own memory has no huge pages either.
	TransparentHugePages string `json:"transparentHugePages,omitempty"`
}

// vmMemory.transparentHugePages values.
const (
	// THPAuto: disabled for the VMs under TCG, the kernel's choice under
	// KVM (provider.DecideTHP).
	THPAuto = "Auto"
	// THPEnabled: the kernel's choice (its transparent_hugepage mode).
	THPEnabled = "Enabled"
	// THPDisabled: no transparent huge pages for the VMs' QEMUs.
	THPDisabled = "Disabled"
)

// Overcommit ratios (>= 1 means more than the host has, < 1 holds back).
type Overcommit struct {
	CPU    *float64 `json:"cpu,omitempty"`
	Memory *float64 `json:"memory,omitempty"`
}

// Accelerator configures the KVM probe.
type Firmware struct {
	// UEFICode is the OVMF code image (read-only, shared by every VM) and
	// UEFIVars the variable-store template each VM gets a copy of. Both or
	// neither; absolute paths. Absent: the first pair of DefaultOVMF that
	// exists on the host (Debian's ovmf package); none: UEFI pods are
	// refused (FirmwareUnavailable).
	UEFICode string `json:"uefiCode,omitempty"`
	UEFIVars string `json:"uefiVars,omitempty"`
}

type Accelerator struct {
	// Policy is require-kvm, prefer-kvm (default) or tcg.
	Policy string `json:"policy,omitempty"`
	// ProbeTimeout bounds the probe VM start (duration, default 30s).
	ProbeTimeout string `json:"probeTimeout,omitempty"`
}

// Server configures the kubelet API server.
type Server struct {
	// Address to listen on (default 0.0.0.0).
	Address string `json:"address,omitempty"`
	// Port to listen on (default 10250); published as the node's
	// daemonEndpoints.kubeletEndpoint.Port.
	Port *int32 `json:"port,omitempty"`
	// TLSCertFile and TLSPrivateKeyFile are the serving certificate and key
	// (PEM). Both empty: a self-signed pair is generated into
	// <stateDir>/pki, like the kubelet does.
	TLSCertFile       string `json:"tlsCertFile,omitempty"`
	TLSPrivateKeyFile string `json:"tlsPrivateKeyFile,omitempty"`
	// ClientCAFile is the CA bundle (PEM) that verifies client certificates,
	// e.g. the API server's kubelet client certificate. Empty: only bearer
	// tokens authenticate (through TokenReview).
	ClientCAFile string `json:"clientCAFile,omitempty"`
}

// PressureThresholds are the "available" levels under which a pressure
// condition turns True. Each is a quantity ("500Mi") or a percentage of the
// total ("10%"); "0" disables the condition.
type PressureThresholds struct {
	// MemoryAvailable against /proc/meminfo MemAvailable (default 100Mi).
	MemoryAvailable QuantityString `json:"memoryAvailable,omitempty"`
	// DiskAvailable against the free space of stateDir (default 10%).
	DiskAvailable QuantityString `json:"diskAvailable,omitempty"`
	// PIDAvailable against pid_max minus the processes running (default 5%).
	PIDAvailable QuantityString `json:"pidAvailable,omitempty"`
}

// QuantityString is a quantity or percentage kept as written; it accepts a
// YAML string ("1Gi") or a bare number (2), which quantities commonly are.
type QuantityString string

// UnmarshalJSON accepts a JSON string or number.
func (q *QuantityString) UnmarshalJSON(b []byte) error {
	s := strings.TrimSpace(string(b))
	if strings.HasPrefix(s, `"`) {
		var v string
		if err := json.Unmarshal(b, &v); err != nil {
			return err
		}
		*q = QuantityString(v)
		return nil
	}
	var n json.Number
	if err := json.Unmarshal(b, &n); err != nil {
		return fmt.Errorf("want a quantity string or number, got %s", s)
	}
	*q = QuantityString(n.String())
	return nil
}
