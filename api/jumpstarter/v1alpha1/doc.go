// Package v1alpha1 holds minimal Go types of Jumpstarter's jumpstarter.dev/v1alpha1
// API group: the Exporter and Lease fields the ExporterSet controller reads
// and writes, with JSON names, defaults and validations exactly as in
// Jumpstarter's CRDs (upstream jumpstarter-dev/jumpstarter
// controller/api/v1alpha1 at b1f2bb41). Fields not listed here are
// preserved by the API server on updates only when written with patches:
// the controller patches, never updates, Jumpstarter objects it did not
// create.
//
// Jumpstarter owns these CRDs: a cluster gets them from Jumpstarter's own
// installation. hack/gen-crds.sh generates from these types the deepcopy
// functions and, for the tests only, config/jumpstarter/crd: the subset of
// Jumpstarter's schema this project writes and reads, so that the tests
// need nothing beside the repository. When upstream's CRDs are beside the
// repository ($QK_JUMPSTARTER_CRDS; testutil.UpstreamJumpstarterCRDs), tests
// check that the generated schema is a faithful subset of upstream's and
// that upstream's API server accepts what the project writes.
//
// The package also holds ExporterConfig, the exporter configuration file
// (kind ExporterConfig of the same group version) that upstream's
// ExporterSet reconciler writes into a Secret per exporter: a file format,
// not an API resource, so no CRD.
//
// Typed rather than unstructured: the planner and tests read the fields
// with the compiler's help, and controller-runtime caches and watches them
// like any built-in type.
//
// +kubebuilder:object:generate=true
// +groupName=jumpstarter.dev
package v1alpha1
