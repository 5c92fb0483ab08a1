package controller

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vtv1 "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
)

func upstreamSet(mutate func(*vtv1.ExporterSetSpec)) *vtv1.ExporterSet {
	s := &vtv1.ExporterSet{ObjectMeta: metav1.ObjectMeta{Name: "vt", Namespace: "ns"},
		Spec: vtv1.ExporterSetSpec{VirtualTargetClassName: "ours",
			Parameters: &apiextv1.JSON{Raw: []byte(`{"qemuKubelet":{"image":"reg.invalid/os:1"}}`)}}}
	if mutate != nil {
		mutate(&s.Spec)
	}
	return s
}

func upstreamClass(params string, sch *vtv1.SchedulingSpec) *vtv1.VirtualTargetClass {
	c := &vtv1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Name: "ours", Namespace: "ns"},
		Spec: vtv1.VirtualTargetClassSpec{Provisioner: vtv1.DefaultProvisioner, Scheduling: sch}}
	if params != "" {
		c.Spec.Parameters = &apiextv1.JSON{Raw: []byte(params)}
	}
	return c
}

// TestMapUpstreamKnobs: each scaling field of upstream's spec lands on the
// planner knob of the same meaning; Jumpstarter mode is always on.
func TestMapUpstreamKnobs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mutate func(*vtv1.ExporterSetSpec)
		want   Input
	}{
		{"defaults: max 4, ExitAndReplace, 5m", nil,
			Input{MaxReplicas: ptr.To[int32](4), Recycle: v1alpha1.RecyclePolicyReplace, Cooldown: 5 * time.Minute}},
		{"maxReplicas 0 is no limit", func(s *vtv1.ExporterSetSpec) { s.MaxReplicas = ptr.To[int32](0) },
			Input{Recycle: v1alpha1.RecyclePolicyReplace, Cooldown: 5 * time.Minute}},
		{"every field", func(s *vtv1.ExporterSetSpec) {
			s.MinReplicas, s.MaxReplicas, s.MinAvailableReplicas = 2, ptr.To[int32](9), 3
			s.ScaleDownCooldown = &metav1.Duration{Duration: 17 * time.Second}
			s.RecycleStrategy = vtv1.RecycleStrategyInPlaceReuse
		}, Input{Replicas: 2, MinAvailable: 3, MaxReplicas: ptr.To[int32](9), Recycle: v1alpha1.RecyclePolicyReuse, Cooldown: 17 * time.Second}},
		{"ExitAndReplace is Replace", func(s *vtv1.ExporterSetSpec) { s.RecycleStrategy = vtv1.RecycleStrategyExitAndReplace },
			Input{MaxReplicas: ptr.To[int32](4), Recycle: v1alpha1.RecyclePolicyReplace, Cooldown: 5 * time.Minute}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, cerr := MapUpstream(upstreamSet(tc.mutate), upstreamClass("", nil), 3*time.Second)
			require.Nil(t, cerr)
			tc.want.Jumpstarter = &JumpstarterInput{DrainDelay: 3 * time.Second}
			assert.Equal(t, tc.want, got.Knobs)
			// ExitAndReplace pods go at lease end: nothing to reset.
			wantKeep := map[bool]string{true: "", false: "Keep"}[tc.want.Recycle == v1alpha1.RecyclePolicyReuse]
			assert.Equal(t, wantKeep, got.Template.Annotations[v1alpha1.LeaseStatePolicyAnnotation])
		})
	}
}

