package podspec

import (
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
)

// SSHDriverOf says whether pod's exporter reports its default ssh child
// (v1alpha1.SSHDriverAnnotation: Enabled, the default when absent, or
// Disabled); any other value is an error naming the annotation. Pure.
func SSHDriverOf(pod *corev1.Pod) (bool, error) {
	v, ok := pod.Annotations[v1alpha1.SSHDriverAnnotation]
	if !ok {
		return true, nil
	}
	switch v1alpha1.DriverSwitch(v) {
	case v1alpha1.DriverEnabled:
		return true, nil
	case v1alpha1.DriverDisabled:
		return false, nil
	}
	return false, fmt.Errorf("annotation %s: %q: want %s or %s", v1alpha1.SSHDriverAnnotation, v, v1alpha1.DriverEnabled, v1alpha1.DriverDisabled)
}

// DisplayOf says whether pod's VM has a display, and so its exporter the
// vnc child (AnnotationDisplay, decideDisplay); a value other than vnc or
// none is an error naming the annotation. Translate's Plan.Display is the
// same decision. Pure.
func DisplayOf(pod *corev1.Pod) (bool, error) {
	v, set := pod.Annotations[AnnotationDisplay]
	if set && v != DisplayVNC && v != DisplayNone {
		return false, fmt.Errorf("annotation %s: %q: want %s or %s", AnnotationDisplay, v, DisplayVNC, DisplayNone)
	}
	return decideDisplay(v, set, ExporterSecretName(pod) != "", pod.Annotations[AnnotationMachine]), nil
}

// decideDisplay: the annotation's value when set (vnc or none); without
// it, an exporter pod has a display (upstream's QEMU driver always has
// its vnc child) unless its machine has no graphics card (microvm: the
// default is off there, never a rejected pod), and any other pod has
// none. machine is the pod's machine ("": the arch's default, which
// always has a graphics card). Pure.
func decideDisplay(value string, set, exporter bool, machine string) bool {
	if set {
		return value == DisplayVNC
	}
	return exporter && machine != "microvm"
}
