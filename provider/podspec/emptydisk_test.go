package podspec

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func emptyDiskPod(res corev1.ResourceRequirements, ann map[string]string) *corev1.Pod {
	return podtest.VMPod(func(p *corev1.Pod) {
		p.Spec.Containers[0].Image = v1alpha1.EmptyDiskImage
		p.Spec.Containers[0].Resources = res
		p.Annotations = ann
	})
}

// TestTranslateEmptyDisk: the empty-disk image boots a disk of the
// ephemeral-storage limit, else its request.
func TestTranslateEmptyDisk(t *testing.T) {
	for _, tc := range []struct {
		name string
		res  corev1.ResourceRequirements
		ann  map[string]string
		want int64
	}{
		{"limit over request", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "8Gi"), Requests: podtest.RL("ephemeral-storage", "1Gi")}, nil, 8 << 30},
		{"request alone", corev1.ResourceRequirements{Requests: podtest.RL("ephemeral-storage", "3Mi")}, nil, 3 << 20},
		{"bounds are inclusive: 1Mi", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "1Mi")}, nil, 1 << 20},
		{"bounds are inclusive: 64Ti", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "64Ti")}, nil, 64 << 40},
		{"uefi, pc", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "2G")},
			map[string]string{AnnotationFirmware: "uefi", AnnotationMachine: "pc"}, 2_000_000_000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, rej := Translate(emptyDiskPod(tc.res, tc.ann), qemu.ArchX86_64)
			require.Nil(t, rej)
			assert.True(t, got.IsEmptyDisk())
			assert.Equal(t, tc.want, got.EmptyDiskBytes)
			assert.Equal(t, v1alpha1.EmptyDiskImage, got.Image)
			assert.Equal(t, oci.PullIfNotPresent, got.PullPolicy)
		})
	}
	// Any other image has no empty disk, whatever its storage.
	got, rej := Translate(podtest.VMPod(func(p *corev1.Pod) {
		p.Spec.Containers[0].Resources.Limits = podtest.RL("ephemeral-storage", "8Gi")
	}), qemu.ArchX86_64)
	require.Nil(t, rej)
	assert.False(t, got.IsEmptyDisk())
	assert.Zero(t, got.EmptyDiskBytes)
}

// TestTranslateEmptyDiskRefused: no size, a size out of bounds or not in
// whole sectors, and what needs a kernel or an OS are refused, each with
// the field and why.
func TestTranslateEmptyDiskRefused(t *testing.T) {
	disk := corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "1Gi")}
	for _, tc := range []struct {
		name string
		res  corev1.ResourceRequirements
		ann  map[string]string
		want string
	}{
		{"no size", corev1.ResourceRequirements{Limits: podtest.RL("memory", "1Gi")}, nil,
			"spec.containers[0].resources: image qemu-kubelet.io/empty-disk boots an empty disk of the container's ephemeral-storage limit (or request): set one"},
		{"too small", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "1023Ki")}, nil,
			"spec.containers[0].resources.limits[ephemeral-storage]: 1023Ki: an empty disk is 1Mi to 64Ti"},
		{"too large (request)", corev1.ResourceRequirements{Requests: podtest.RL("ephemeral-storage", "65Ti")}, nil,
			"spec.containers[0].resources.requests[ephemeral-storage]: 65Ti: an empty disk is 1Mi to 64Ti"},
		{"not whole sectors", corev1.ResourceRequirements{Limits: podtest.RL("ephemeral-storage", "2000001")}, nil,
			"spec.containers[0].resources.limits[ephemeral-storage]: 2000001: an empty disk is whole 512-byte sectors"},
		{"kernel cmdline", disk, map[string]string{AnnotationKernelCmdline: "quiet"},
			"metadata.annotations[qemu-kubelet.io/kernel-cmdline]: image qemu-kubelet.io/empty-disk boots an empty disk under the firmware: it has no kernel"},
		{"snapshot start", disk, map[string]string{AnnotationStartFromSnapshot: "true"},
			"metadata.annotations[qemu-kubelet.io/start-from-snapshot]: image qemu-kubelet.io/empty-disk boots an empty disk under the firmware: no OS reaches a readiness point"},
		{"microvm", disk, map[string]string{AnnotationMachine: "microvm"},
			"metadata.annotations[qemu-kubelet.io/machine]: image qemu-kubelet.io/empty-disk boots an empty disk under the firmware: machine microvm boots a kernel only"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, rej := Translate(emptyDiskPod(tc.res, tc.ann), qemu.ArchX86_64)
			require.NotNil(t, rej, "accepted: %+v", got)
			assert.Equal(t, ReasonUnsupportedPodSpec, rej.Reason)
			assert.Contains(t, rej.Message, tc.want)
		})
	}
}
