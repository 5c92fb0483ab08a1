package controller

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
	qktest "github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

func createClass(t *testing.T, c *v1alpha1.VirtualTargetClass) {
	t.Helper()
	require.NoError(t, env.client.Create(context.Background(), c))
}

// TestEnvtestClassResolution: a set naming a class gets the class's
// defaults and the merged parameters on its pods and status; a missing
// class stops the set with ClassNotFound until the class appears; a class
// change rolls the pods; a binding mode change does not.
func TestEnvtestClassResolution(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	ctx := context.Background()

	// 1. The class does not exist yet: nothing is created, the reason says why.
	createSet(t, sampleSet(ns, "cls", 2, func(s *v1alpha1.ExporterSet) {
		s.Spec.ClassName = "small"
		s.Spec.Template.Spec.Containers[0].Image = "" // from the class
		s.Spec.Parameters = raw(`{"board":{"ram":"2G","gone":null},"tags":["set"]}`)
	}))
	s := waitStatus(t, ns, "cls", "ClassNotFound", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Reason == ReasonClassNotFound
	})
	assert.Contains(t, condition(s.Status, v1alpha1.ConditionReplicaFailure).Message, `VirtualTargetClass "small" not found in namespace `+ns)
	time.Sleep(time.Second) // a pass more would have created by now
	assert.Empty(t, pods(t, ns, "cls"), "a set whose class is missing creates nothing")
	// The API server keeps the null of the set's parameters (it removes
	// the class's key in the merge).
	assert.JSONEq(t, `{"board":{"ram":"2G","gone":null},"tags":["set"]}`, string(getSet(t, ns, "cls").Spec.Parameters.Raw))

	// 2. The class appears: the set resolves it (the class watch) and
	// creates its pods from the defaults.
	createClass(t, &v1alpha1.VirtualTargetClass{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "small"},
		Spec: v1alpha1.VirtualTargetClassSpec{
			Parameters: raw(`{"board":{"arch":"arm64","ram":"1G","gone":true},"tags":["class"],"owner":"lab"}`),
			Scheduling: &v1alpha1.ClassScheduling{NodeSelector: map[string]string{"type": "virtual-kubelet"},
				Tolerations: []corev1.Toleration{{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule}}},
			PodDefaults: &v1alpha1.ClassPodDefaults{Image: "registry.invalid/os/debian:13", TerminationGracePeriodSeconds: ptr.To[int64](7)},
		},
	})
	ps := waitPodCount(t, ns, "cls", 2)
	const merged = `{"board":{"arch":"arm64","ram":"2G"},"owner":"lab","tags":["set"]}`
	for _, p := range ps {
		assert.Equal(t, "registry.invalid/os/debian:13", p.Spec.Containers[0].Image)
		assert.Equal(t, "virtual-kubelet", p.Spec.NodeSelector["type"])
		assert.Equal(t, int64(7), *p.Spec.TerminationGracePeriodSeconds)
		assert.Contains(t, p.Spec.Tolerations, corev1.Toleration{Key: "virtual-kubelet.io/provider", Operator: corev1.TolerationOpEqual, Value: "qemu", Effect: corev1.TaintEffectNoSchedule})
		assert.Equal(t, merged, p.Annotations[v1alpha1.ParametersAnnotation])
		require.Len(t, p.Spec.Containers[0].Env, 1)
		assert.Equal(t, "metadata.annotations['qemu-kubelet.io/parameters']", p.Spec.Containers[0].Env[0].ValueFrom.FieldRef.FieldPath)
	}
	readyAll(t, ps)
	s = waitStatus(t, ns, "cls", "class resolved, 2 available", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return st.AvailableReplicas == 2 && st.Class != nil && c != nil && c.Status == metav1.ConditionFalse
	})
	assert.Equal(t, "small", s.Status.Class.Name)
	assert.Equal(t, v1alpha1.BindingModeImmediate, s.Status.Class.BindingMode, "the class's defaults are applied by the API server")
	assert.Equal(t, v1alpha1.ReclaimPolicyDelete, s.Status.Class.ReclaimPolicy)
	require.NotNil(t, s.Status.Parameters)
	assert.JSONEq(t, merged, string(s.Status.Parameters.Raw))
	gen := s.Status.Class.Generation
	out := mustKubectl(t, "-n", ns, "get", "exs", "cls", "-o", "wide")
	assert.Contains(t, out, "small", "kubectl get -o wide shows the class")
	out = mustKubectl(t, "-n", ns, "get", "vtc")
	assert.Regexp(t, `small\s+Immediate\s+Delete`, out)

	first := uids(ps)

	// 3. A class change that changes the pods rolls the set like a
	// template change: new pods from the new defaults, the old ones go once
	// the new are Ready.
	mustKubectl(t, "-n", ns, "patch", "vtc", "small", "--type=merge", "-p",
		`{"spec":{"podDefaults":{"image":"registry.invalid/os/debian:14"},"parameters":{"owner":"ci"}}}`)
	var fresh []corev1.Pod
	eventually(t, "pods from the changed class", func() (bool, string) {
		fresh = nil
		for _, p := range pods(t, ns, "cls") {
			if p.Spec.Containers[0].Image == "registry.invalid/os/debian:14" {
				fresh = append(fresh, p)
			}
		}
		return len(fresh) == 2, fmt.Sprintf("%d new pods", len(fresh))
	})
	for _, p := range fresh {
		assert.Equal(t, `{"board":{"arch":"arm64","ram":"2G"},"owner":"ci","tags":["set"]}`, p.Annotations[v1alpha1.ParametersAnnotation])
	}
	readyAll(t, fresh)
	eventually(t, "old pods replaced", func() (bool, string) {
		now := uids(pods(t, ns, "cls"))
		for u := range first {
			if _, ok := now[u]; ok {
				return false, fmt.Sprintf("%v", now)
			}
		}
		return len(now) == 2, fmt.Sprintf("%v", now)
	})
	s = waitStatus(t, ns, "cls", "rolled to the new class", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return st.UpdatedReplicas == 2 && st.AvailableReplicas == 2 && c != nil && c.Reason == "Complete" && st.Class != nil && st.Class.Generation > gen
	})
	assert.JSONEq(t, `{"board":{"arch":"arm64","ram":"2G"},"owner":"ci","tags":["set"]}`, string(s.Status.Parameters.Raw))

	// 4. Retain (reclaim and, as the set's default, state): the pods carry
	// the annotations the node reads (and roll).
	second := uids(pods(t, ns, "cls"))
	mustKubectl(t, "-n", ns, "patch", "vtc", "small", "--type=merge", "-p", `{"spec":{"reclaimPolicy":"Retain","statePolicy":"Retain"}}`)
	eventually(t, "pods marked Retain", func() (bool, string) {
		n := 0
		for _, p := range pods(t, ns, "cls") {
			if p.Annotations[v1alpha1.ReclaimPolicyAnnotation] == "Retain" && p.Annotations[v1alpha1.StatePolicyAnnotation] == "Retain" {
				n++
			}
		}
		return n == 2, fmt.Sprintf("%d marked", n)
	})
	readyAll(t, pods(t, ns, "cls"))
	waitStatus(t, ns, "cls", "Retain in status", func(st v1alpha1.ExporterSetStatus) bool {
		return st.Class != nil && st.Class.ReclaimPolicy == v1alpha1.ReclaimPolicyRetain && st.Class.StatePolicy == v1alpha1.StatePolicyRetain &&
			st.UpdatedReplicas == 2 && st.AvailableReplicas == 2
	})
	var third map[types.UID]string
	eventually(t, "only the 2 Retain pods left", func() (bool, string) {
		ps := pods(t, ns, "cls")
		third = uids(ps)
		for _, p := range ps {
			if p.Annotations[v1alpha1.ReclaimPolicyAnnotation] != "Retain" || p.Annotations[v1alpha1.StatePolicyAnnotation] != "Retain" {
				return false, fmt.Sprintf("%v", third)
			}
		}
		return len(ps) == 2, fmt.Sprintf("%v", third)
	})
	for u := range second {
		assert.NotContains(t, third, u)
	}

	// 5. The class goes away: the set stops (no pod deleted, none created).
	require.NoError(t, env.client.Delete(ctx, &v1alpha1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "small"}}))
	waitStatus(t, ns, "cls", "ClassNotFound again", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionReplicaFailure)
		return c != nil && c.Reason == ReasonClassNotFound
	})
	assert.Equal(t, third, uids(pods(t, ns, "cls")), "the pods stay as they are")
}

