package qemu_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

// BenchmarkIdleDensity's configurations of issue #41: what an idle
// Jumpstarter exporter pod's VM costs the node on its default
// configuration (its memory tuning), before the issue and with the
// defaults it brought, in the same run. Each VM is built as the node
// builds an exporter pod's: the pod through podspec.Translate (the
// display) and podspec.PrepareGuestDisks (the NoCloud seed of its login),
// then started through this package.
//   - exporter-before: the exporter pod as it was before #41: no display
//     (the annotation qemu-kubelet.io/display: none, the old default) and
//     no login in its Secret, so no seed disk;
//   - exporter-defaults: the exporter pod now: no display annotation (a
//     graphics card and QEMU's VNC server on a unix socket, the vnc child)
//     and the login the ExporterSet controller generates for it (user
//     jumpstarter, a random password: the seed disk's vendor-data, which
//     the test image applies at boot), reported against exporter-before
//     (exporter-defaults-pss-x-of-exporter-before).
func init() {
	n, err := config.Resolve(&config.NodeConfiguration{}, config.Environment{Hostname: "bench", HostIP: "127.0.0.1"})
	if err != nil {
		panic(fmt.Sprintf("resolve the default node configuration: %v", err))
	}
	mem := nodeMemory(n)
	qemu.AddDensityConfig("exporter-before", mem, "", exporterVM(map[string]string{podspec.AnnotationDisplay: podspec.DisplayNone}, nil, false))
	qemu.AddDensityConfig("exporter-defaults", mem, "exporter-before", exporterVM(nil, generatedLogin, true))
}

// generatedLogin is a login as the ExporterSet controller generates it:
// its user and 32 URL-safe characters of a cryptographic source.
func generatedLogin() (user, password string) {
	b := make([]byte, 24)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("crypto/rand: %v", err)) // never fails on Linux
	}
	return v1alpha1.GeneratedGuestLoginUser, base64.RawURLEncoding.EncodeToString(b)
}

// exporterVM readies a VM as the node readies an exporter pod's with the
// annotations ann (besides the exporter Secret's) whose Secret holds the
// login of login (nil: none): its display from podspec.Translate, its
// guest disks made in dir by podspec.PrepareGuestDisks. defaults: the VM
// must have what #41 added (a display and the login's seed disk), else
// neither: an error otherwise, so the pair always measures that.
func exporterVM(ann map[string]string, login func() (string, string), defaults bool) func(ctx context.Context, s *qemu.Spec, dir string) error {
	return func(ctx context.Context, s *qemu.Spec, dir string) error {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: s.Name, UID: types.UID("uid-" + s.Name),
				Annotations: map[string]string{v1alpha1.JumpstarterSecretAnnotation: "js"}},
			Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "bench.invalid/test-image:1"}}},
		}
		for k, v := range ann {
			pod.Annotations[k] = v
		}
		secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: "js"}, Data: map[string][]byte{}}
		if login != nil {
			u, p := login()
			secret.Data[v1alpha1.JumpstarterSecretUsername], secret.Data[v1alpha1.JumpstarterSecretPassword] = []byte(u), []byte(p)
		}
		plan, rej := podspec.Translate(pod, s.Arch)
		if rej != nil {
			return rej
		}
		s.Display = plan.Display
		disks, err := podspec.PrepareGuestDisks(ctx, dir, pod, podspec.ConfigSources{
			Secret: func(context.Context, string, string) (*corev1.Secret, error) { return secret, nil },
		})
		if err != nil {
			return err
		}
		if plan.Display != defaults || (len(disks) == 1) != defaults || len(disks) > 1 {
			return fmt.Errorf("the node built display %v and %d guest disks for this exporter pod, want display %v and %d (the login's seed)", plan.Display, len(disks), defaults, map[bool]int{true: 1}[defaults])
		}
		s.Disks = append(s.Disks, disks...)
		return nil
	}
}