// TestMapUpstreamTemplate: the pod comes from the class's scheduling (or
// the virtual node's defaults), the merged resources.* and arch, and the
// image parameter; bad parameters name what is wrong.
func TestMapUpstreamTemplate(t *testing.T) {
	q := resource.MustParse
	classTol := corev1.Toleration{Key: "lab", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}
	for _, tc := range []struct {
		name        string
		classParams string
		setParams   string
		sch         *vtv1.SchedulingSpec
		check       func(t *testing.T, p corev1.PodTemplateSpec)
		reason, msg string
	}{
		{name: "virtual node defaults when the class says nothing", setParams: `{"qemuKubelet":{"image":"reg.invalid/os:1"}}`,
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				assert.Equal(t, map[string]string{"type": "virtual-kubelet"}, p.Spec.NodeSelector)
				assert.Equal(t, []corev1.Toleration{virtualNodeToleration}, p.Spec.Tolerations)
				require.Len(t, p.Spec.Containers, 1)
				assert.Equal(t, "reg.invalid/os:1", p.Spec.Containers[0].Image)
				assert.Empty(t, p.Spec.Containers[0].Resources.Limits)
				assert.Equal(t, "vt", p.Labels[UpstreamLabel])
			}},
		{name: "class scheduling replaces the defaults; set params over class params; arch",
			classParams: `{"arch":"x86_64","qemuKubelet":{"image":"reg.invalid/class:1"},"resources":{"cpu":"2","memory":"1Gi"}}`,
			setParams:   `{"arch":"aarch64","resources":{"memory":"2Gi","storage":"8Gi"}}`,
			sch: &vtv1.SchedulingSpec{NodeSelector: map[string]string{"pool": "a"}, Tolerations: []corev1.Toleration{classTol},
				Resources: &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceCPU: q("500m")}}},
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				assert.Equal(t, map[string]string{"pool": "a", "kubernetes.io/arch": "arm64"}, p.Spec.NodeSelector)
				assert.Equal(t, []corev1.Toleration{classTol}, p.Spec.Tolerations)
				c := p.Spec.Containers[0]
				assert.Equal(t, "reg.invalid/class:1", c.Image)
				assert.True(t, q("2").Equal(c.Resources.Limits[corev1.ResourceCPU]))
				assert.True(t, q("500m").Equal(c.Resources.Requests[corev1.ResourceCPU]), "the class's smaller request stays")
				assert.True(t, q("2Gi").Equal(c.Resources.Limits[corev1.ResourceMemory]))
				assert.True(t, q("2Gi").Equal(c.Resources.Requests[corev1.ResourceMemory]))
				assert.True(t, q("8Gi").Equal(c.Resources.Limits[corev1.ResourceEphemeralStorage]))
			}},
		{name: "numbers are quantities", setParams: `{"qemuKubelet":{"image":"i"},"resources":{"cpu":2}}`,
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				assert.True(t, q("2").Equal(p.Spec.Containers[0].Resources.Limits[corev1.ResourceCPU]))
			}},
		{name: "no image: an empty disk of resources.storage", setParams: `{"resources":{"storage":"8Gi"}}`,
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				c := p.Spec.Containers[0]
				assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image)
				assert.True(t, q("8Gi").Equal(c.Resources.Limits[corev1.ResourceEphemeralStorage]))
				assert.True(t, q("8Gi").Equal(c.Resources.Requests[corev1.ResourceEphemeralStorage]))
			}},
		{name: "no image, no size: DefaultUpstreamStorage", setParams: `{"resources":{"cpu":"1"}}`,
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				c := p.Spec.Containers[0]
				assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image)
				assert.True(t, q("10Gi").Equal(c.Resources.Limits[corev1.ResourceEphemeralStorage]))
				assert.True(t, q("10Gi").Equal(c.Resources.Requests[corev1.ResourceEphemeralStorage]))
			}},
		{name: "no image: the class's ephemeral-storage request, no default added", setParams: `{}`,
			sch: &vtv1.SchedulingSpec{Resources: &corev1.ResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceEphemeralStorage: q("3Gi")}}},
			check: func(t *testing.T, p corev1.PodTemplateSpec) {
				c := p.Spec.Containers[0]
				assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image)
				assert.True(t, q("3Gi").Equal(c.Resources.Requests[corev1.ResourceEphemeralStorage]))
				assert.NotContains(t, c.Resources.Limits, corev1.ResourceEphemeralStorage)
			}},
		{name: "no image, a size too small", setParams: `{"resources":{"storage":"1000Ki"}}`, reason: ReasonInvalidParameters,
			msg: "the empty root disk of a set with no parameter qemuKubelet.image (sized by the Qemu driver's disk_size, else resources.storage, else the class's ephemeral-storage): 1000Ki: an empty disk is 1Mi to 64Ti"},
		{name: "no image, a size not in whole sectors", setParams: `{"resources":{"storage":"2000001"}}`, reason: ReasonInvalidParameters,
			msg: "2000001: an empty disk is whole 512-byte sectors"},
		{name: "no image, the class's size too large", setParams: `{}`,
			sch:    &vtv1.SchedulingSpec{Resources: &corev1.ResourceRequirements{Limits: corev1.ResourceList{corev1.ResourceEphemeralStorage: q("65Ti")}}},
			reason: ReasonInvalidParameters, msg: "65Ti: an empty disk is 1Mi to 64Ti"},
		{name: "image not a string", setParams: `{"qemuKubelet":{"image":3}}`, reason: ReasonInvalidParameters, msg: "parameter qemuKubelet.image must be a string, not a number"},
		{name: "qemuKubelet not an object", setParams: `{"qemuKubelet":"x"}`, reason: ReasonInvalidParameters, msg: "parameter qemuKubelet.image: qemuKubelet is a string, not an object"},
		{name: "bad quantity", setParams: `{"qemuKubelet":{"image":"i"},"resources":{"memory":"lots"}}`, reason: ReasonInvalidParameters, msg: `parameter resources.memory: "lots" is not a quantity`},
		{name: "zero quantity", setParams: `{"qemuKubelet":{"image":"i"},"resources":{"cpu":"0"}}`, reason: ReasonInvalidParameters, msg: "parameter resources.cpu: 0 must be positive"},
		{name: "unknown arch", setParams: `{"qemuKubelet":{"image":"i"},"arch":"riscv64"}`, reason: ReasonInvalidParameters, msg: `parameter arch "riscv64": not an architecture`},
		{name: "parameters not an object", setParams: `[1]`, reason: ReasonInvalidParameters, msg: "the set's parameters must be a JSON object, not an array"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			set := upstreamSet(func(s *vtv1.ExporterSetSpec) { s.Parameters = &apiextv1.JSON{Raw: []byte(tc.setParams)} })
			got, cerr := MapUpstream(set, upstreamClass(tc.classParams, tc.sch), time.Second)
			if tc.reason != "" {
				require.NotNil(t, cerr)
				assert.Equal(t, tc.reason, cerr.Reason)
				assert.Contains(t, cerr.Message, tc.msg)
				return
			}
			require.Nil(t, cerr)
			assert.Equal(t, corev1.RestartPolicyNever, got.Template.Spec.RestartPolicy)
			tc.check(t, got.Template)
		})
	}
}

