package v1alpha1

import (
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// RecycleStrategy says what becomes of an instance whose lease ended.
// +kubebuilder:validation:Enum=ExitAndReplace;InPlaceReuse
type RecycleStrategy string

const (
	// RecycleStrategyExitAndReplace ends the instance at lease end (the exporter
	// runs with exitOnLeaseEnd) and the set replaces it: every lease gets
	// a fresh target. The default.
	RecycleStrategyExitAndReplace RecycleStrategy = "ExitAndReplace"
	// RecycleStrategyInPlaceReuse keeps the instance for the next lease.
	RecycleStrategyInPlaceReuse RecycleStrategy = "InPlaceReuse"
)

// Condition types of an ExporterSet's status, as upstream's reconciler
// writes them.
const (
	// ExporterSetConditionAvailable: the set has its minimum of ready instances.
	ExporterSetConditionAvailable = "Available"
	// ExporterSetConditionProgressing: the set is scaling or replacing instances.
	ExporterSetConditionProgressing = "Progressing"
	// ExporterSetConditionDegraded: instances fail or stay offline.
	ExporterSetConditionDegraded = "Degraded"
	// ExporterSetConditionScalingLimited: a limit (maxReplicas) holds scaling back.
	ExporterSetConditionScalingLimited = "ScalingLimited"
)

// DefaultMaxReplicas is the CRD's default of spec.maxReplicas.
const DefaultMaxReplicas int32 = 4

// DriverConfig is one entry of an exporter's driver map (the ExporterConfig
// export key Name): a driver class with its config, or a reference to a
// child driver surfaced at the root.
//
// +kubebuilder:validation:XValidation:rule="has(self.type) || has(self.ref)",message="either type or ref must be set"
// +kubebuilder:validation:XValidation:rule="!(has(self.type) && has(self.ref))",message="type and ref are mutually exclusive"
// +kubebuilder:validation:XValidation:rule="!has(self.ref) || !has(self.config)",message="ref entries must not have config"
// +kubebuilder:validation:XValidation:rule="has(self.name) && size(self.name) > 0",message="name is required"
type DriverConfig struct {
	// Name is the driver's key in the exporter's export map.
	Name string `json:"name"`
	// Type is the driver's fully qualified Python class name.
	// +kubebuilder:validation:MinLength=1
	// +optional
	Type string `json:"type,omitempty"`
	// Ref is a dot-separated path to a nested child driver, surfaced at
	// the root under Name.
	// +kubebuilder:validation:Pattern=`^[^.]+([.][^.]+)*$`
	// +optional
	Ref string `json:"ref,omitempty"`
	// Config is the driver's own configuration object.
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Schemaless
	// +kubebuilder:validation:Type=object
	// +optional
	Config *apiextv1.JSON `json:"config,omitempty"`
}

// ExporterTemplateSpec is the exporter configuration of a set's template.
type ExporterTemplateSpec struct {
	// Drivers is each instance's driver map.
	// +optional
	Drivers []DriverConfig `json:"drivers,omitempty"`
}

// TemplateMetadata is the metadata a set puts on the Exporters it creates.
type TemplateMetadata struct {
	// +optional
	Labels map[string]string `json:"labels,omitempty"`
	// +optional
	Annotations map[string]string `json:"annotations,omitempty"`
}

// ExporterSetTemplate describes the exporters of a set's instances.
type ExporterSetTemplate struct {
	// Metadata for the created Exporters. Leases select on these labels.
	// +optional
	Metadata TemplateMetadata `json:"metadata,omitempty"`
	// Spec is the exporters' configuration.
	// +optional
	Spec ExporterTemplateSpec `json:"spec,omitempty"`
}

// ExporterSetSpec is the desired state of an upstream ExporterSet.
//
// +kubebuilder:validation:XValidation:rule="self.maxReplicas == 0 || self.minReplicas <= self.maxReplicas",message="minReplicas must be less than or equal to maxReplicas (when maxReplicas is not 0)"
// +kubebuilder:validation:XValidation:rule="self.maxReplicas == 0 || self.minAvailableReplicas <= self.maxReplicas",message="minAvailableReplicas must be less than or equal to maxReplicas (when maxReplicas is not 0)"
type ExporterSetSpec struct {
	// MinReplicas is the floor of instances.
	// +kubebuilder:default=0
	// +kubebuilder:validation:Minimum=0
	// +optional
	MinReplicas int32 `json:"minReplicas,omitempty"`
	// MaxReplicas is the ceiling of instances, 0 meaning none. The scale
	// subresource points here.
	// +kubebuilder:default=4
	// +kubebuilder:validation:Minimum=0
	// +optional
	MaxReplicas *int32 `json:"maxReplicas,omitempty"`
	// MinAvailableReplicas is the warm buffer: ready, unleased instances
	// the set keeps.
	// +kubebuilder:default=0
	// +kubebuilder:validation:Minimum=0
	// +optional
	MinAvailableReplicas int32 `json:"minAvailableReplicas,omitempty"`
	// ScaleDownCooldown is how long surplus instances stay before the set
	// scales down.
	// +kubebuilder:default="5m"
	// +optional
	ScaleDownCooldown *metav1.Duration `json:"scaleDownCooldown,omitempty"`
	// RecycleStrategy says what becomes of an instance at lease end.
	// +kubebuilder:default=ExitAndReplace
	// +optional
	RecycleStrategy RecycleStrategy `json:"recycleStrategy,omitempty"`
	// VirtualTargetClassName names a VirtualTargetClass of the namespace;
	// its provisioner serves the set.
	// +kubebuilder:validation:MinLength=1
	VirtualTargetClassName string `json:"virtualTargetClassName"`
	// Parameters are deep-merged over the class's parameters.
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Schemaless
	// +optional
	Parameters *apiextv1.JSON `json:"parameters,omitempty"`
	// Images override the provisioner's and the class's container images.
	// +optional
	Images *ImageOverrides `json:"images,omitempty"`
	// Selector matches the Exporters the set owns.
	Selector metav1.LabelSelector `json:"selector"`
	// Template describes the Exporters the set creates.
	Template ExporterSetTemplate `json:"template"`
}

// Ceiling is the most instances the spec allows: bounded is false when
// maxReplicas is 0 (no ceiling). MaxReplicas is a pointer, unlike
// upstream's int32, so that an explicit 0 survives serialization instead of
// being dropped and defaulted to 4; nil means that default,
// DefaultMaxReplicas.
func (s *ExporterSetSpec) Ceiling() (n int32, bounded bool) {
	n = DefaultMaxReplicas
	if s.MaxReplicas != nil {
		n = *s.MaxReplicas
	}
	return n, n != 0
}

// ExporterSetStatus is the observed state of an upstream ExporterSet. The
// counts are required in upstream's schema: a status write carries them
// all.
type ExporterSetStatus struct {
	// Replicas counts the set's exporter instances.
	Replicas int32 `json:"replicas"`
	// ReadyReplicas counts instances online and registered.
	ReadyReplicas int32 `json:"readyReplicas"`
	// AvailableReplicas counts ready, enabled, unleased instances.
	AvailableReplicas int32 `json:"availableReplicas"`
	// UnavailableReplicas counts enabled instances not yet ready.
	UnavailableReplicas int32 `json:"unavailableReplicas"`
	// LeasedReplicas counts leased instances.
	LeasedReplicas int32 `json:"leasedReplicas"`
	// PodsPending counts the set's pods in phase Pending.
	PodsPending int32 `json:"podsPending"`
	// PodsRunning counts the set's pods in phase Running.
	PodsRunning int32 `json:"podsRunning"`
	// PodsFailed counts the set's pods in phase Failed.
	PodsFailed int32 `json:"podsFailed"`
	// PodsUnknown counts the set's pods in phase Unknown or Succeeded.
	PodsUnknown int32 `json:"podsUnknown"`
	// ExportersActive counts exporters serving a lease.
	ExportersActive int32 `json:"exportersActive"`
	// ExportersIdle counts online, enabled, unleased exporters.
	ExportersIdle int32 `json:"exportersIdle"`
	// ExportersDisabled counts exporters with spec.enabled false.
	ExportersDisabled int32 `json:"exportersDisabled"`
	// ExportersOffline counts enabled exporters not online.
	ExportersOffline int32 `json:"exportersOffline"`
	// Selector is the label selector of the set's instances, serialized,
	// for the scale subresource (HPA).
	// +optional
	Selector string `json:"selector,omitempty"`
	// Conditions of types ExporterSetConditionAvailable, -Progressing,
	// -Degraded and -ScalingLimited.
	// +optional
	Conditions []metav1.Condition `json:"conditions,omitempty"`
}

// ExporterSet is upstream Jumpstarter's scalable set of virtual exporter
// instances, served by the provisioner its VirtualTargetClass names.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Namespaced
// +kubebuilder:subresource:status
// +kubebuilder:subresource:scale:specpath=.spec.maxReplicas,statuspath=.status.replicas,selectorpath=.status.selector
// +kubebuilder:printcolumn:name="Replicas",type=integer,JSONPath=`.status.replicas`
// +kubebuilder:printcolumn:name="Ready",type=integer,JSONPath=`.status.readyReplicas`
// +kubebuilder:printcolumn:name="Available",type=integer,JSONPath=`.status.availableReplicas`
// +kubebuilder:printcolumn:name="Unavailable",type=integer,JSONPath=`.status.unavailableReplicas`
// +kubebuilder:printcolumn:name="Leased",type=integer,JSONPath=`.status.leasedReplicas`
// +kubebuilder:printcolumn:name="Class",type=string,JSONPath=`.spec.virtualTargetClassName`
type ExporterSet struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +optional
	Spec ExporterSetSpec `json:"spec,omitempty"`
	// +optional
	Status ExporterSetStatus `json:"status,omitempty"`
}

// ExporterSetList is a list of upstream ExporterSets.
//
// +kubebuilder:object:root=true
type ExporterSetList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ExporterSet `json:"items"`
}

func init() {
	SchemeBuilder.Register(&ExporterSet{}, &ExporterSetList{})
}
