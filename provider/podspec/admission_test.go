package podspec

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

func TestAdmit(t *testing.T) {
	alloc := podtest.RL("cpu", "2", "memory", "2Gi", "ephemeral-storage", "10Gi", "pods", "2")
	req := func(kv ...string) func(*corev1.Pod) {
		return func(p *corev1.Pod) { p.Spec.Containers[0].Resources.Requests = podtest.RL(kv...) }
	}
	one := podtest.VMPod(req("cpu", "1", "memory", "1Gi"))
	cases := []struct {
		name       string
		pod        *corev1.Pod
		node       NodeCapacity
		active     []*corev1.Pod
		wantReason string
		wantMsg    string
	}{
		{"fits", podtest.VMPod(req("cpu", "1", "memory", "1Gi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "", ""},
		{"cpu", podtest.VMPod(req("cpu", "1500m")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "OutOfcpu",
			"Node didn't have enough resource: cpu, requested: 1500, used: 1000, capacity: 2000"},
		{"memory", podtest.VMPod(req("memory", "3Gi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, nil, "OutOfmemory", "memory, requested: 3221225472, used: 0"},
		{"overhead counts", podtest.VMPod(req("memory", "1Gi"), func(p *corev1.Pod) { p.Spec.Overhead = podtest.RL("memory", "100Mi") }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{one}, "OutOfmemory", ""},
		// 2Gi allocatable, one VM of 1Gi running: a second 1Gi VM fits on
		// requests alone, but not once QEMU's 128Mi per VM is counted.
		{"node overhead counts", podtest.VMPod(req("memory", "1Gi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg", VMOverhead: resource.MustParse("128Mi")},
			[]*corev1.Pod{one}, "OutOfmemory",
			"memory, requested: 1207959552, used: 1207959552, capacity: 2147483648 (each VM counts QEMU's own memory, at least 134217728)"},
		{"node overhead: the pair that fits", podtest.VMPod(req("memory", "768Mi")), NodeCapacity{Allocatable: alloc, Accelerator: "tcg", VMOverhead: resource.MustParse("128Mi")},
			[]*corev1.Pod{one}, "", ""},
		// A RuntimeClass overhead at least the node's is not counted twice.
		{"runtime class overhead not doubled", podtest.VMPod(req("memory", "896Mi"), func(p *corev1.Pod) { p.Spec.Overhead = podtest.RL("memory", "128Mi") }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg", VMOverhead: resource.MustParse("128Mi")},
			[]*corev1.Pod{podtest.VMPod(req("memory", "896Mi"), func(p *corev1.Pod) { p.Spec.Overhead = podtest.RL("memory", "128Mi") })}, "", ""},
		{"pods", podtest.VMPod(), NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, []*corev1.Pod{podtest.VMPod(), podtest.VMPod()}, "OutOfpods",
			"pods, requested: 1, used: 2, capacity: 2"},
		{"kvm on tcg node", podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationRequireAccelerator: "kvm"} }),
			NodeCapacity{Allocatable: alloc, Accelerator: "tcg"}, nil, ReasonKVMUnavailable, "node runs VMs with tcg"},
		{"kvm on kvm node", podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationRequireAccelerator: "kvm"} }),
			NodeCapacity{Allocatable: alloc, Accelerator: "kvm"}, nil, "", ""},
		{"uefi without OVMF", podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationFirmware: "uefi"} }),
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

func TestVMRequests(t *testing.T) {
	withOverhead := func(q string) func(*corev1.Pod) {
		return func(p *corev1.Pod) { p.Spec.Overhead = podtest.RL("memory", q) }
	}
	req := func(p *corev1.Pod) {
		p.Spec.Containers[0].Resources.Requests = podtest.RL("cpu", "1", "memory", "512Mi")
	}
	cases := []struct {
		name     string
		pod      *corev1.Pod
		overhead string
		want     string
	}{
		{"no node overhead", podtest.VMPod(req), "0", "512Mi"},
		{"node overhead added", podtest.VMPod(req), "128Mi", "640Mi"},
		{"smaller runtime class overhead raised", podtest.VMPod(req, withOverhead("64Mi")), "128Mi", "640Mi"},
		{"larger runtime class overhead kept", podtest.VMPod(req, withOverhead("256Mi")), "128Mi", "768Mi"},
		{"no request: overhead alone", podtest.VMPod(), "128Mi", "128Mi"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := VMRequests(tc.pod, resource.MustParse(tc.overhead))
			m := got[corev1.ResourceMemory]
			assert.True(t, m.Equal(resource.MustParse(tc.want)), "memory %s, want %s", m.String(), tc.want)
		})
	}
}
