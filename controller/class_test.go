package controller

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

func TestMergeParameters(t *testing.T) {
	cases := []struct {
		name, base, over, want string
	}{
		{"both empty", "", "", ""},
		{"nulls are no parameters", "null", "null", ""},
		{"empty objects are no parameters", "{}", " { } ", ""},
		{"class only", `{"b":1,"a":2}`, "", `{"a":2,"b":1}`},
		{"set only", "", `{"x":"y"}`, `{"x":"y"}`},
		{"disjoint keys merge", `{"a":1}`, `{"b":2}`, `{"a":1,"b":2}`},
		{"scalar replaces scalar", `{"a":1}`, `{"a":"one"}`, `{"a":"one"}`},
		{"maps merge recursively", `{"m":{"x":1,"y":{"p":1,"q":2}}}`, `{"m":{"y":{"q":3,"r":4},"z":5}}`, `{"m":{"x":1,"y":{"p":1,"q":3,"r":4},"z":5}}`},
		{"lists replace, never concatenate", `{"l":[1,2,3],"k":[{"a":1}]}`, `{"l":[9],"k":[{"b":2}]}`, `{"k":[{"b":2}],"l":[9]}`},
		{"a map replaces a scalar", `{"a":1}`, `{"a":{"b":2}}`, `{"a":{"b":2}}`},
		{"a scalar replaces a map", `{"a":{"b":2}}`, `{"a":true}`, `{"a":true}`},
		{"a list replaces a map", `{"a":{"b":2}}`, `{"a":[1]}`, `{"a":[1]}`},
		{"null removes a key", `{"a":1,"b":2}`, `{"a":null}`, `{"b":2}`},
		{"null removes a nested key", `{"m":{"a":1,"b":2}}`, `{"m":{"b":null}}`, `{"m":{"a":1}}`},
		{"null of a missing key is a no-op", `{"a":1}`, `{"z":null}`, `{"a":1}`},
		{"nulls inside a new map are dropped (RFC 7386)", `{}`, `{"m":{"a":null,"b":1}}`, `{"m":{"b":1}}`},
		{"nulls inside a list are kept (lists are values)", `{}`, `{"l":[null,1]}`, `{"l":[null,1]}`},
		{"removing everything gives no parameters", `{"a":1}`, `{"a":null}`, ""},
		{"numbers are kept exactly", `{"big":12345678901234567890,"f":1.50}`, `{"e":1e3}`, `{"big":12345678901234567890,"e":1e3,"f":1.50}`},
		{"strings and unicode survive", `{"s":"<ü&>"}`, ``, `{"s":"\u003cü\u0026\u003e"}`},
		{"empty map in the set replaces nothing", `{"m":{"a":1}}`, `{"m":{}}`, `{"m":{"a":1}}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := MergeParameters([]byte(tc.base), []byte(tc.over))
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(got))
			// Canonical: merging the result over nothing gives it back.
			again, err := MergeParameters(got, nil)
			require.NoError(t, err)
			assert.Equal(t, tc.want, string(again))
		})
	}

	bad := []struct {
		name, base, over, msg string
	}{
		{"class parameters not an object", `[1,2]`, ``, "the class's parameters must be a JSON object, not an array"},
		{"set parameters a string", `{}`, `"x"`, "the set's parameters must be a JSON object, not a string"},
		{"set parameters a number", `{}`, `3`, "the set's parameters must be a JSON object, not a number"},
		{"invalid JSON", `{"a":`, ``, "the class's parameters are not valid JSON"},
		{"trailing data", `{} {}`, ``, "not one JSON value"},
		{"too large", `{"a":"` + strings.Repeat("x", MaxParametersBytes) + `"}`, ``, "more than the 65536 allowed"},
	}
	for _, tc := range bad {
		t.Run("bad: "+tc.name, func(t *testing.T) {
			_, err := MergeParameters([]byte(tc.base), []byte(tc.over))
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.msg)
		})
	}
}

func raw(s string) *runtime.RawExtension { return &runtime.RawExtension{Raw: []byte(s)} }

func classSet(mutate ...func(*v1alpha1.ExporterSet)) *v1alpha1.ExporterSet {
	s := &v1alpha1.ExporterSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "s"},
		Spec: v1alpha1.ExporterSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "s"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "s"}},
				Spec: corev1.PodSpec{
					NodeSelector: map[string]string{"zone": "set"},
					Tolerations:  []corev1.Toleration{{Key: "a", Operator: corev1.TolerationOpExists}},
					Containers: []corev1.Container{{Name: "vm", Resources: corev1.ResourceRequirements{
						Limits: corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("1Gi")}}}},
				},
			},
		},
	}
	for _, m := range mutate {
		m(s)
	}
	return s
}

func fullClass() *v1alpha1.VirtualTargetClass {
	probe := &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intOrStr(22)}}, PeriodSeconds: 2}
	return &v1alpha1.VirtualTargetClass{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "c", Generation: 7},
		Spec: v1alpha1.VirtualTargetClassSpec{
			Parameters: raw(`{"board":{"arch":"arm64","ram":"1G"},"tags":["a","b"]}`),
			Scheduling: &v1alpha1.ClassScheduling{
				NodeSelector: map[string]string{"zone": "class", "kvm": "yes"},
				Tolerations: []corev1.Toleration{{Key: "a", Operator: corev1.TolerationOpExists},
					{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}},
				Resources: &corev1.ResourceRequirements{
					Requests: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m")},
					Limits:   corev1.ResourceList{corev1.ResourceMemory: resource.MustParse("256Mi"), corev1.ResourceCPU: resource.MustParse("2")},
				},
				RuntimeClassName:          ptr.To("qemu"),
				TopologySpreadConstraints: []corev1.TopologySpreadConstraint{{MaxSkew: 1, TopologyKey: "kubernetes.io/hostname", WhenUnsatisfiable: corev1.ScheduleAnyway}},
			},
			PodDefaults: &v1alpha1.ClassPodDefaults{Image: "reg/os:1", TerminationGracePeriodSeconds: ptr.To[int64](5), ReadinessProbe: probe},
		},
	}
}

func TestResolve(t *testing.T) {
	t.Run("no class, no parameters: unchanged, same hash as before classes", func(t *testing.T) {
		s := classSet()
		r, err := Resolve(s, nil)
		require.Nil(t, err)
		assert.Equal(t, s.Spec, r.Set.Spec)
		assert.Equal(t, TemplateHash(&s.Spec.Template), setHash(r.Set))
		assert.Nil(t, r.Class)
		assert.Nil(t, r.Parameters)
		assert.Equal(t, v1alpha1.BindingModeImmediate, r.BindingMode)
	})
	t.Run("class defaults fill what the template leaves unset; the set's values win", func(t *testing.T) {
		s := classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.ClassName = "c"
			s.Spec.Parameters = raw(`{"board":{"ram":"2G"},"tags":["z"]}`)
		})
		orig := s.DeepCopy()
		r, err := Resolve(s, fullClass())
		require.Nil(t, err)
		assert.Equal(t, orig, s, "the set itself is not changed")
		ps := r.Set.Spec.Template.Spec
		assert.Equal(t, map[string]string{"zone": "set", "kvm": "yes"}, ps.NodeSelector)
		assert.Len(t, ps.Tolerations, 2, "the duplicate toleration is left out")
		assert.Equal(t, "qemu", *ps.RuntimeClassName)
		assert.Len(t, ps.TopologySpreadConstraints, 1)
		assert.Equal(t, int64(5), *ps.TerminationGracePeriodSeconds)
		c := ps.Containers[0]
		assert.Equal(t, "reg/os:1", c.Image)
		require.NotNil(t, c.ReadinessProbe)
		assert.Equal(t, int32(2), c.ReadinessProbe.PeriodSeconds)
		assert.Equal(t, "1Gi", ptr.To(c.Resources.Limits[corev1.ResourceMemory]).String(), "the set's limit wins")
		assert.Equal(t, "2", ptr.To(c.Resources.Limits[corev1.ResourceCPU]).String(), "the class fills the missing one")
		assert.Equal(t, "100m", ptr.To(c.Resources.Requests[corev1.ResourceCPU]).String())
		want := `{"board":{"arch":"arm64","ram":"2G"},"tags":["z"]}`
		assert.Equal(t, want, string(r.Parameters))
		assert.Equal(t, want, r.Set.Spec.Template.Annotations[v1alpha1.ParametersAnnotation])
		assert.Equal(t, []corev1.EnvVar{{Name: v1alpha1.ParametersEnv, ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{
			APIVersion: "v1", FieldPath: "metadata.annotations['qemu-kubelet.io/parameters']"}}}}, c.Env)
		assert.Equal(t, &v1alpha1.ClassStatus{Name: "c", Generation: 7, BindingMode: v1alpha1.BindingModeImmediate, ReclaimPolicy: v1alpha1.ReclaimPolicyDelete,
			StatePolicy: v1alpha1.StatePolicyDisabled}, r.Class)
		assert.NotContains(t, r.Set.Spec.Template.Annotations, v1alpha1.ReclaimPolicyAnnotation)
		assert.NotContains(t, r.Set.Spec.Template.Annotations, v1alpha1.StatePolicyAnnotation)
	})
	t.Run("a template without containers gets the class's VM container", func(t *testing.T) {
		s := classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName, s.Spec.Template.Spec.Containers = "c", nil })
		r, err := Resolve(s, fullClass())
		require.Nil(t, err)
		require.Len(t, r.Set.Spec.Template.Spec.Containers, 1)
		assert.Equal(t, "vm", r.Set.Spec.Template.Spec.Containers[0].Name)
		assert.Equal(t, "reg/os:1", r.Set.Spec.Template.Spec.Containers[0].Image)
	})
	t.Run("the set's own env var of that name is kept", func(t *testing.T) {
		s := classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.Parameters = raw(`{"a":1}`)
			s.Spec.Template.Spec.Containers[0].Env = []corev1.EnvVar{{Name: v1alpha1.ParametersEnv, Value: "mine"}}
		})
		r, err := Resolve(s, nil)
		require.Nil(t, err)
		assert.Equal(t, []corev1.EnvVar{{Name: v1alpha1.ParametersEnv, Value: "mine"}}, r.Set.Spec.Template.Spec.Containers[0].Env)
		assert.Equal(t, `{"a":1}`, r.Set.Spec.Template.Annotations[v1alpha1.ParametersAnnotation])
	})
	t.Run("Retain marks the pods", func(t *testing.T) {
		c := fullClass()
		c.Spec.ReclaimPolicy = v1alpha1.ReclaimPolicyRetain
		r, err := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" }), c)
		require.Nil(t, err)
		assert.Equal(t, "Retain", r.Set.Spec.Template.Annotations[v1alpha1.ReclaimPolicyAnnotation])
		assert.Equal(t, v1alpha1.ReclaimPolicyRetain, r.Class.ReclaimPolicy)
	})
	t.Run("state policy: the set's, else the class's, else Disabled; Retain marks the pods", func(t *testing.T) {
		for _, tc := range []struct {
			name     string
			set      v1alpha1.StatePolicy
			class    *v1alpha1.StatePolicy // nil: no class
			want     v1alpha1.StatePolicy
			annotate bool
		}{
			{"no class, unset", "", nil, v1alpha1.StatePolicyDisabled, false},
			{"no class, set Retain", v1alpha1.StatePolicyRetain, nil, v1alpha1.StatePolicyRetain, true},
			{"class Retain, set unset", "", ptr.To(v1alpha1.StatePolicyRetain), v1alpha1.StatePolicyRetain, true},
			{"class Retain, set Disabled wins", v1alpha1.StatePolicyDisabled, ptr.To(v1alpha1.StatePolicyRetain), v1alpha1.StatePolicyDisabled, false},
			{"class Disabled, set Retain wins", v1alpha1.StatePolicyRetain, ptr.To(v1alpha1.StatePolicyDisabled), v1alpha1.StatePolicyRetain, true},
			{"class unset, set unset", "", ptr.To(v1alpha1.StatePolicy("")), v1alpha1.StatePolicyDisabled, false},
		} {
			t.Run(tc.name, func(t *testing.T) {
				var c *v1alpha1.VirtualTargetClass
				s := classSet(func(s *v1alpha1.ExporterSet) { s.Spec.StatePolicy = tc.set })
				if tc.class != nil {
					c = fullClass()
					c.Spec.StatePolicy = *tc.class
					s.Spec.ClassName = "c"
				}
				r, err := Resolve(s, c)
				require.Nil(t, err)
				assert.Equal(t, tc.want, r.StatePolicy)
				if c != nil {
					assert.Equal(t, tc.want, r.Class.StatePolicy, "status.class shows the policy in effect")
				}
				v, ok := r.Set.Spec.Template.Annotations[v1alpha1.StatePolicyAnnotation]
				assert.Equal(t, tc.annotate, ok, "annotation present")
				if tc.annotate {
					assert.Equal(t, "Retain", v)
				}
			})
		}
		// Retain rolls the set; Disabled set explicitly hashes as unset
		// (no annotation: sets that never asked keep their pods).
		base, _ := Resolve(classSet(), nil)
		dis, _ := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.StatePolicy = v1alpha1.StatePolicyDisabled }), nil)
		ret, _ := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.StatePolicy = v1alpha1.StatePolicyRetain }), nil)
		assert.Equal(t, setHash(base.Set), setHash(dis.Set))
		assert.NotEqual(t, setHash(base.Set), setHash(ret.Set))
	})
	t.Run("Jumpstarter defaults merge: the set's endpoint and labels win", func(t *testing.T) {
		c := fullClass()
		c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{Endpoint: "class:443", CABundle: "CA", ExporterLabels: map[string]string{"board": "rpi4", "lab": "x"}}
		r, err := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" }), c)
		require.Nil(t, err)
		assert.Equal(t, &v1alpha1.JumpstarterSpec{Endpoint: "class:443", CABundle: "CA", ExporterLabels: map[string]string{"board": "rpi4", "lab": "x"}}, r.Set.Spec.Jumpstarter,
			"a class with jumpstarter makes its sets Jumpstarter mode")
		r, err = Resolve(classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.ClassName = "c"
			s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{Endpoint: "set:443", ExporterLabels: map[string]string{"lab": "y", "set": "s"}, GuestLoginSecretName: "login"}
		}), c)
		require.Nil(t, err)
		assert.Equal(t, &v1alpha1.JumpstarterSpec{Endpoint: "set:443", CABundle: "CA", ExporterLabels: map[string]string{"board": "rpi4", "lab": "y", "set": "s"}, GuestLoginSecretName: "login"}, r.Set.Spec.Jumpstarter,
			"the set's guest login Secret is kept")
		assert.Empty(t, c.Spec.Jumpstarter.ExporterLabels["set"], "the class is not changed")
		r, err = Resolve(classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.ClassName = "c"
			s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{DefaultGuestLogin: v1alpha1.DefaultGuestLoginNone}
		}), c)
		require.Nil(t, err)
		assert.Equal(t, v1alpha1.DefaultGuestLoginNone, r.Set.Spec.Jumpstarter.DefaultGuestLogin, "the set's default login switch is kept")
	})
	t.Run("sshDriver: the set's, Disabled becomes a pod annotation, Enabled is the default", func(t *testing.T) {
		c := fullClass()
		c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "rpi4"}}
		js := func(ssh v1alpha1.DriverSwitch, class bool) *v1alpha1.ExporterSet {
			return classSet(func(s *v1alpha1.ExporterSet) {
				if class {
					s.Spec.ClassName = "c"
				}
				s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
				s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4"}, SSHDriver: ssh}
			})
		}
		for _, class := range []bool{false, true} {
			var cl *v1alpha1.VirtualTargetClass
			if class {
				cl = c
			}
			base, err := Resolve(js("", class), cl)
			require.Nil(t, err)
			on, err := Resolve(js(v1alpha1.DriverEnabled, class), cl)
			require.Nil(t, err)
			off, err := Resolve(js(v1alpha1.DriverDisabled, class), cl)
			require.Nil(t, err)
			assert.NotContains(t, base.Set.Spec.Template.Annotations, v1alpha1.SSHDriverAnnotation, "class %v", class)
			assert.Equal(t, base.Set.Spec.Template.Annotations, on.Set.Spec.Template.Annotations, "Enabled is the default: same pods (class %v)", class)
			assert.Equal(t, "Disabled", off.Set.Spec.Template.Annotations[v1alpha1.SSHDriverAnnotation], "class %v", class)
			assert.Equal(t, v1alpha1.DriverDisabled, off.Set.Spec.Jumpstarter.SSHDriver, "the set's switch is kept (class %v)", class)
			assert.NotEqual(t, setHash(base.Set), setHash(off.Set), "switching it off rolls the pods (class %v)", class)
		}
	})
	t.Run("vncDriver: the set's, Disabled becomes the pod annotation display none, Enabled is the default", func(t *testing.T) {
		c := fullClass()
		c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "rpi4"}}
		js := func(vnc v1alpha1.DriverSwitch, class bool, templateDisplay string) *v1alpha1.ExporterSet {
			return classSet(func(s *v1alpha1.ExporterSet) {
				if class {
					s.Spec.ClassName = "c"
				}
				s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
				s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4"}, VNCDriver: vnc}
				if templateDisplay != "" {
					s.Spec.Template.Annotations = map[string]string{v1alpha1.DisplayAnnotation: templateDisplay}
				}
			})
		}
		for _, class := range []bool{false, true} {
			var cl *v1alpha1.VirtualTargetClass
			if class {
				cl = c
			}
			base, err := Resolve(js("", class, ""), cl)
			require.Nil(t, err)
			on, err := Resolve(js(v1alpha1.DriverEnabled, class, ""), cl)
			require.Nil(t, err)
			off, err := Resolve(js(v1alpha1.DriverDisabled, class, ""), cl)
			require.Nil(t, err)
			assert.NotContains(t, base.Set.Spec.Template.Annotations, v1alpha1.DisplayAnnotation, "the default display: no annotation (class %v)", class)
			assert.Equal(t, base.Set.Spec.Template.Annotations, on.Set.Spec.Template.Annotations, "Enabled is the default: same pods (class %v)", class)
			b, jerr := json.Marshal(base.Set.Spec.Jumpstarter)
			require.NoError(t, jerr)
			assert.NotContains(t, string(b), "vncDriver", "unset, the settings hash as before the field existed: existing sets keep their pods (class %v)", class)
			assert.Equal(t, "none", off.Set.Spec.Template.Annotations[v1alpha1.DisplayAnnotation], "class %v", class)
			assert.Equal(t, v1alpha1.DriverDisabled, off.Set.Spec.Jumpstarter.VNCDriver, "the set's switch is kept (class %v)", class)
			assert.NotEqual(t, setHash(base.Set), setHash(off.Set), "switching it off rolls the pods (class %v)", class)

			over, err := Resolve(js(v1alpha1.DriverDisabled, class, "vnc"), cl)
			require.Nil(t, err)
			assert.Equal(t, "none", over.Set.Spec.Template.Annotations[v1alpha1.DisplayAnnotation], "Disabled wins over the template's display (class %v)", class)
			own, err := Resolve(js("", class, "vnc"), cl)
			require.Nil(t, err)
			assert.Equal(t, "vnc", own.Set.Spec.Template.Annotations[v1alpha1.DisplayAnnotation], "the template's own display is left alone (class %v)", class)
		}
	})
	t.Run("lease state policy and hooks: the set's win, non-defaults become pod annotations", func(t *testing.T) {
		c := fullClass()
		off := &v1alpha1.LeaseHooks{AfterLease: &v1alpha1.LeaseHook{Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookPowerOff}}}}
		c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "rpi4"}, LeaseStatePolicy: v1alpha1.LeaseStatePolicyKeep, Hooks: off}
		r, err := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" }), c)
		require.Nil(t, err)
		ann := r.Set.Spec.Template.Annotations
		assert.Equal(t, "Keep", ann[v1alpha1.LeaseStatePolicyAnnotation], "the class's Keep")
		assert.JSONEq(t, `{"afterLease":{"actions":[{"action":"powerOff"}]}}`, ann[v1alpha1.LeaseHooksAnnotation])

		on := &v1alpha1.LeaseHooks{BeforeLease: &v1alpha1.LeaseHook{Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookPowerOn}}, Timeout: 30, OnFailure: v1alpha1.LeaseHookEndLease}}
		r, err = Resolve(classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.ClassName = "c"
			s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
			s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{LeaseStatePolicy: v1alpha1.LeaseStatePolicyReset, Hooks: on}
		}), c)
		require.Nil(t, err)
		ann = r.Set.Spec.Template.Annotations
		assert.NotContains(t, ann, v1alpha1.LeaseStatePolicyAnnotation, "the set's Reset wins and is the default")
		assert.JSONEq(t, `{"beforeLease":{"actions":[{"action":"powerOn"}],"timeout":30,"onFailure":"endLease"}}`, ann[v1alpha1.LeaseHooksAnnotation], "the set's hooks replace the class's")
		assert.Equal(t, off, c.Spec.Jumpstarter.Hooks, "the class is not changed")

		// A Reuse set that asks for nothing (or for the default) gets no
		// annotation; Keep or hooks roll the set.
		js := func(f func(*v1alpha1.JumpstarterSpec)) *v1alpha1.ExporterSet {
			return classSet(func(s *v1alpha1.ExporterSet) {
				s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReuse
				s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4"}}
				f(s.Spec.Jumpstarter)
			})
		}
		base, _ := Resolve(js(func(*v1alpha1.JumpstarterSpec) {}), nil)
		reset, _ := Resolve(js(func(j *v1alpha1.JumpstarterSpec) { j.LeaseStatePolicy = v1alpha1.LeaseStatePolicyReset }), nil)
		keep, _ := Resolve(js(func(j *v1alpha1.JumpstarterSpec) { j.LeaseStatePolicy = v1alpha1.LeaseStatePolicyKeep }), nil)
		hooked, _ := Resolve(js(func(j *v1alpha1.JumpstarterSpec) { j.Hooks = on }), nil)
		assert.Equal(t, base.Set.Spec.Template.Annotations, reset.Set.Spec.Template.Annotations)
		assert.NotContains(t, base.Set.Spec.Template.Annotations, v1alpha1.LeaseStatePolicyAnnotation)
		assert.NotEqual(t, setHash(base.Set), setHash(keep.Set))
		assert.NotEqual(t, setHash(base.Set), setHash(hooked.Set))

		// A Replace set's pods are deleted at lease end: Keep, even when
		// the set asks for Reset (a reset would boot a VM about to go).
		for _, p := range []v1alpha1.LeaseStatePolicy{"", v1alpha1.LeaseStatePolicyReset} {
			r, err := Resolve(classSet(func(s *v1alpha1.ExporterSet) {
				s.Spec.RecyclePolicy = v1alpha1.RecyclePolicyReplace
				s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4"}, LeaseStatePolicy: p}
			}), nil)
			require.Nil(t, err)
			assert.Equal(t, "Keep", r.Set.Spec.Template.Annotations[v1alpha1.LeaseStatePolicyAnnotation], "Replace set, policy %q", p)
		}
	})
	t.Run("class changes change the hash; a binding mode change does not", func(t *testing.T) {
		s := classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" })
		c := fullClass()
		c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "rpi4"}}
		r0, _ := Resolve(s, c)
		h0 := setHash(r0.Set)
		for name, change := range map[string]func(*v1alpha1.VirtualTargetClass){
			"parameters": func(c *v1alpha1.VirtualTargetClass) { c.Spec.Parameters = raw(`{"board":{"arch":"x86"}}`) },
			"image":      func(c *v1alpha1.VirtualTargetClass) { c.Spec.PodDefaults.Image = "reg/os:2" },
			"toleration": func(c *v1alpha1.VirtualTargetClass) { c.Spec.Scheduling.Tolerations = nil },
			"reclaim":    func(c *v1alpha1.VirtualTargetClass) { c.Spec.ReclaimPolicy = v1alpha1.ReclaimPolicyRetain },
			"state":      func(c *v1alpha1.VirtualTargetClass) { c.Spec.StatePolicy = v1alpha1.StatePolicyRetain },
			"endpoint":   func(c *v1alpha1.VirtualTargetClass) { c.Spec.Jumpstarter.Endpoint = "new:443" },
		} {
			c2 := c.DeepCopy()
			change(c2)
			r, err := Resolve(s, c2)
			require.Nil(t, err)
			assert.NotEqual(t, h0, setHash(r.Set), "a %s change rolls", name)
		}
		c2 := c.DeepCopy()
		c2.Spec.BindingMode = v1alpha1.BindingModeWaitForFirstConsumer
		c2.Generation++
		r, err := Resolve(s, c2)
		require.Nil(t, err)
		assert.Equal(t, h0, setHash(r.Set), "the binding mode moves the target, not the pods")
		assert.Equal(t, v1alpha1.BindingModeWaitForFirstConsumer, r.BindingMode)
		// Equal parameters written differently hash alike.
		a, _ := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.Parameters = raw(`{"a":1,"b":[1]}`) }), nil)
		b, _ := Resolve(classSet(func(s *v1alpha1.ExporterSet) { s.Spec.Parameters = raw(`{ "b": [1], "a": 1 }`) }), nil)
		assert.Equal(t, setHash(a.Set), setHash(b.Set))
	})
	errs := []struct {
		name   string
		set    *v1alpha1.ExporterSet
		class  *v1alpha1.VirtualTargetClass
		reason string
		msg    string
	}{
		{"missing class", classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "gone" }), nil, ReasonClassNotFound,
			`VirtualTargetClass "gone" not found in namespace ns`},
		{"parameters not an object", classSet(func(s *v1alpha1.ExporterSet) { s.Spec.Parameters = raw(`[1]`) }), nil, ReasonInvalidParameters,
			"the set's parameters must be a JSON object"},
		{"Jumpstarter without labels anywhere", classSet(func(s *v1alpha1.ExporterSet) { s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{Endpoint: "x:1"} }), nil,
			ReasonInvalidJumpstarter, "needs exporter labels"},
		{"an exec step with too many arguments", classSet(func(s *v1alpha1.ExporterSet) {
			s.Spec.Jumpstarter = &v1alpha1.JumpstarterSpec{ExporterLabels: map[string]string{"board": "rpi4"}, Hooks: &v1alpha1.LeaseHooks{AfterLease: &v1alpha1.LeaseHook{
				Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookReset}, {Action: v1alpha1.LeaseHookExec, Command: make([]string, 65)}}}}}
		}), nil, ReasonInvalidJumpstarter, "spec.jumpstarter.hooks.afterLease.actions[1]: exec: command has 65 arguments: want 1 to 64"},
		{"a class's exec step with an empty argument", classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" }), func() *v1alpha1.VirtualTargetClass {
			c := fullClass()
			c.Spec.Jumpstarter = &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "rpi4"}, Hooks: &v1alpha1.LeaseHooks{BeforeLease: &v1alpha1.LeaseHook{
				Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookExec, Command: []string{"touch", ""}}}}}}
			return c
		}(), ReasonInvalidJumpstarter, "spec.jumpstarter.hooks.beforeLease.actions[0]: exec: command argument 1 is empty"},
		{"WaitForFirstConsumer without Jumpstarter", classSet(func(s *v1alpha1.ExporterSet) { s.Spec.ClassName = "c" }), func() *v1alpha1.VirtualTargetClass {
			c := fullClass()
			c.Spec.BindingMode = v1alpha1.BindingModeWaitForFirstConsumer
			return c
		}(), ReasonInvalidBindingMode, "needs Jumpstarter mode"},
	}
	for _, tc := range errs {
		t.Run("error: "+tc.name, func(t *testing.T) {
			r, err := Resolve(tc.set, tc.class)
			assert.Nil(t, r)
			require.NotNil(t, err)
			assert.Equal(t, tc.reason, err.Reason)
			assert.Contains(t, err.Message, tc.msg)
		})
	}
}

func intOrStr(p int) intstr.IntOrString { return intstr.FromInt32(int32(p)) }
