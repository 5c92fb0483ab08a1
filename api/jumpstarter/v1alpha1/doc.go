// Package v1alpha1 holds minimal Go types of Jumpstarter's jumpstarter.dev/v1alpha1
// API group: the Exporter and Lease fields the ExporterSet controller reads
// and writes, with JSON names exactly as in Jumpstarter's CRDs
// (../shared/jumpstarter/crds, upstream jumpstarter-dev/jumpstarter
// controller/api/v1alpha1 at b1f2bb41). Jumpstarter owns these CRDs; this
// project generates only their deepcopy functions (hack/gen-crds.sh), never
// CRDs. Fields not listed here are preserved by the API server on updates
// only when written with patches: the controller patches, never updates,
// Jumpstarter objects it did not create.
//
// Typed rather than unstructured: the planner and tests read the fields
// with the compiler's help, and controller-runtime caches and watches them
// like any built-in type.
//
// +kubebuilder:object:generate=true
package v1alpha1