// TestEnvtestClassValidation: the API server refuses bad classes with the
// markers' messages, and applies the defaults.
func TestEnvtestClassValidation(t *testing.T) {
	ns := namespace(t)
	ctx := context.Background()
	bad := []struct {
		name string
		spec string
		msg  string
	}{
		{"unknown binding mode", `{"bindingMode":"Later"}`, `Unsupported value: "Later"`},
		{"unknown reclaim policy", `{"reclaimPolicy":"Keep"}`, `Unsupported value: "Keep"`},
		{"unknown state policy", `{"statePolicy":"Keep"}`, `Unsupported value: "Keep"`},
		{"parameters not an object", `{"parameters":[1,2]}`, `spec.parameters: Invalid value: "array"`},
		{"reserved exporter label", `{"jumpstarter":{"exporterLabels":{"qemu-kubelet.io/x":"y"}}}`, "must not use the qemu-kubelet.io/ prefix"},
		{"exec step without a command", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"exec"}]}}}}`, "command is set exactly when action is exec"},
		{"command on a power step", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"powerOn","command":["true"]}]}}}}`, "command is set exactly when action is exec"},
		{"exec step with 65 arguments", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"exec","command":["a"` + strings.Repeat(`,"a"`, 64) + `]}]}}}}`, "must have at most 64 items"},
		{"exec step with an empty argument", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"exec","command":["touch",""]}]}}}}`, "at least 1 chars long"},
		{"flash step without its image", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"flash"}]}}}}`, "flash is set exactly when action is flash"},
		{"flash on a reset step", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"reset","flash":{"image":"reg.example/os:1"}}]}}}}`, "flash is set exactly when action is flash"},
		{"flash of an image without tag or digest", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"flash","flash":{"image":"reg.example/os"}}]}}}}`, "spec.jumpstarter.hooks.afterLease.actions[0].flash.image: Invalid value"},
		{"flash onto an unknown partition", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"flash","flash":{"image":"reg.example/os:1","partition":"efi"}}]}}}}`, `Unsupported value: "efi"`},
		{"exec step with a 4097-byte argument", `{"jumpstarter":{"exporterLabels":{"board":"x"},"hooks":{"afterLease":{"actions":[{"action":"exec","command":["echo","` + strings.Repeat("x", 4097) + `"]}]}}}}`, "command[1]: Too long"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			manifest := fmt.Sprintf(`{"apiVersion":"qemu-kubelet.io/v1alpha1","kind":"VirtualTargetClass","metadata":{"name":"bad","namespace":%q},"spec":%s}`, ns, tc.spec)
			f := filepath.Join(t.TempDir(), "bad.json")
			require.NoError(t, os.WriteFile(f, []byte(manifest), 0o600))
			out, err := kubectl(t, "create", "-f", f)
			require.Error(t, err, out)
			assert.Contains(t, out, tc.msg)
		})
	}
	createClass(t, &v1alpha1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "plain"}})
	createClass(t, &v1alpha1.VirtualTargetClass{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "exec-hook"}, Spec: v1alpha1.VirtualTargetClassSpec{
		Jumpstarter: &v1alpha1.ClassJumpstarter{ExporterLabels: map[string]string{"board": "x"}, Hooks: &v1alpha1.LeaseHooks{AfterLease: &v1alpha1.LeaseHook{
			Actions: []v1alpha1.LeaseHookStep{{Action: v1alpha1.LeaseHookReset}, {Action: v1alpha1.LeaseHookExec, Command: []string{"/bin/sh", "-c", "rm -rf /home/*/.ssh"}},
				{Action: v1alpha1.LeaseHookFlash, Flash: &v1alpha1.LeaseHookFlashSpec{Image: "reg.example/fw@sha256:" + strings.Repeat("0a", 32), Partition: "bios"}}}}}}}})
	var c v1alpha1.VirtualTargetClass
	require.NoError(t, env.client.Get(ctx, types.NamespacedName{Namespace: ns, Name: "plain"}, &c))
	assert.Equal(t, v1alpha1.BindingModeImmediate, c.Spec.BindingMode)
	assert.Equal(t, v1alpha1.ReclaimPolicyDelete, c.Spec.ReclaimPolicy)

	// A set's bad scale-in policy, and the set's default.
	err := env.client.Create(ctx, sampleSet(ns, "badpolicy", 1, func(s *v1alpha1.ExporterSet) { s.Spec.ScaleInPolicy = "Random" }))
	require.Error(t, err)
	assert.True(t, apierrors.IsInvalid(err), "%v", err)
	assert.Contains(t, err.Error(), `Unsupported value: "Random"`)
	createSet(t, sampleSet(ns, "defaults", 0, func(s *v1alpha1.ExporterSet) { s.Spec.Autohealing = &v1alpha1.AutohealingSpec{} }))
	s := getSet(t, ns, "defaults")
	assert.Equal(t, v1alpha1.ScaleInNewest, s.Spec.ScaleInPolicy)
	assert.Equal(t, int32(3), *s.Spec.Autohealing.StartUpFailureThreshold)
	assert.Equal(t, 5*time.Minute, s.Spec.Autohealing.MinFailingToStartDuration.Duration)
	explain := mustKubectl(t, "explain", "virtualtargetclasses.spec.parameters")
	assert.Contains(t, explain, "deep-merged")
}

