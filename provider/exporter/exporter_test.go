package exporter

import (
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func exporterPod(labels map[string]string, ports ...corev1.ContainerPort) *corev1.Pod {
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "board-0", Labels: labels,
			Annotations: map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "r/os:1", Ports: ports}}},
	}
}

func TestExporterSettings(t *testing.T) {
	pod := exporterPod(map[string]string{"jumpstarter.dev/board": "qemu", "app": "x"},
		corev1.ContainerPort{Name: "http", ContainerPort: 8080},
		corev1.ContainerPort{Name: "ssh", ContainerPort: 22},
		corev1.ContainerPort{ContainerPort: 9000},
		corev1.ContainerPort{Name: "console", ContainerPort: 23},
		corev1.ContainerPort{Name: "dns", ContainerPort: 53, Protocol: corev1.ProtocolUDP})
	cfg, err := Settings(pod, podtest.ExporterSecret(podtest.ExporterSecretKV...))
	require.NoError(t, err)
	assert.Equal(t, "grpc.js.example:443", cfg.Endpoint)
	assert.Equal(t, "s3cr3t-token", cfg.Token)
	assert.Equal(t, "jumpstarter-lab", cfg.Namespace)
	assert.Equal(t, "board-0", cfg.Name)
	assert.Empty(t, cfg.CABundle)
	assert.Equal(t, map[string]string{"jumpstarter.dev/board": "qemu"}, cfg.Labels, "only jumpstarter.dev/ labels")
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "tcp-23", Port: 23}, {Name: "http", Port: 8080}, {Name: "tcp-9000", Port: 9000}}, cfg.Ports,
		"named TCP ports; unnamed and built-in driver names become tcp-<port>; UDP skipped")
	assert.Equal(t, "board-0", cfg.Hostname)

	for _, tc := range []struct {
		name string
		kv   []string
		want string
	}{
		{"no endpoint", []string{"token", "t", "namespace", "n", "name", "x"}, `key "endpoint" is missing`},
		{"endpoint without port", []string{"endpoint", "grpc.js.example", "token", "t", "namespace", "n", "name", "x"}, "not host:port"},
		{"endpoint with scheme", []string{"endpoint", "https://grpc.js.example:443", "token", "t", "namespace", "n", "name", "x"}, "not host:port"},
		{"endpoint bad port", []string{"endpoint", "h:99999", "token", "t", "namespace", "n", "name", "x"}, "port \"99999\""},
		{"no token", []string{"endpoint", "h:443", "namespace", "n", "name", "x"}, `key "token" is missing`},
		{"token with space", []string{"endpoint", "h:443", "token", "abc def", "namespace", "n", "name", "x"}, "white space"},
		{"no namespace", []string{"endpoint", "h:443", "token", "t", "name", "x"}, `key "namespace"`},
		{"no name", []string{"endpoint", "h:443", "token", "t", "namespace", "n"}, `key "name"`},
		{"bad CA", append(append([]string(nil), podtest.ExporterSecretKV...), "ca.crt", "not a cert"), "no PEM certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Settings(pod, podtest.ExporterSecret(tc.kv...))
			require.Error(t, err)
			assert.True(t, podspec.IsConfigError(err), "a config error (the pod waits): %v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.Contains(t, err.Error(), `secret "js"`)
			assert.NotContains(t, err.Error(), "s3cr3t-token")
			assert.NotContains(t, err.Error(), "abc def")
		})
	}
}

func TestApplyExporterCondition(t *testing.T) {
	since := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	var st corev1.PodStatus
	applyCondition(&st, nil)
	assert.Empty(t, st.Conditions, "no exporter, no condition")
	for s, want := range map[jumpstarter.State]corev1.ConditionStatus{
		jumpstarter.StateConnecting: corev1.ConditionFalse, jumpstarter.StateRegistered: corev1.ConditionFalse,
		jumpstarter.StateOnline: corev1.ConditionTrue, jumpstarter.StateLeased: corev1.ConditionTrue,
		jumpstarter.StateFailed: corev1.ConditionFalse, jumpstarter.StateStopped: corev1.ConditionFalse,
	} {
		var st corev1.PodStatus
		applyCondition(&st, &status{state: s, msg: "m", since: since})
		require.Len(t, st.Conditions, 1)
		c := st.Conditions[0]
		assert.Equal(t, Condition, c.Type)
		assert.Equal(t, want, c.Status, "%s", s)
		assert.Equal(t, string(s), c.Reason)
		assert.Equal(t, "m", c.Message)
		assert.True(t, c.LastTransitionTime.Time.Equal(since))
	}
}

