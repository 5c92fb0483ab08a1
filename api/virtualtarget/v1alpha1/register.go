package v1alpha1

import (
	"k8s.io/apimachinery/pkg/runtime/schema"
	"sigs.k8s.io/controller-runtime/pkg/scheme"
)

var (
	// GroupVersion is upstream Jumpstarter's ExporterSet API group and
	// version.
	GroupVersion = schema.GroupVersion{Group: "virtualtarget.jumpstarter.dev", Version: "v1alpha1"}

	// SchemeBuilder registers ExporterSet and VirtualTargetClass with a
	// scheme.
	SchemeBuilder = &scheme.Builder{GroupVersion: GroupVersion}

	// AddToScheme adds ExporterSet and VirtualTargetClass to a scheme.
	AddToScheme = SchemeBuilder.AddToScheme
)

// Provisioner names: a VirtualTargetClass's spec.provisioner says which
// controller serves the sets of the class; every other controller leaves
// them alone.
const (
	// DefaultProvisioner is the name this project's controller serves
	// unless told otherwise.
	DefaultProvisioner = "qemu-kubelet.io"
	// UpstreamQEMUProvisioner is upstream's own QEMU provisioner (a root
	// QEMU sidecar beside a Python exporter in each pod).
	UpstreamQEMUProvisioner = "qemu.jumpstarter.dev"
)

// LabelExporterSetName is the label upstream's reconciler puts on the pods
// and the ExporterConfig Secrets of a set, its value the set's name.
const LabelExporterSetName = "exporterset.jumpstarter.dev/name"
