package v1alpha1

import (
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BindingMode says when a class's instances are provisioned.
// +kubebuilder:validation:Enum=Immediate;WaitForFirstConsumer
type BindingMode string

const (
	// BindingModeImmediate keeps a warm pool (the default).
	BindingModeImmediate BindingMode = "Immediate"
	// BindingModeWaitForFirstConsumer provisions on a lease request.
	BindingModeWaitForFirstConsumer BindingMode = "WaitForFirstConsumer"
)

// ReclaimPolicy says what becomes of a virtual target after its lease.
// +kubebuilder:validation:Enum=Delete;Retain
type ReclaimPolicy string

const (
	// ReclaimPolicyDelete destroys the target (the default).
	ReclaimPolicyDelete ReclaimPolicy = "Delete"
	// ReclaimPolicyRetain keeps it, for debugging.
	ReclaimPolicyRetain ReclaimPolicy = "Retain"
)

// SchedulingSpec is the placement the class gives its pods.
type SchedulingSpec struct {
	// +optional
	NodeSelector map[string]string `json:"nodeSelector,omitempty"`
	// +optional
	Tolerations []corev1.Toleration `json:"tolerations,omitempty"`
	// Resources of the rendered pods.
	// +optional
	Resources *corev1.ResourceRequirements `json:"resources,omitempty"`
}

// CABundleRef names a ConfigMap key of PEM CA certificates that pods
// trust.
type CABundleRef struct {
	// Name of the ConfigMap.
	// +kubebuilder:validation:MinLength=1
	Name string `json:"name"`
	// Key in the ConfigMap.
	// +kubebuilder:default="ca-bundle.crt"
	// +optional
	Key string `json:"key,omitempty"`
}

// ImageSpec is a container image and its pull policy.
type ImageSpec struct {
	// Image is the reference, such as quay.io/org/repo:tag.
	// +optional
	Image string `json:"image,omitempty"`
	// +kubebuilder:validation:Enum=Always;Never;IfNotPresent
	// +optional
	ImagePullPolicy corev1.PullPolicy `json:"imagePullPolicy,omitempty"`
}

// ImageOverrides replace a provisioner's default container images; a
// set's take precedence over its class's.
type ImageOverrides struct {
	// Exporter is the exporter container's image.
	// +optional
	Exporter *ImageSpec `json:"exporter,omitempty"`
	// Runtime is the provisioner's runtime image (upstream's QEMU
	// sidecar for qemu.jumpstarter.dev).
	// +optional
	Runtime *ImageSpec `json:"runtime,omitempty"`
}

// VirtualTargetClassSpec is a backend profile for the sets that name the
// class.
type VirtualTargetClassSpec struct {
	// Provisioner names the controller that serves the class's sets
	// (DefaultProvisioner for this project's).
	// +kubebuilder:validation:MinLength=1
	Provisioner string `json:"provisioner"`
	// CredentialsSecretRef names a Secret of the namespace for
	// API-backed provisioners.
	// +optional
	CredentialsSecretRef *corev1.LocalObjectReference `json:"credentialsSecretRef,omitempty"`
	// Parameters are the provisioner's settings; a set's parameters are
	// deep-merged over them.
	// +kubebuilder:pruning:PreserveUnknownFields
	// +kubebuilder:validation:Schemaless
	// +optional
	Parameters *apiextv1.JSON `json:"parameters,omitempty"`
	// +kubebuilder:default=Immediate
	// +optional
	BindingMode BindingMode `json:"bindingMode,omitempty"`
	// +kubebuilder:default=Delete
	// +optional
	ReclaimPolicy ReclaimPolicy `json:"reclaimPolicy,omitempty"`
	// +optional
	Scheduling *SchedulingSpec `json:"scheduling,omitempty"`
	// CABundleConfigMapRef: CA certificates the pods trust.
	// +optional
	CABundleConfigMapRef *CABundleRef `json:"caBundleConfigMapRef,omitempty"`
	// Images: defaults below a set's own.
	// +optional
	Images *ImageOverrides `json:"images,omitempty"`
}

// VirtualTargetClass is upstream Jumpstarter's namespaced backend profile
// for ExporterSets: the provisioner that serves them and its parameters.
//
// +kubebuilder:object:root=true
// +kubebuilder:resource:scope=Namespaced
// +kubebuilder:printcolumn:name="Provisioner",type=string,JSONPath=`.spec.provisioner`
// +kubebuilder:printcolumn:name="Binding",type=string,JSONPath=`.spec.bindingMode`
type VirtualTargetClass struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	// +optional
	Spec VirtualTargetClassSpec `json:"spec,omitempty"`
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
