package podspec

import (
	"strings"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
)

// TestTranslateCPUModel: the cpu-model annotation reaches the plan when it
// has a model's form, and refuses the pod (naming the annotation) when not.
func TestTranslateCPUModel(t *testing.T) {
	cases := []struct {
		value   string
		want    string // the plan's CPUModel; "" with reject
		reject  bool
		message string
	}{
		{value: "max", want: "max"},
		{value: "max,la57=off", want: "max,la57=off"},
		{value: "Haswell-v4,-hle,+avx2", want: "Haswell-v4,-hle,+avx2"},
		{value: "host", want: "host"}, // KVM only: qemu.Spec.Validate at start
		{value: "", reject: true, message: `metadata.annotations[qemu-kubelet.io/cpu-model]: cpu model "": want a QEMU CPU model`},
		{value: "max -device x", reject: true, message: `cpu model "max -device x"`},
		{value: "max,,help", reject: true, message: `cpu model "max,,help"`},
		{value: "max,+", reject: true, message: `cpu model "max,+"`},
		{value: "-max", reject: true, message: `cpu model "-max"`},
		{value: "max\n", reject: true, message: "want a QEMU CPU model"},
		{value: "max" + strings.Repeat(",a=on", 120), reject: true, message: "at most 512 characters"},
	}
	for _, tc := range cases {
		t.Run(tc.value, func(t *testing.T) {
			plan, rej := Translate(podtest.VMPod(func(p *corev1.Pod) { p.Annotations = map[string]string{AnnotationCPUModel: tc.value} }), qemu.ArchX86_64)
			if tc.reject {
				if assert.NotNil(t, rej) {
					assert.Equal(t, ReasonUnsupportedPodSpec, rej.Reason)
					assert.Contains(t, rej.Message, tc.message)
				}
				return
			}
			if assert.Nil(t, rej) {
				assert.Equal(t, tc.want, plan.CPUModel)
			}
		})
	}
	plan, rej := Translate(podtest.VMPod(), qemu.ArchX86_64)
	assert.Nil(t, rej)
	assert.Empty(t, plan.CPUModel, "no annotation: the node's choice")
}

// TestCPUModel: the pod's model wins over the node's for the VM's
// accelerator, which wins over qemu's default ("").
func TestCPUModel(t *testing.T) {
	node := map[qemu.Accelerator]string{qemu.AccelTCG: "max", qemu.AccelKVM: "host,pmu=off"}
	cases := []struct {
		name  string
		pod   string
		accel qemu.Accelerator
		node  map[qemu.Accelerator]string
		want  string
	}{
		{"pod over node (tcg)", "Haswell-v4", qemu.AccelTCG, node, "Haswell-v4"},
		{"pod over node (kvm)", "host", qemu.AccelKVM, node, "host"},
		{"node's tcg model", "", qemu.AccelTCG, node, "max"},
		{"node's kvm model", "", qemu.AccelKVM, node, "host,pmu=off"},
		{"node names only kvm: tcg gets qemu's default", "", qemu.AccelTCG, map[qemu.Accelerator]string{qemu.AccelKVM: "host"}, ""},
		{"nothing set: qemu's default", "", qemu.AccelTCG, nil, ""},
		{"pod on a node without models", "max", qemu.AccelTCG, nil, "max"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, CPUModel(Plan{CPUModel: tc.pod}, tc.accel, tc.node))
		})
	}
}
