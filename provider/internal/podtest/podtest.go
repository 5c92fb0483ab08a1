// Package podtest holds the pods, resource lists, exporter Secrets and
// feature configurations the provider's tests build their cases from.
package podtest

import (
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// VMPod is a pod as the API server binds it to the node (one container,
// the service account volume), changed by mut.
func VMPod(mut ...func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "uid-p"},
		Spec: corev1.PodSpec{
			Containers: []corev1.Container{{Name: "vm", Image: "127.0.0.1:5000/os/tiny:1"}},
			Volumes:    []corev1.Volume{{Name: "kube-api-access-abcde", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{}}}},
		},
	}
	p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "kube-api-access-abcde", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount"}}
	for _, m := range mut {
		m(p)
	}
	return p
}

// RL is a resource list of name, quantity pairs.
func RL(kv ...string) corev1.ResourceList {
	out := corev1.ResourceList{}
	for i := 0; i < len(kv); i += 2 {
		out[corev1.ResourceName(kv[i])] = resource.MustParse(kv[i+1])
	}
	return out
}

// ExporterSecret is the Jumpstarter exporter Secret lab/js holding kv
// (key, value, key, value...).
func ExporterSecret(kv ...string) *corev1.Secret {
	s := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "js"}, Data: map[string][]byte{}}
	for i := 0; i+1 < len(kv); i += 2 {
		s.Data[kv[i]] = []byte(kv[i+1])
	}
	return s
}

// ExporterSecretKV are the keys of a valid exporter Secret.
var ExporterSecretKV = []string{"endpoint", "grpc.js.example:443", "token", "s3cr3t-token", "namespace", "jumpstarter-lab", "name", "board-0"}

// FeaturesWith is the default features with the gates off switched off.
func FeaturesWith(off ...string) *config.FeatureConfig {
	f := config.DefaultFeatures()
	for _, n := range off {
		f.Gates[n] = false
	}
	return f
}
