// Package v1alpha1 holds Go types of Jumpstarter's own ExporterSet API, the
// virtualtarget.jumpstarter.dev/v1alpha1 group of upstream's JEP-0014:
// ExporterSet and VirtualTargetClass, with JSON names, types, enums,
// defaults, validations, status fields, printer columns and the scale
// subresource as in upstream's CRDs (jumpstarter-dev/jumpstarter
// controller/api/virtualtarget/v1alpha1 at b1f2bb41).
//
// Upstream designed the API for several backends: a VirtualTargetClass
// names a provisioner, and each provisioner's controller reconciles only
// the sets whose class names it. This project is one such provisioner
// (DefaultProvisioner); the types let its controller read sets and
// classes and write set status with the compiler's help.
//
// The kinds share their names with the project's own qemu-kubelet.io
// ExporterSet and VirtualTargetClass (package api/v1alpha1): import this
// package under a name that says which, such as vtv1alpha1.
//
// Jumpstarter owns these CRDs: a cluster gets them from Jumpstarter's
// operator. hack/gen-crds.sh generates from these types the deepcopy
// functions and, for the tests only, config/virtualtarget/crd, so that the
// tests need nothing beside the repository. When upstream's CRDs are beside
// the repository ($QK_JUMPSTARTER_CRDS; testutil.UpstreamJumpstarterCRDs), a
// test checks that the generated schema is a faithful subset of upstream's.
//
// +kubebuilder:object:generate=true
// +groupName=virtualtarget.jumpstarter.dev
package v1alpha1
