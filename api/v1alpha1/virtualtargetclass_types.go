package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Annotations the ExporterSet controller puts on the pods of a set that
// names a class or has parameters.
const (
	// ParametersAnnotation holds the set's effective parameters (the class's
	// deep-merged with the set's) as compact JSON with sorted keys. The
	// controller also gives the pod's first container the environment
	// variable ParametersEnv from it, so the guest reads them from its
	// environment disk (label ENV, files env and env.json).
	ParametersAnnotation = "qemu-kubelet.io/parameters"
	// ParametersEnv is the environment variable that carries
	// ParametersAnnotation into the guest.
	ParametersEnv = "QK_PARAMETERS"
	// ReclaimPolicyAnnotation is on the pods of a set whose class has
	// reclaimPolicy Retain (value "Retain"): the node keeps such a pod's
	// disk when the pod goes (docs/pods.md, "State preservation"). Absent
	// means Delete. Anyone may set it on a pod; the node reads it when the
	// pod is deleted.
	ReclaimPolicyAnnotation = "qemu-kubelet.io/reclaim-policy"
	// StatePolicyAnnotation is on the pods of a set whose effective
	// statePolicy is Retain (value "Retain"): the node keeps the pod's disk
	// across VM restarts. Absent means Disabled. Anyone may set it on a
	// pod; the node reads it when the pod is created.
	StatePolicyAnnotation = "qemu-kubelet.io/state-policy"
)

// StatePolicy says whether a pod's disk (its writable overlay over the OS
// image) survives the restarts of its VM.
// +kubebuilder:validation:Enum=Disabled;Retain
type StatePolicy string

const (
	// StatePolicyDisabled gives every VM start a fresh disk over the image,
	// as a container starts from its image (the default).
	StatePolicyDisabled StatePolicy = "Disabled"
	// StatePolicyRetain keeps the pod's disk while the pod lives: VM
	// restarts (restart policy, power off and on), guest reboots and node
	// agent restarts boot from the disk as the guest left it, and so do
	// leases of a set that recycles pods with Reuse. A flashed image, or an
	// image whose digest changed, starts a fresh disk.
	StatePolicyRetain StatePolicy = "Retain"
)

// BindingMode says when the pods of a set of the class are created.
// +kubebuilder:validation:Enum=Immediate;WaitForFirstConsumer
type BindingMode string

const (
	// BindingModeImmediate keeps warm VMs: the set's target is
	// max(replicas, leased + pending + minAvailable), capped by maxReplicas.
	BindingModeImmediate BindingMode = "Immediate"
	// BindingModeWaitForFirstConsumer creates a VM only when a lease waits:
	// the set's replicas and minAvailable count as 0, so the target is
	// min(leased + pending, maxReplicas). It needs a lease source with
	// pending leases (Jumpstarter mode).
	BindingModeWaitForFirstConsumer BindingMode = "WaitForFirstConsumer"
)

// ReclaimPolicy says what happens to a pod's disk when the pod goes.
// +kubebuilder:validation:Enum=Delete;Retain
type ReclaimPolicy string

const (
	// ReclaimPolicyDelete removes a pod's disk with the pod.
	ReclaimPolicyDelete ReclaimPolicy = "Delete"
	// ReclaimPolicyRetain has the node keep a pod's disk after the pod
	// went: a standalone copy under the node's state dir
	// (<stateDir>/retained/<namespace>_<pod>_<uid>/), counted against the
	// node's ephemeral-storage until an admin removes it.
	ReclaimPolicyRetain ReclaimPolicy = "Retain"
)

// VirtualTargetClassSpec is what an admin defines once for the ExporterSets
// of a namespace: parameters, scheduling and pod defaults, binding and
// reclaim policy, Jumpstarter connection defaults.
type VirtualTargetClassSpec struct {
	// Parameters is a free-form object handed to the VMs of the class's
	// sets. A set's own spec.parameters are deep-merged over it: objects
	// merge key by key, recursively; a list, a scalar or a type change in
	// the set's parameters replaces the class's value; a null in the set's
	// parameters removes the key. The result is the pods' annotation
	// qemu-kubelet.io/parameters and the guest's environment variable
	// QK_PARAMETERS.
	// +optional
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Type=object
	Parameters *runtime.RawExtension `json:"parameters,omitempty"`

	// Scheduling are defaults for where the pods run.
	// +optional
	Scheduling *ClassScheduling `json:"scheduling,omitempty"`

	// PodDefaults are defaults for the pods' VM container (the first one).
	// +optional
	PodDefaults *ClassPodDefaults `json:"podDefaults,omitempty"`

	// BindingMode says when pods are created: Immediate (default) keeps
	// warm VMs as the set's replicas and minAvailable ask;
	// WaitForFirstConsumer creates a VM only when a lease waits for one
	// (replicas and minAvailable count as 0: the target is leased +
	// pending leases, capped by maxReplicas). WaitForFirstConsumer needs
	// Jumpstarter mode: with label leases a pod is claimed after it exists,
	// so nothing would ever ask for one.
	// +optional
	// +kubebuilder:default=Immediate
	BindingMode BindingMode `json:"bindingMode,omitempty"`

	// ReclaimPolicy says what happens to a pod's disk when the pod goes:
	// Delete (default) or Retain (the node keeps a standalone copy under
	// its state dir's retained/ area; the pods carry the annotation
	// qemu-kubelet.io/reclaim-policy=Retain).
	// +optional
	// +kubebuilder:default=Delete
	ReclaimPolicy ReclaimPolicy `json:"reclaimPolicy,omitempty"`

	// StatePolicy is the default of the class's sets for whether a pod's
	// disk survives its VM's restarts: Disabled (a fresh disk at every VM
	// start) or Retain. A set's own spec.statePolicy wins. Pods with
	// Retain carry the annotation qemu-kubelet.io/state-policy=Retain.
	// +optional
	StatePolicy StatePolicy `json:"statePolicy,omitempty"`

	// Jumpstarter, when set, makes every set of the class a pool of
	// Jumpstarter exporters (as the set's own spec.jumpstarter does) and
	// gives connection defaults: a set's endpoint and caBundle win when
	// set, its exporterLabels are merged over these (the set's win per key).
	// +optional
	Jumpstarter *ClassJumpstarter `json:"jumpstarter,omitempty"`
}

