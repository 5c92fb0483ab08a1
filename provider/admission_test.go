package provider

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
)

func TestAdmit(t *testing.T) {
	alloc := rl("cpu", "2", "memory", "2Gi", "ephemeral-storage", "10Gi", "pods", "2")
	req := func(kv ...string) func(*corev1.Pod) {
		return func(p *corev1.Pod) { p.Spec.Containers[0].Resources.Requests = rl(kv...) }
	}
	one := vmPod(req("cpu", "1", "memory", "1Gi"))
	cases := []struct {
		name       string
		pod        *corev1.Pod
		node       NodeCapacity
		active     []*corev1.Pod
		wantReason string
		wantMsg    string
	}{
		{"fits", vmPod(req("cpu", "1", "memory", "1Gi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "", ""},
		{"cpu", vmPod(req("cpu", "1500m")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "OutOfcpu",
			"Node didn't have enough resource: cpu, requested: 1500, used: 1000, capacity: 2000"},
		{"memory", vmPod(req("memory", "3Gi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, nil, "OutOfmemory", "memory, requested: 3221225472, used: 0"},
		{"overhead counts", vmPod(req("memory", "1Gi"), func(p *corev1.Pod) { p.Spec.Overhead = rl("memory", "100Mi") }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "OutOfmemory", ""},
		{"pods", vmPod(), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{vmPod(), vmPod()}, "OutOfpods",
			"pods, requested: 1, used: 2, capacity: 2"},
		{"kvm on tcg node", vmPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationRequireAccelerator: "kvm"} }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, nil, ReasonKVMUnavailable, "node runs VMs with tcg"},
		{"kvm on kvm node", vmPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationRequireAccelerator: "kvm"} }),
			NodeCapacity{Allocatable: alloc, Accelerator: "kvm"}, nil, "", ""},
		{"uefi without OVMF", vmPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationFirmware: "uefi"} }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, nil, ReasonFirmwareUnavailable, "no OVMF"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			plan, rej := Translate(tc.pod, qemu.ArchX86_64)
			require.Nil(t, rej)
			got := Admit(tc.pod, plan, tc.node, tc.active)
			if tc.wantReason == "" {
				assert.Nil(t, got)
				return
			}
			require.NotNil(t, got)
			assert.Equal(t, tc.wantReason, got.Reason)
			assert.Contains(t, got.Message, tc.wantMsg)
		})
	}
}
