package main

import (
	"context"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/config"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// TestUEFIFirmwareWired: the node config's OVMF files reach the pod
// handler, so a UEFI pod is admitted; without them it is refused
// FirmwareUnavailable. No QEMU runs (the pod's image is not cached and its
// pull policy is Never).
func TestUEFIFirmwareWired(t *testing.T) {
	for _, tc := range []struct {
		name       string
		code, vars string
		wantPhase  corev1.PodPhase
		wantReason string
	}{
		{"configured", "/usr/share/OVMF/OVMF_CODE_4M.fd", "/usr/share/OVMF/OVMF_VARS_4M.fd", corev1.PodPending, ""},
		{"not configured", "", "", corev1.PodFailed, podspec.ReasonFirmwareUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			store, err := oci.Open(t.TempDir(), oci.Options{})
			require.NoError(t, err)
			defer store.Close()
			cfg := &config.Node{NodeName: "n1", NodeIP: "127.0.0.1", StateDir: t.TempDir(), QEMUBinary: "qemu-system-x86_64", UEFICode: tc.code, UEFIVars: tc.vars}
			alloc := func() corev1.ResourceList {
				return corev1.ResourceList{corev1.ResourcePods: resource.MustParse("10"), corev1.ResourceCPU: resource.MustParse("4"), corev1.ResourceMemory: resource.MustParse("4Gi")}
			}
			vms, err := newVMs(ctx, cfg, nodestatus.Facts{Accelerator: nodestatus.Accelerator{Name: "tcg"}}, fake.NewSimpleClientset(), store, t.TempDir(), alloc, nil)
			require.NoError(t, err)
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "uefi", UID: "uid-uefi", Annotations: map[string]string{podspec.AnnotationFirmware: "uefi"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "vm", Image: "127.0.0.1:1/os/absent:1", ImagePullPolicy: corev1.PullNever}}},
			}
			require.NoError(t, vms.CreatePod(ctx, pod))
			got, err := vms.GetPod(ctx, "ns", "uefi")
			require.NoError(t, err)
			assert.Equal(t, tc.wantPhase, got.Status.Phase)
			assert.Equal(t, tc.wantReason, got.Status.Reason)
			require.NoError(t, vms.DeletePod(ctx, pod))
		})
	}
}