// TestExporterSettingsLoginAndDisplay: the Secret's login; the vnc child
// by default (an exporter pod's VM has a display: podspec.DisplayOf), which
// takes the name vnc from a container port; display none switches it off
// and leaves the name to the port; a bad value is a config error.
func TestExporterSettingsLoginAndDisplay(t *testing.T) {
	pod := exporterPod(nil, corev1.ContainerPort{Name: "vnc", ContainerPort: 5900}, corev1.ContainerPort{Name: "ssh", ContainerPort: 22})
	cfg, err := Settings(pod, podtest.ExporterSecret(append(append([]string{}, podtest.ExporterSecretKV...), "username", "ci", "password", "pw-1")...))
	require.NoError(t, err)
	assert.Equal(t, "ci", cfg.Username)
	assert.Equal(t, "pw-1", cfg.Password)
	assert.True(t, cfg.Display, "an exporter pod has the vnc child by default")
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "tcp-5900", Port: 5900}}, cfg.Ports, "the vnc child takes the name")
	pod.Annotations[podspec.AnnotationDisplay] = podspec.DisplayNone
	cfg, err = Settings(pod, podtest.ExporterSecret(podtest.ExporterSecretKV...))
	require.NoError(t, err)
	assert.False(t, cfg.Display, "display none: no vnc child")
	assert.Empty(t, cfg.Username, "no login in the Secret: empty, as before")
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "vnc", Port: 5900}}, cfg.Ports, "no display: a port may be called vnc")
	pod.Annotations[podspec.AnnotationDisplay] = podspec.DisplayVNC
	cfg, err = Settings(pod, podtest.ExporterSecret(podtest.ExporterSecretKV...))
	require.NoError(t, err)
	assert.True(t, cfg.Display, "display vnc")
	_, err = Settings(pod, podtest.ExporterSecret(append(append([]string{}, podtest.ExporterSecretKV...), "username", "ci")...))
	assert.ErrorContains(t, err, `key "username" is set but "password" is missing`)
	pod.Annotations[podspec.AnnotationDisplay] = "on"
	_, err = Settings(pod, podtest.ExporterSecret(podtest.ExporterSecretKV...))
	require.Error(t, err)
	assert.True(t, podspec.IsConfigError(err), "a config error: %v", err)
	assert.ErrorContains(t, err, `annotation qemu-kubelet.io/display: "on": want vnc or none`)
}

// TestExporterSettingsSSH: every exporter pod reports an ssh child to the
// guest's port 22 by default, as upstream's QEMU driver always has one;
// the annotation switches it off; a container port named ssh wins (on or
// off); a bad value keeps the pod waiting with a message naming it.
func TestExporterSettingsSSH(t *testing.T) {
	secret := podtest.ExporterSecret(podtest.ExporterSecretKV...)
	ports := func(pod *corev1.Pod) []jumpstarter.Port {
		t.Helper()
		cfg, err := Settings(pod, secret)
		require.NoError(t, err)
		return cfg.Ports
	}
	http := corev1.ContainerPort{Name: "http", ContainerPort: 8080}
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}}, ports(exporterPod(nil)), "by default, with no port at all")
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "http", Port: 8080}}, ports(exporterPod(nil, http)))
	unnamed22 := exporterPod(nil, corev1.ContainerPort{ContainerPort: 22})
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "tcp-22", Port: 22}}, ports(unnamed22), "an unnamed port 22 keeps its own child")

	named := exporterPod(nil, corev1.ContainerPort{Name: "ssh", ContainerPort: 2222}, http)
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 2222}, {Name: "http", Port: 8080}}, ports(named), "a port named ssh wins")

	for _, v := range []v1alpha1.DriverSwitch{v1alpha1.DriverDisabled, v1alpha1.DriverEnabled} {
		off := exporterPod(nil, http)
		off.Annotations[v1alpha1.SSHDriverAnnotation] = string(v)
		want := []jumpstarter.Port{{Name: "http", Port: 8080}}
		if v == v1alpha1.DriverEnabled {
			want = []jumpstarter.Port{{Name: "ssh", Port: 22}, {Name: "http", Port: 8080}}
		}
		assert.Equal(t, want, ports(off), "annotation %s", v)
	}
	named.Annotations[v1alpha1.SSHDriverAnnotation] = string(v1alpha1.DriverDisabled)
	assert.Equal(t, []jumpstarter.Port{{Name: "ssh", Port: 2222}, {Name: "http", Port: 8080}}, ports(named), "Disabled: a port named ssh is still the pod's port")

	bad := exporterPod(nil)
	bad.Annotations[v1alpha1.SSHDriverAnnotation] = "off"
	_, err := Settings(bad, secret)
	require.Error(t, err)
	assert.True(t, podspec.IsConfigError(err), "a config error: %v", err)
	assert.ErrorContains(t, err, `annotation qemu-kubelet.io/jumpstarter-ssh: "off": want Enabled or Disabled`)
}