// ClassScheduling are scheduling defaults of a class. The set's own
// template wins: nodeSelector keys merge (the set's value wins), the
// class's tolerations are added to the set's, resources fill the requests
// and limits the VM container does not set, runtimeClassName and
// topologySpreadConstraints apply when the set's template has none.
type ClassScheduling struct {
	// NodeSelector is merged under the template's nodeSelector.
	// +optional
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`
	// Tolerations are added to the template's (duplicates left out).
	// +optional
	// +listType=atomic
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`
	// Resources fill the requests and limits (per resource name) that the
	// VM container does not set.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
	// RuntimeClassName applies when the template has none.
	// +optional
	// +kubebuilder:validation:MaxLength=253
	RuntimeClassName *string `json:"runtimeClassName,omitempty"`
	// TopologySpreadConstraints apply when the template has none.
	// +optional
	// +listType=atomic
	TopologySpreadConstraints []corev1.TopologySpreadConstraint `json:"topologySpreadConstraints,omitempty"`
}

// ClassPodDefaults are defaults for the VM container (the template's first
// container; a template without containers gets one named "vm") and the
// pod. Each applies when the set's template leaves it unset.
type ClassPodDefaults struct {
	// Image is the OS image of the VM container.
	// +optional
	// +kubebuilder:validation:MaxLength=4096
	Image string `json:"image,omitempty"`
	// TerminationGracePeriodSeconds is the pod's grace period.
	// +optional
	// +kubebuilder:validation:Minimum=0
	TerminationGracePeriodSeconds *int64 `json:"terminationGracePeriodSeconds,omitempty"`
	// ReadinessProbe of the VM container.
	// +optional
	ReadinessProbe *corev1.Probe `json:"readinessProbe,omitempty"`
	// LivenessProbe of the VM container.
	// +optional
	LivenessProbe *corev1.Probe `json:"livenessProbe,omitempty"`
	// StartupProbe of the VM container.
	// +optional
	StartupProbe *corev1.Probe `json:"startupProbe,omitempty"`
}

// ClassJumpstarter are Jumpstarter connection defaults of a class (the
// fields of an ExporterSet's spec.jumpstarter).
type ClassJumpstarter struct {
	// Endpoint is the Jumpstarter controller's gRPC endpoint (host:port).
	// +optional
	// +kubebuilder:validation:MaxLength=253
	Endpoint string `json:"endpoint,omitempty"`
	// CABundle is a PEM bundle of the CA certificates of the Jumpstarter
	// controller and router.
	// +optional
	// +kubebuilder:validation:MaxLength=65536
	CABundle string `json:"caBundle,omitempty"`
	// ExporterLabels are labels of every Exporter of the class's sets.
	// +optional
	// +kubebuilder:validation:MaxProperties=32
	// +kubebuilder:validation:XValidation:rule="self.all(k, !k.startsWith('qemu-kubelet.io/'))",message="spec.jumpstarter.exporterLabels must not use the qemu-kubelet.io/ prefix"
	ExporterLabels map[string]string `json:"exporterLabels,omitempty"`
	// LeaseStatePolicy is the default of the class's sets for what a lease
	// leaves for the next one: Reset (default) or Keep.
	// +optional
	LeaseStatePolicy LeaseStatePolicy `json:"leaseStatePolicy,omitempty"`
	// Hooks are the default lease hooks of the class's sets (a set's own
	// hooks replace them).
	// +optional
	Hooks *LeaseHooks `json:"hooks,omitempty"`
}

// The short name vtc stays for the reason ExporterSet keeps exs: upstream
// Jumpstarter's VirtualTargetClass shares the kind and plural, declares no
// short name, and loses plain-name lookups to this group either way.

// VirtualTargetClass is a namespaced class of virtual targets: parameters
// and defaults an ExporterSet of the namespace takes by naming it in
// spec.className.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:shortName=vtc,categories=all
// +kubebuilder:printcolumn:name="Binding",type=string,JSONPath=`.spec.bindingMode`,description="When pods are created: Immediate or WaitForFirstConsumer"
// +kubebuilder:printcolumn:name="Reclaim",type=string,JSONPath=`.spec.reclaimPolicy`,description="What happens to a pod's disk when it goes"
// +kubebuilder:printcolumn:name="State",type=string,JSONPath=`.spec.statePolicy`,priority=1,description="Whether a pod's disk survives VM restarts"
// +kubebuilder:printcolumn:name="Age",type=date,JSONPath=`.metadata.creationTimestamp`
type VirtualTargetClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// Spec is the class.
	Spec VirtualTargetClassSpec `json:"spec"`
}

// VirtualTargetClassList is a list of VirtualTargetClasses.
//
// +kubebuilder:object:root=true
type VirtualTargetClassList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []VirtualTargetClass `json:"items"`
}

func init() {
	SchemeBuilder.Register(&VirtualTargetClass{}, &VirtualTargetClassList{})
}