// TestEnvtestRemovalLowersReplicas: pods marked for removal go and
// spec.replicas drops once per pod, through the real API (the set patch
// with its resourceVersion precondition); Explicit never chooses on its
// own; a leased marked pod waits for its release; paused holds it all.
func TestEnvtestRemovalLowersReplicas(t *testing.T) {
	ns := namespace(t)
	startManager(t, ns)
	createSet(t, sampleSet(ns, "rm", 4, func(s *v1alpha1.ExporterSet) { s.Spec.ScaleInPolicy = v1alpha1.ScaleInExplicit }))
	ps := waitPodCount(t, ns, "rm", 4)
	readyAll(t, ps)
	waitStatus(t, ns, "rm", "4 available", func(st v1alpha1.ExporterSetStatus) bool { return st.AvailableReplicas == 4 })
	all := uids(ps)

	// Explicit: scaling to 2 removes nothing.
	mustKubectl(t, "-n", ns, "scale", "exs/rm", "--replicas=2")
	s := waitStatus(t, ns, "rm", "ExplicitScaleIn", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return c != nil && c.Reason == "ExplicitScaleIn"
	})
	assert.Contains(t, condition(s.Status, v1alpha1.ConditionProgressing).Message, "2 pods above target 2")
	time.Sleep(time.Second) // cooldown is 0: a scale-down would have happened
	assert.Equal(t, all, uids(pods(t, ns, "rm")))

	// Mark one: it goes, replicas 2 -> 1, no replacement.
	mustKubectl(t, "-n", ns, "annotate", "pod", ps[1].Name, v1alpha1.RemoveAnnotation+"=true")
	eventually(t, "marked pod removed, replicas lowered", func() (bool, string) {
		now := uids(pods(t, ns, "rm"))
		_, there := now[ps[1].UID]
		r := *getSet(t, ns, "rm").Spec.Replicas
		return !there && len(now) == 3 && r == 1, fmt.Sprintf("pods %v replicas %d", now, r)
	})
	s = getSet(t, ns, "rm")
	assert.Equal(t, int32(1), *s.Spec.Replicas, "lowered once")

	// A leased marked pod waits; the mark on a free one is honoured at once.
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"=ci", v1alpha1.UsedLabel+"=true")
	mustKubectl(t, "-n", ns, "annotate", "pod", ps[0].Name, v1alpha1.RemoveAnnotation+"=true")
	waitStatus(t, ns, "rm", "removal waits for release", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return st.LeasedReplicas == 1 && c != nil && (c.Reason == "RemovalWaitsForRelease" || c.Reason == "ExplicitScaleIn")
	})
	assert.Contains(t, uids(pods(t, ns, "rm")), ps[0].UID)
	assert.Equal(t, int32(1), *getSet(t, ns, "rm").Spec.Replicas)

	// Paused: a new mark waits, nothing moves.
	mustKubectl(t, "-n", ns, "patch", "exs", "rm", "--type=merge", "-p", `{"spec":{"paused":true}}`)
	waitStatus(t, ns, "rm", "paused", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return c != nil && c.Reason == "Paused" && c.Status == metav1.ConditionUnknown
	})
	mustKubectl(t, "-n", ns, "annotate", "pod", ps[2].Name, v1alpha1.RemoveAnnotation+"=true")
	s = waitStatus(t, ns, "rm", "paused sees the mark", func(st v1alpha1.ExporterSetStatus) bool {
		c := condition(st, v1alpha1.ConditionProgressing)
		return c != nil && c.Reason == "Paused" && strings.Contains(c.Message, "1 pods marked")
	})
	time.Sleep(time.Second)
	assert.Contains(t, uids(pods(t, ns, "rm")), ps[2].UID, "paused: the marked pod stays")
	assert.Equal(t, int32(1), *getSet(t, ns, "rm").Spec.Replicas)

	// Unpaused: it goes (replicas 1 -> 0); release the leased marked pod: it
	// goes too (replicas stay 0); the last pod stays (Explicit).
	mustKubectl(t, "-n", ns, "patch", "exs", "rm", "--type=merge", "-p", `{"spec":{"paused":false}}`)
	mustKubectl(t, "-n", ns, "label", "pod", ps[0].Name, v1alpha1.LeaseLabel+"-")
	eventually(t, "both marked pods removed", func() (bool, string) {
		now := uids(pods(t, ns, "rm"))
		return len(now) == 1 && now[ps[3].UID] != "", fmt.Sprintf("%v", now)
	})
	s = getSet(t, ns, "rm")
	assert.Equal(t, int32(0), *s.Spec.Replicas)
	time.Sleep(time.Second)
	assert.Len(t, pods(t, ns, "rm"), 1, "Explicit: the unmarked pod stays above a target of 0, none is created")
	eventually(t, "bookkeeping annotation cleared", func() (bool, string) {
		v := getSet(t, ns, "rm").Annotations[v1alpha1.RemovingAnnotation]
		return v == "", v
	})
	var evs corev1.EventList
	require.NoError(t, env.client.List(context.Background(), &evs, client.InNamespace(ns)))
	var msgs []string
	for _, e := range evs.Items {
		if e.Reason == EventReplicasLowered {
			msgs = append(msgs, e.Message)
		}
	}
	all3 := strings.Join(msgs, "\n")
	for _, p := range ps[:3] {
		assert.Contains(t, all3, p.Name, "a ReplicasLowered event names each removed pod")
	}
	assert.Contains(t, all3, "spec.replicas 2 -> 1")
}

