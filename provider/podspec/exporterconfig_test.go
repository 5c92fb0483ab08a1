package podspec

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	jsv1 "github.com/qemu-kubelet/qemu-kubelet/api/jumpstarter/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

// upstreamPod is a VM pod in upstream Jumpstarter's layout: the Secret
// exporter-config-<exporter> as volume "exporter-config", mounted by the
// container at /etc/jumpstarter/exporters; no annotation.
func upstreamPod(mut ...func(*corev1.Pod)) *corev1.Pod {
	return podtest.VMPod(append([]func(*corev1.Pod){func(p *corev1.Pod) {
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "exporter-config",
			VolumeSource: corev1.VolumeSource{Secret: &corev1.SecretVolumeSource{SecretName: "exporter-config-pool-x7k2p"}}})
		p.Spec.Containers[0].VolumeMounts = append(p.Spec.Containers[0].VolumeMounts,
			corev1.VolumeMount{Name: "exporter-config", MountPath: jsv1.ExporterConfigMountPath, ReadOnly: true})
	}}, mut...)...)
}

// TestExporterSecretName: the annotation names the exporter Secret, else
// the secret volume a container mounts at upstream's ExporterConfig path;
// nothing else makes a pod an exporter.
func TestExporterSecretName(t *testing.T) {
	mount := func(m corev1.VolumeMount) func(*corev1.Pod) {
		return func(p *corev1.Pod) { ms := p.Spec.Containers[0].VolumeMounts; ms[len(ms)-1] = m }
	}
	for name, tc := range map[string]struct {
		pod        *corev1.Pod
		want, from string
	}{
		"annotation": {podtest.VMPod(func(p *corev1.Pod) {
			p.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: " board-0-js "}
		}),
			"board-0-js", "annotation " + v1alpha1.JumpstarterSecretAnnotation},
		"upstream's mount": {upstreamPod(), "exporter-config-pool-x7k2p",
			`volume "exporter-config" mounted at /etc/jumpstarter/exporters by container "vm"`},
		"mount path with a trailing slash": {upstreamPod(mount(corev1.VolumeMount{Name: "exporter-config", MountPath: jsv1.ExporterConfigMountPath + "/"})),
			"exporter-config-pool-x7k2p", `volume "exporter-config" mounted at`},
		"the annotation wins over the mount": {upstreamPod(func(p *corev1.Pod) { p.Annotations = map[string]string{v1alpha1.JumpstarterSecretAnnotation: "mine"} }),
			"mine", "annotation "},
		"mounted by a second container": {upstreamPod(func(p *corev1.Pod) {
			p.Spec.Containers = append(p.Spec.Containers, corev1.Container{Name: "exporter", VolumeMounts: p.Spec.Containers[0].VolumeMounts})
			p.Spec.Containers[0].VolumeMounts = nil
		}), "exporter-config-pool-x7k2p", `by container "exporter"`},
		"another path":           {upstreamPod(mount(corev1.VolumeMount{Name: "exporter-config", MountPath: "/etc/jumpstarter"})), "", ""},
		"a subPath of the mount": {upstreamPod(mount(corev1.VolumeMount{Name: "exporter-config", MountPath: jsv1.ExporterConfigMountPath, SubPath: "config.yaml"})), "", ""},
		"a configMap mounted there": {upstreamPod(func(p *corev1.Pod) {
			p.Spec.Volumes[len(p.Spec.Volumes)-1].VolumeSource = corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{LocalObjectReference: corev1.LocalObjectReference{Name: "cm"}}}
		}), "", ""},
		"a mount of no volume": {upstreamPod(func(p *corev1.Pod) { p.Spec.Volumes = p.Spec.Volumes[:len(p.Spec.Volumes)-1] }), "", ""},
		"no exporter":          {podtest.VMPod(), "", ""},
	} {
		t.Run(name, func(t *testing.T) {
			assert.Equal(t, tc.want, ExporterSecretName(tc.pod))
			if tc.want != "" {
				assert.Contains(t, ExporterSecretWhere(tc.pod), `"`+tc.want+`"`)
				assert.Contains(t, ExporterSecretWhere(tc.pod), tc.from)
			}
		})
	}
}

// TestUpstreamLayoutPod: a pod in upstream's layout is an exporter pod
// like an annotated one: its ExporterConfig volume is admitted whatever
// its name and never becomes a guest disk, the pod waits for the
// jumpstarterExporter feature, and a missing Secret is a ConfigError
// naming the mount.
func TestUpstreamLayoutPod(t *testing.T) {
	pod := upstreamPod()
	_, rej := Translate(pod, qemu.ArchX86_64)
	require.Nil(t, rej, "the exporter-config volume (a name too long for a disk label) is the host's, not a guest disk")

	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: "exporter-config-pool-x7k2p"},
		Data: map[string][]byte{jsv1.ExporterConfigSecretKey: []byte("token: secret-token\n")}}
	disks, err := planGuestDisks(context.Background(), pod, fakeSources([]*corev1.Secret{secret}, nil))
	require.NoError(t, err)
	for _, d := range disks {
		assert.NotEqual(t, "exporter-config", d.Name, "the ExporterConfig stays on the host")
		for _, b := range d.Files {
			assert.NotContains(t, string(b), "secret-token")
		}
	}

	h := DecideHold(pod, Plan{}, featuresWith(config.FeatureJumpstarterExporter), "n1", false)
	require.NotNil(t, h, "an upstream-layout pod needs the exporter feature")
	assert.Equal(t, []string{config.FeatureJumpstarterExporter}, h.Features)

	_, err = planGuestDisks(context.Background(), pod, fakeSources(nil, nil))
	require.Error(t, err, "the pod waits for its exporter Secret")
	assert.True(t, IsConfigError(err), "a ConfigError: %v", err)
	assert.Contains(t, err.Error(), `secret "exporter-config-pool-x7k2p" not found`)
	assert.Contains(t, err.Error(), "mounted at /etc/jumpstarter/exporters")
}