// TestMapUpstreamEmptyDiskDriverSize: with no image, the Qemu driver's
// disk_size sizes the empty disk over resources.storage, and a bad one
// makes the set Degraded InvalidParameters.
func TestMapUpstreamEmptyDiskDriverSize(t *testing.T) {
	set := upstreamSet(func(s *vtv1.ExporterSetSpec) {
		s.Parameters = &apiextv1.JSON{Raw: []byte(`{"resources":{"storage":"8Gi"}}`)}
		s.Template.Spec.Drivers = []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"disk_size":"2Gi"}`)}
	})
	got, cerr := MapUpstream(set, upstreamClass("", nil), time.Second)
	require.Nil(t, cerr)
	c := got.Template.Spec.Containers[0]
	assert.Equal(t, v1alpha1.EmptyDiskImage, c.Image)
	assert.Equal(t, "2Gi", ptr.To(c.Resources.Limits[corev1.ResourceEphemeralStorage]).String(), "disk_size over resources.storage")

	set.Spec.Template.Spec.Drivers = []vtv1.DriverConfig{drv("qemu", DriverTypeQemu, `{"disk_size":"100K"}`)}
	_, cerr = MapUpstream(set, upstreamClass("", nil), time.Second)
	require.NotNil(t, cerr)
	assert.Equal(t, ReasonInvalidParameters, cerr.Reason)
	assert.Contains(t, cerr.Message, "100Ki: an empty disk is 1Mi to 64Ti")
}