// TestEnvtestSamplesValid: the manifests in config/samples are accepted by
// the API server with the CRDs as generated (server-side dry run).
func TestEnvtestSamplesValid(t *testing.T) {
	root, err := qktest.RepoRoot()
	require.NoError(t, err)
	files, err := filepath.Glob(filepath.Join(root, "config", "samples", "*.yaml"))
	require.NoError(t, err)
	require.NotEmpty(t, files)
	for _, f := range files {
		out := mustKubectl(t, "apply", "--server-side", "--dry-run=server", "-f", f)
		assert.Contains(t, out, "serverside-applied (server dry run)", filepath.Base(f))
	}
}

// TestEnvtestDocManifestsValid: every ExporterSet and VirtualTargetClass the
// user docs show in full (a yaml block with apiVersion qemu-kubelet.io/...)
// is accepted by the API server with the CRDs as generated (server-side dry
// run, in a test namespace).
func TestEnvtestDocManifestsValid(t *testing.T) {
	ns := namespace(t)
	checked := map[string]int{}
	for _, rel := range []string{"docs/jumpstarter-quickstart.md", "docs/exporterset.md", "docs/install.md", "docs/pods.md"} {
		doc, err := doctest.Read(rel)
		require.NoError(t, err)
		for i, block := range doc.CodeBlocks("yaml") {
			for j, part := range strings.Split(block, "\n---\n") {
				var obj map[string]any
				if err := yaml.Unmarshal([]byte(part), &obj); err != nil || !strings.HasPrefix(fmt.Sprint(obj["apiVersion"]), v1alpha1.GroupVersion.Group+"/") {
					continue
				}
				meta, _ := obj["metadata"].(map[string]any)
				require.NotNil(t, meta, "%s, yaml block %d: no metadata", rel, i+1)
				meta["namespace"] = ns
				b, err := yaml.Marshal(obj)
				require.NoError(t, err)
				f := filepath.Join(t.TempDir(), fmt.Sprintf("block%d-%d.yaml", i, j))
				require.NoError(t, os.WriteFile(f, b, 0o600))
				out, err := kubectl(t, "apply", "--server-side", "--dry-run=server", "-f", f)
				assert.NoError(t, err, "%s, yaml block %d (%s %v): %s", rel, i+1, obj["kind"], meta["name"], out)
				checked[rel]++
			}
		}
	}
	assert.Positive(t, checked["docs/jumpstarter-quickstart.md"], "the quick start's ExporterSet is checked")
	assert.GreaterOrEqual(t, checked["docs/exporterset.md"], 3, "exporterset.md's sets and class are checked")
}
