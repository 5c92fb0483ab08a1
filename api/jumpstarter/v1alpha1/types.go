package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is Jumpstarter's API group and version.
	GroupVersion = schema.GroupVersion{Group: "jumpstarter.dev", Version: "v1alpha1"}

	// SchemeBuilder registers Exporter and Lease with a scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds Exporter and Lease to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Condition types and reasons used by Jumpstarter's controller.
const (
	ExporterConditionOnline     = "Online"
	ExporterConditionRegistered = "Registered"
	LeaseConditionReady         = "Ready"
	LeaseConditionPending       = "Pending"
	LeaseConditionUnsatisfiable = "Unsatisfiable"
)

// ExporterSpec is the desired state of an Exporter.
type ExporterSpec struct {
	// Username is the exporter's identity for authentication.
	// +optional
	Username *string `json:"username,omitempty"`
	// Enabled: a disabled exporter gets no new selector lease. Nil means
	// true (the CRD defaults it).
	// +kubebuilder:default=true
	// +optional
	Enabled *bool `json:"enabled,omitempty"`
}

// ExporterStatus is the observed state of an Exporter, written by
// Jumpstarter's controller.
type ExporterStatus struct {
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// Credential names the Secret (key token) of the exporter's token.
	// +optional
	Credential *corev1.LocalObjectReference `json:"credential,omitempty"`
	// LeaseRef names the Lease assigned to the exporter.
	// +optional
	LeaseRef *corev1.LocalObjectReference `json:"leaseRef,omitempty"`
	// LastSeen is when the exporter last talked to the controller.
	// +optional
	LastSeen metav1.Time `json:"lastSeen,omitempty"`
	// Endpoint is the controller's gRPC endpoint for this exporter.
	// +optional
	Endpoint string `json:"endpoint,omitempty"`
	// ExporterStatusValue is the status the exporter reports.
	// +kubebuilder:validation:Enum=Unspecified;Offline;Available;BeforeLeaseHook;LeaseReady;AfterLeaseHook;BeforeLeaseHookFailed;AfterLeaseHookFailed
	// +optional
	ExporterStatusValue string `json:"exporterStatus,omitempty"`
	// +optional
	StatusMessage string `json:"statusMessage,omitempty"`
}

// Exporter is a Jumpstarter exporter.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced
type Exporter struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ExporterSpec   `json:"spec,omitempty"`
	Status ExporterStatus `json:"status,omitempty"`
}

// IsEnabled reports spec.enabled, nil meaning true.
func (e *Exporter) IsEnabled() bool { return e.Spec.Enabled == nil || *e.Spec.Enabled }

// ExporterList is a list of Exporters.
//
// +kubebuilder:object:root=true
type ExporterList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Exporter `json:"items"`
}

// LeaseSpec is the desired state of a Lease.
//
// +kubebuilder:validation:XValidation:rule="((has(self.selector.matchLabels) && size(self.selector.matchLabels) > 0) || (has(self.selector.matchExpressions) && size(self.selector.matchExpressions) > 0)) || (has(self.exporterRef) && has(self.exporterRef.name) && size(self.exporterRef.name) > 0)",message="one of selector or exporterRef.name is required"
type LeaseSpec struct {
	// ClientRef names the Client that asked for the lease.
	ClientRef corev1.LocalObjectReference `json:"clientRef"`
	// Selector selects the exporters the lease may land on.
	// +kubebuilder:default={}
	Selector metav1.LabelSelector `json:"selector"`
	// ExporterRef, when set, asks for one exporter by name.
	// +optional
	ExporterRef *corev1.LocalObjectReference `json:"exporterRef,omitempty"`
	// +optional
	Duration *metav1.Duration `json:"duration,omitempty"`
	// BeginTime: a scheduled lease is not assigned before it.
	// +optional
	BeginTime *metav1.Time `json:"beginTime,omitempty"`
	// +optional
	EndTime *metav1.Time `json:"endTime,omitempty"`
	// Release asks the controller to end the lease.
	// +optional
	Release bool `json:"release,omitempty"`
}

// LeaseStatus is the observed state of a Lease.
type LeaseStatus struct {
	// +optional
	BeginTime *metav1.Time `json:"beginTime,omitempty"`
	// +optional
	EndTime *metav1.Time `json:"endTime,omitempty"`
	// ExporterRef names the exporter the lease landed on.
	// +optional
	ExporterRef *corev1.LocalObjectReference `json:"exporterRef,omitempty"`
	// Ended is true once the lease is over (released, expired or
	// unsatisfiable).
	Ended bool `json:"ended"`
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// Lease is a client's request for, and hold on, one exporter.
//
// +kubebuilder:object:root=true
// +kubebuilder:subresource:status
// +kubebuilder:resource:scope=Namespaced
type Lease struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   LeaseSpec   `json:"spec,omitempty"`
	Status LeaseStatus `json:"status,omitempty"`
}

// LeaseList is a list of Leases.
//
// +kubebuilder:object:root=true
type LeaseList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []Lease `json:"items"`
}

func init() {
	SchemeBuilder.Register(&Exporter{}, &ExporterList{}, &Lease{}, &LeaseList{})
}
