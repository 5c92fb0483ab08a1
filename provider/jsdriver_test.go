package provider

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

// Tests of what the node adds to upstream's QEMU driver calls (issue 27):
// the resize condition, the exporter's login and display settings (the
// pure checks are podspec's).

func TestExporterSettingsLoginAndDisplay(t *testing.T) {
	pod := exporterPod(nil, corev1.ContainerPort{Name: "vnc", ContainerPort: 5900}, corev1.ContainerPort{Name: "ssh", ContainerPort: 22})
	cfg, err := ExporterSettings(pod, exporterSecret(append(append([]string{}, goodSecretKV...), "username", "ci", "password", "pw-1")...))
	require.NoError(t, err)
	assert.Equal(t, "ci", cfg.Username)
	assert.Equal(t, "pw-1", cfg.Password)
	assert.False(t, cfg.Display)
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "vnc", Port: 5900}}, cfg.Ports, "no display: a port may be called vnc")
	pod.Annotations[podspec.AnnotationDisplay] = podspec.DisplayVNC
	cfg, err = ExporterSettings(pod, exporterSecret(goodSecretKV...))
	require.NoError(t, err)
	assert.True(t, cfg.Display)
	assert.Empty(t, cfg.Username, "no login in the Secret: empty, as before")
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "tcp-5900", Port: 5900}}, cfg.Ports, "the vnc child takes the name")
	_, err = ExporterSettings(pod, exporterSecret(append(append([]string{}, goodSecretKV...), "username", "ci")...))
	assert.ErrorContains(t, err, `key "username" is set but "password" is missing`)
	_ = v1alpha1.JumpstarterSecretUsername
}

// podCond is the pod's condition of type t (nil: none).
func podCond(p *corev1.Pod, t corev1.PodConditionType) *corev1.PodCondition {
	for i := range p.Status.Conditions {
		if p.Status.Conditions[i].Type == t {
			return &p.Status.Conditions[i]
		}
	}
	return nil
}
