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
