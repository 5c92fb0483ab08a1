// Package v1alpha1 holds the Go types of the qemu-kubelet.io/v1alpha1 API
// group (ExporterSet), annotated with kubebuilder markers from which the CRDs
// are generated.
//
// +groupName=qemu-kubelet.io
package v1alpha1
