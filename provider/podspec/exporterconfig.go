package podspec

import (
	"fmt"
	"path"
	"strings"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	corev1 "k8s.io/api/core/v1"
)

// Which Secret is a pod's Jumpstarter exporter Secret: the one its
// annotation v1alpha1.JumpstarterSecretAnnotation names, else (upstream
// Jumpstarter's layout) the secret volume a container mounts at
// jsv1.ExporterConfigMountPath, /etc/jumpstarter/exporters, where
// upstream's exporter reads its ExporterConfig. Either way the volume of
// that Secret stays on the host: it never becomes a guest disk.

// exporterConfigMount is the secret volume a container of pod mounts at
// upstream's ExporterConfig path, and that container's index (nil: none).
// The first such mount, in container order, wins. Pure.
func exporterConfigMount(pod *corev1.Pod) (*corev1.Volume, int) {
	for ci := range pod.Spec.Containers {
		for _, m := range pod.Spec.Containers[ci].VolumeMounts {
			if path.Clean(m.MountPath) != jsv1.ExporterConfigMountPath || m.SubPath != "" || m.SubPathExpr != "" {
				continue
			}
			for i := range pod.Spec.Volumes {
				v := &pod.Spec.Volumes[i]
				if v.Name == m.Name && v.Secret != nil && v.Secret.SecretName != "" {
					return v, ci
				}
			}
		}
	}
	return nil, -1
}

// ExporterSecretName is the Secret the pod names for its exporter ("": the
// pod is no exporter): the annotation's, else the secret volume mounted
// at upstream's ExporterConfig path.
func ExporterSecretName(pod *corev1.Pod) string {
	if name := strings.TrimSpace(pod.Annotations[v1alpha1.JumpstarterSecretAnnotation]); name != "" {
		return name
	}
	if v, _ := exporterConfigMount(pod); v != nil {
		return v.Secret.SecretName
	}
	return ""
}

// exporterSecretSource says how the pod names its exporter Secret, for
// messages.
func exporterSecretSource(pod *corev1.Pod) string {
	if strings.TrimSpace(pod.Annotations[v1alpha1.JumpstarterSecretAnnotation]) == "" {
		if v, ci := exporterConfigMount(pod); v != nil {
			return fmt.Sprintf("volume %q mounted at %s by container %q", v.Name, jsv1.ExporterConfigMountPath, pod.Spec.Containers[ci].Name)
		}
	}
	return "annotation " + v1alpha1.JumpstarterSecretAnnotation
}

// ExporterSecretWhere names the pod's exporter Secret in messages.
func ExporterSecretWhere(pod *corev1.Pod) string {
	return fmt.Sprintf("Jumpstarter exporter secret %q (%s)", ExporterSecretName(pod), exporterSecretSource(pod))
}

// ExporterSecretNotFound is the error of a pod whose exporter Secret does
// not exist: the VM waits for it (CreateContainerConfigError).
func ExporterSecretNotFound(pod *corev1.Pod) error {
	return &ConfigError{Msg: fmt.Sprintf("secret %q not found (the Jumpstarter exporter secret named by %s)", ExporterSecretName(pod), exporterSecretSource(pod))}
}
