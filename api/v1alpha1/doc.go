// Package v1alpha1 holds the Go types of the qemu-kubelet.io/v1alpha1 API
// group (ExporterSet, VirtualTargetClass), annotated with kubebuilder markers from which
// hack/gen-crds.sh generates the deepcopy functions and the CRDs in
// config/crd.
//
// +kubebuilder:object:generate=true
// +groupName=qemu-kubelet.io
package v1alpha1
